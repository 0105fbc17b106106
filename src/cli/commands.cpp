#include "cli/commands.h"

#include "cli/launch.h"
#include "cli/plan_cmd.h"
#include "remat/bench.h"
#include "remat/config.h"
#include "remat/memory.h"
#include "remat/policy.h"
#include "remat/dist.h"
#include "remat/trainer.h"
#include "train/run_dir.h"
#include "util/device.h"
#include "util/utf8.h"
#include "util/stop_signals.h"

#include <CLI/CLI.hpp>
#include <malloc.h>
#include <cctype>
#include <unistd.h>
#include <csignal>
#include <algorithm>
#include <filesystem>
#include <string_view>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace remat::cli {
namespace {

// Each key with its default, what it sets and, for a number, the values it accepts.
void print_config_keys() {
  const Config defaults;
  size_t width = 0;
  for (const auto& k : config_keys()) width = std::max(width, k.name.size());
  for (const auto& k : config_keys()) {
    const std::string v = k.get(defaults);
    std::string help = k.help;
    if (k.range) {
      help += " [" + k.range->text() + (k.range->example.empty() ? "" : "; e.g. " + k.range->example) + "]";
    }
    fmt::print("  {:<{}} {:<14} {}\n", k.name, width, v.empty() || v[0] == '#' ? "(unset)" : v, help);
  }
  fmt::print("\npresets: {}\n", fmt::join(preset_names(), ", "));
}

int cmd_prepare(const std::string& config_file, const std::vector<std::string>& overrides) {
  const Config cfg = load_run_config(config_file, overrides);
  set_threads(cfg.run.threads);
  const data::CorpusInfo info = prepare_data(cfg.data);
  fmt::print("corpus     {}{}\n", info.dir, info.cached ? " (cached)" : "");
  fmt::print("source     {}\n", info.source);
  if (info.text_bytes > 0) {
    fmt::print("text       {} bytes, sha256 {}\n", info.text_bytes, info.text_sha256);
  } else {
    fmt::print("ids        read as written, sha256 {}\n", info.text_sha256);
  }
  fmt::print(
      "tokenizer  {} tokens, {} ({})\n", info.vocab_size, info.tokenizer_path(),
      info.tokenizer_source == "trained" ? "BPE trained here" : "from " + util::printable(info.tokenizer_source));
  fmt::print("tokens     {} train + {} validation ({}){}\n", info.train_tokens, info.val_tokens,
             info.token_bytes == 2 ? "uint16" : "uint32",
             info.text_bytes > 0 ? fmt::format(", {:.2f} bytes/token", info.bytes_per_token()) : "");
  fmt::print(
      "entropy    {:.4f} nats/token (unigram, train): a trained model's validation loss must fall well "
      "below it\n",
      info.train_unigram_entropy);
  return 0;
}

// A run stopped by a signal (after a checkpoint, or in its final sample) exits as the shell
// expects of that signal.
int train_exit(const TrainSummary& s) { return s.stopped_by == 0 ? 0 : 128 + s.stopped_by; }

bool changes_training(const std::string& setting) {
  const std::string key = setting.substr(0, setting.find('='));
  return std::find(resume_settings().begin(), resume_settings().end(), key) == resume_settings().end();
}

// Where a restarted start of a job (remat launch --max-restarts, torchrun's) continues: the
// run directory its first start made, once it holds a checkpoint; empty for a first start
// or a job that failed before its first checkpoint (it starts again from step 0).
std::string restarted_run(const Config& cfg) {
  const JobStart job = job_start();
  if (job.restart == 0 || job.run_id.empty()) return {};
  const std::string dir = find_job_run(cfg.run.out_dir, job.run_id);
  if (const auto ranks = dist::launch_env(); !ranks || ranks->rank == 0) {
    fmt::print(stderr, "restart {} of job {}: {}\n", job.restart, util::printable(job.run_id),
               dir.empty() ? fmt::format("no run of it under {} holds a checkpoint; it starts again from step 0",
                                         util::printable(cfg.run.out_dir))
                           : fmt::format("continuing {} from its newest whole checkpoint", dir));
  }
  return dir;
}

int cmd_train(const std::string& config_file, const std::vector<std::string>& overrides, const std::string& resume) {
  if (!resume.empty() && (!config_file.empty() || std::any_of(overrides.begin(), overrides.end(), changes_training))) {
    throw std::invalid_argument(fmt::format(
        "--resume continues {} with its own config.toml, so its settings cannot change on the way; drop --config and "
        "the key=value settings (all but {}, which change only the final sample and the display).",
        resume, fmt::join(resume_settings(), ", ")));
  }
  if (!resume.empty()) check_path("--resume", resume);
  std::string dir = resume;
  std::vector<std::string> kept = overrides;
  if (dir.empty()) {
    const Config given = load_run_config(config_file, overrides);
    dir = restarted_run(given);
    // A restart continues with the run's own config.toml, as --resume does.
    if (dir.empty()) return train_exit(train(given));
    kept.erase(std::remove_if(kept.begin(), kept.end(), changes_training), kept.end());
  }
  Config saved = load_run_config((std::filesystem::path(dir) / "config.toml").string(), kept);
  // The first start's outputs, written then: a resumed run traces no step again (and a
  // config.toml from someone else's hands cannot name where files are written).
  saved.run.trace.clear();
  saved.run.record_allocations.clear();
  return train_exit(train(saved, dir));
}

// The items of a list option given as ';'-separated text, repeated options or both (a
// policy holds commas and brackets, never ';'). Given but naming nothing is refused.
std::vector<std::string> split_list(const std::vector<std::string>& args, const std::string& option,
                                    const std::string& example) {
  std::vector<std::string> items;
  for (const auto& arg : args) {
    size_t begin = 0;
    while (begin <= arg.size()) {
      const size_t end = std::min(arg.find(';', begin), arg.size());
      const std::string item = arg.substr(begin, end - begin);
      const size_t first = item.find_first_not_of(" \t");
      if (first != std::string::npos) items.push_back(item.substr(first, item.find_last_not_of(" \t") - first + 1));
      begin = end + 1;
    }
  }
  if (!args.empty() && items.empty()) {
    throw std::invalid_argument(
        fmt::format("{} is empty; give at least one item, e.g. {} '{}', or leave the option "
                    "out.",
                    option, option, example));
  }
  return items;
}

// error_text's cut of a long message: its start and end around a note.
std::string bounded(const std::string& message) {
  constexpr size_t kMost = 2000, kEnd = 600;
  if (message.size() <= kMost) return message;
  const std::string head = util::clip(message, kMost - kEnd);
  size_t tail = message.size() - kEnd;
  while (tail < message.size() && (static_cast<unsigned char>(message[tail]) & 0xC0) == 0x80) ++tail;
  const size_t kept = head.rfind("... (");  // clip's note, replaced by the one below
  return fmt::format("{} [... {} bytes left out ...] {}", head.substr(0, kept), tail - kept, message.substr(tail));
}

// The directory a --plot file goes to must exist and be writable.
void check_plot_directory(const std::string& plot) {
  const std::filesystem::path dir = std::filesystem::absolute(plot).parent_path();
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec) || ::access(dir.c_str(), W_OK) != 0) {
    throw std::invalid_argument(
        fmt::format("--plot {} cannot be written: {} is not {}; give a path in a writable "
                    "directory.",
                    util::printable(plot), util::printable(dir.string()),
                    std::filesystem::is_directory(dir, ec) ? "writable" : "a directory"));
  }
}

// Says so, and returns true, where argv's first word names no subcommand of `app`: CLI11
// says only "A subcommand is required" of it.
bool refused_command(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return false;
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    names.push_back(sub->get_name());
  if (std::find(names.begin(), names.end(), argv[1]) != names.end()) return false;
  fmt::print(stderr, "error: '{}' is not a remat command; the commands are {} (`remat --help` says what each does).\n",
             util::printable(argv[1]), fmt::join(names, ", "));
  return true;
}

}  // namespace

std::string filesystem_text(const std::filesystem::filesystem_error& e) {
  const std::string path = e.path1().empty() ? "a file" : util::printable(e.path1().string());
  std::string advice;
  if (e.code() == std::errc::too_many_symbolic_link_levels) {
    advice =
        ": it is a loop of symbolic links (a link that leads back to itself); point it at a real file or remove it";
  } else if (e.code() == std::errc::permission_denied) {
    advice = ": this user may not read it (or a folder above it); change its permissions or run as its owner";
  } else if (e.code() == std::errc::no_such_file_or_directory) {
    advice = ": it does not exist; check the path";
  }
  return fmt::format("Cannot use {} ({}){}.", path, e.code().message(), advice);
}

std::string error_text(const std::string& message) {
  // The CUDA caching allocator's refusal: its first sentence names the request and the GPU.
  if (const size_t oom = message.find("CUDA out of memory."); oom != std::string::npos) {
    const size_t tried = message.find("Tried to allocate", oom);
    // "Tried to allocate 2.00 GiB. GPU 0 ..." or "... 20.00 MiB (GPU 0; ...": up to its end.
    const size_t end =
        tried == std::string::npos ? tried : std::min(message.find(". ", tried), message.find(" (", tried));
    return fmt::format(
        "The GPU ran out of memory{}: it had less free than the run's plan predicted, through other processes on it "
        "(see nvidia-smi) or the allocator's fragmentation. Give ac.budget a value below the GPU's free memory (remat "
        "plans the caching allocator's reserved bytes under it), set run.expandable_segments=true, or lower "
        "train.batch or train.seq.",
        tried == std::string::npos ? "" : " (" + util::printable(message.substr(tried, end - tried), 200) + ")");
  }
  const std::string marker = "you tried to allocate ";
  const size_t at = message.find(marker);
  const size_t digits = at == std::string::npos ? 0 : at + marker.size();
  if (message.find("can't allocate memory") == std::string::npos || at == std::string::npos ||
      digits >= message.size() || std::isdigit(static_cast<unsigned char>(message[digits])) == 0) {
    return util::terminal_text(bounded(message));
  }
  const std::string count = message.substr(digits, message.find_first_not_of("0123456789", digits) - digits);
  return fmt::format(
      "This machine could not allocate {} bytes for one tensor{}: the model, batch or sequence is "
      "too large for its memory; lower model.d_model, model.d_ff, model.vocab_size, train.batch or "
      "train.seq (`remat plan` with the same settings shows what a step needs, allocating nothing).",
      count, count.size() <= 18 ? " (" + memory::format_bytes(std::stoll(count)) + ")" : "");
}

int run(int argc, char** argv) {
  memory::install_cpu_tracking();
  // Freed tensor memory stays in the heap for the next step: glibc otherwise returns
  // multi-MiB blocks to the kernel and every step page-faults its activations in again
  // (measured: 240 -> 183 ms per default step, and recompute then costs what it computes).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  util::end_on_stop_signals();
  CLI::App app{"remat: transformer training with planned activation recomputation"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show every subcommand's help");

  std::string config_file;
  std::vector<std::string> overrides;
  bool help_config = false;

  auto* prepare = app.add_subcommand("prepare", "Build the token corpus and tokenizer (cached)");
  std::string text_file;
  prepare->add_option("--config", config_file, "TOML config file")->check(CLI::ExistingFile);
  prepare->add_option("--text", text_file,
                      "File or glob to prepare instead of the King James Bible (data.text; data.format says what "
                      "it holds)");
  prepare->add_option("overrides", overrides, "key=value settings, e.g. data.vocab_size=4096");

  auto* train_cmd = app.add_subcommand("train", "Train a model (prepares the data first if needed)");
  train_cmd->add_option("--config", config_file, "TOML config file (see configs/)")->check(CLI::ExistingFile);
  train_cmd->add_flag("--help-config", help_config, "List every config key with its default");
  bool explain_ac = false;
  train_cmd->add_flag("--explain-ac", explain_ac,
                      "Print the per-layer recompute plan the ac.* settings compile to, and exit");
  std::string trace_file;
  train_cmd->add_option("--trace", trace_file,
                        "Write step 3 (or the last) as Chrome-trace JSON to this file (sets run.trace); "
                        "open it in https://ui.perfetto.dev");
  std::string allocations_file;
  train_cmd->add_option("--record-allocations", allocations_file,
                        "Write every allocation and free up to the end of step 2, with the allocator's allocated and "
                        "reserved bytes after each, to this file (sets run.record_allocations)");
  std::string resume_dir;
  train_cmd->add_option("--resume", resume_dir,
                        "Continue the run in this directory from its newest checkpoint, with its own config.toml");
  train_cmd->add_option("overrides", overrides, "key=value settings, e.g. train.steps=200 model.preset=llama-demo");

  auto* plan_cmd =
      app.add_subcommand("plan", "The run `remat train` would run, its plan and predicted step (allocates nothing)");
  PlanArgs plan_args;
  plan_cmd->add_option("--config", config_file, "TOML config file (see configs/)")->check(CLI::ExistingFile);
  plan_cmd->add_option("--budget", plan_args.budget,
                       "Memory budget, as ac.budget: bytes with a unit (12GiB, 96MiB) or a fraction of the "
                       "no-recompute peak (0.6); without it, the plan the ac settings name");
  plan_cmd->add_flag("--pareto", plan_args.pareto, "Print and plot the memory/time frontier with the manual policies");
  plan_cmd->add_option("--plot", plan_args.plot, "PNG file --pareto draws (default pareto.png)");
  plan_cmd->add_flag("--json", plan_args.json, "Print the plan, memory breakdown and frontier as JSON");
  plan_cmd->add_flag("--explain-block", plan_args.explain_block,
                     "Print one block's values (shape, bytes, slot, producer) as its graph declares them");
  plan_cmd->add_option("--prices", plan_args.prices,
                       "A run directory (or its prices.json): price the plan as that run did, with its "
                       "config.toml unless --config names one, to print the plan it ran");
  plan_cmd->add_option("overrides", overrides, "key=value settings, e.g. model.preset=llama3-8b train.seq=8192");
  auto* bench_cmd = app.add_subcommand(
      "bench",
      "Measure the peak memory and step time of recompute policies on this machine (under remat launch: "
      "every rank's)");
  std::vector<std::string> policy_args, budget_args;
  BenchOptions bench;
  bench_cmd->add_option("--config", config_file, "TOML config file (see configs/)")->check(CLI::ExistingFile);
  bench_cmd
      ->add_option("--policies", policy_args,
                   "Policies to sweep, ';'-separated or repeated "
                   "(default: none;modules:[core_attn];every:2;uniform:2;full)")
      ->allow_extra_args(false);
  bench_cmd
      ->add_option("--budgets", budget_args,
                   "Memory budgets to sweep (ac.budget: a size like 96MiB or a fraction like 0.6 of the "
                   "no-recompute peak), ';'-separated or repeated (default: no budgets)")
      ->allow_extra_args(false);
  bench_cmd->add_option("--steps", bench.steps, "Measured steps per entry, after the warm-up")->capture_default_str();
  bench_cmd->add_option("--warmup", bench.warmup, "Unmeasured steps per entry before the measured ones")
      ->capture_default_str();
  bench_cmd->add_option("--out", bench.out, "Output directory (default: <run.out_dir>/bench-<timestamp>)");
  bench_cmd->add_option("overrides", overrides, "key=value settings for every entry, e.g. model.preset=llama-demo");

  auto* gen = app.add_subcommand("generate", "Sample text from a finished run's weights");
  std::string run_dir, prompt = "And God said";
  int64_t tokens = 200, top_k = 40, seed = 0;
  double temperature = 0.8;
  gen->add_option("--run", run_dir, "Run directory written by `remat train`")->required();
  gen->add_option("--prompt", prompt, "Text to continue");
  // Each token re-runs the context and the streamed text is decoded whole each time.
  gen->add_option("--tokens", tokens, "Tokens to generate (1 to 100000), printed as they come")
      ->check(CLI::Range(int64_t{1}, int64_t{100000}));
  gen->add_option("--temperature", temperature, "Sampling temperature (0: greedy; at most 100)")
      ->check(CLI::Range(0.0, 100.0));
  gen->add_option("--top-k", top_k, "Sample among the k most likely tokens (0: all)")->check(CLI::NonNegativeNumber);
  gen->add_option("--seed", seed, "Sampling seed");
  std::string gen_device;
  gen->add_option("--device", gen_device, "cpu or cuda[:N] (default: the run's device)");

  auto* launch_cmd = app.add_subcommand(
      "launch", "Run a subcommand as N local ranks of one distributed job, like torchrun (one launcher per node)");
  LaunchArgs launch_args;
  launch_cmd->add_option("--nproc", launch_args.nproc, "Ranks to start on this machine (1 to 1024)")->required();
  launch_cmd->add_option("--nnodes", launch_args.nnodes, "Nodes in the job, each running remat launch")
      ->capture_default_str();
  launch_cmd->add_option("--node-rank", launch_args.node_rank, "This node's index, from 0 (node 0 hosts the store)")
      ->capture_default_str();
  launch_cmd->add_option("--master-addr", launch_args.master_addr,
                         "Node 0's address as every node reaches it (default: 127.0.0.1, one node only)");
  launch_cmd->add_option("--master-port", launch_args.master_port,
                         "Port of rank 0's store (default: a free one, one node only)");
  launch_cmd->add_option("--grace", launch_args.grace, "Seconds the ranks get to stop after SIGTERM, before SIGKILL")
      ->capture_default_str();
  launch_cmd
      ->add_option("--max-restarts", launch_args.max_restarts,
                   "Start a failed job again up to this many times; train continues from its newest checkpoint")
      ->capture_default_str();
  launch_cmd->add_option("--run-id", launch_args.run_id,
                         "The job's id, the same on every node (needed for restarts over several nodes)");
  // From the subcommand's name on, everything goes to the ranks unparsed, options included.
  launch_cmd->prefix_command();
  launch_cmd->footer(
      fmt::format("The subcommand ({}) and its arguments follow these options; every rank gets them "
                  "unchanged.",
                  fmt::join(launchable_subcommands(), ", ")));

  // CLI11 reads "--budget=" as "--budget" and takes the next argument for its value.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.size() > 3 && arg.rfind("--", 0) == 0 && arg.find('=') == arg.size() - 1) {
      fmt::print(stderr, "error: {} gives {} an empty value; write the value after '=' or leave the option out.\n", arg,
                 arg.substr(0, arg.size() - 1));
      return 1;
    }
  }
  if (refused_command(app, argc, argv)) return 1;
  CLI11_PARSE(app, argc, argv);

  try {
    if (prepare->parsed()) {
      if (!text_file.empty()) overrides.push_back("data.text=" + text_file);
      return cmd_prepare(config_file, overrides);
    }
    if (train_cmd->parsed()) {
      if (!trace_file.empty()) overrides.push_back("run.trace=" + trace_file);
      if (!allocations_file.empty()) overrides.push_back("run.record_allocations=" + allocations_file);
      if (help_config) {
        print_config_keys();
        return 0;
      }
      if (explain_ac) {
        const Config cfg = load_config(config_file, overrides);
        if (!cfg.ac.budget.empty()) {
          throw std::invalid_argument(fmt::format(
              "--explain-ac prints the plan a policy compiles to, but ac.budget = \"{}\" leaves the plan to the "
              "planner; see it with `remat plan --budget {}` and the same settings.",
              cfg.ac.budget, cfg.ac.budget));
        }
        fmt::print("{}", explain_plan(compile_policy(cfg.ac, cfg.model.n_layer, cfg.model.dropout)));
        return 0;
      }
      // An empty --resume (an unset shell variable) would otherwise start a fresh run.
      if (train_cmd->count("--resume") > 0 && resume_dir.empty()) {
        throw std::invalid_argument(
            "--resume \"\" names no run directory; give the directory of the run to continue "
            "(e.g. --resume runs/20260101-120000-gpt2-demo), or leave the option out to start a "
            "new run.");
      }
      return cmd_train(config_file, overrides, resume_dir);
    }
    if (plan_cmd->parsed()) {
      if (plan_cmd->count("--budget") > 0 && plan_args.budget.empty()) {
        throw std::invalid_argument(
            "--budget \"\" gives --budget an empty value; give a budget (e.g. --budget 12GiB "
            "or --budget 0.6) or leave the option out for the plan the ac settings name.");
      }
      check_path("--plot", plan_args.plot);
      // Refused before the sweep rather than reported after it, when the plot cannot be written.
      if (plan_args.pareto) check_plot_directory(plan_args.plot);
      // A run's prices come with its settings, unless other ones are given.
      if (!plan_args.prices.empty() && config_file.empty() && std::filesystem::is_directory(plan_args.prices)) {
        config_file = (std::filesystem::path(plan_args.prices) / "config.toml").string();
      }
      return cmd_plan(load_config(config_file, overrides), plan_args);
    }
    if (bench_cmd->parsed()) {
      std::vector<std::string> policies = split_list(policy_args, "--policies", "none;full");
      if (policy_args.empty()) policies = {"none", "modules:[core_attn]", "every:2", "uniform:2", "full"};
      check_path("--out", bench.out);
      bench.config_file = config_file;
      bench.overrides = overrides;
      bench.entries = bench_entries(policies, split_list(budget_args, "--budgets", "96MiB;0.6"));
      const BenchResult result = run_bench(bench);
      if (result.rank == 0) fmt::print("{}", format_bench_table(result));
      return 0;
    }
    if (launch_cmd->parsed()) {
      launch_args.command = launch_cmd->remaining();
      return cmd_launch(launch_args);
    }
    if (gen->parsed()) {
      check_path("--run", run_dir);
      set_threads(0);
      int64_t generated = 0;
      generate_from_run(
          run_dir, prompt, tokens, temperature, top_k, static_cast<uint64_t>(seed), gen_device,
          [](std::string_view piece) {
            fmt::print("{}", piece);
            std::fflush(stdout);
          },
          &generated);
      fmt::print("\n");
      if (generated < tokens) {
        fmt::print(stderr,
                   "(the model ended the text with its end-of-text token after {} of the {} tokens asked for)\n",
                   generated, tokens);
      }
      return 0;
    }
  } catch (const c10::Error& e) {
    fmt::print(stderr, "error: {}\n", error_text(e.what_without_backtrace()));
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    fmt::print(stderr, "error: {}\n", error_text(filesystem_text(e)));
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", error_text(e.what()));
    return 1;
  }
  return 0;
}

}  // namespace remat::cli
