#include "remat/bench.h"

#include "remat/config.h"
#include "remat/data.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "remat/trainer.h"
#include "run/run.h"
#include "dist/ranks.h"
#include "train/data_parallel.h"
#include "util/device.h"
#include "profile/profile.h"
#include "util/progress.h"
#include "train/run_dir.h"
#include "train/step.h"
#include "util/stop_signals.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>

namespace remat {
namespace {

// An entry's configuration, loaded and checked before any entry runs, then resolved.
struct PreparedEntry {
  Config config;
  RunSpec spec;
};

PreparedEntry prepare_entry(const BenchOptions& o, const BenchEntry& entry) {
  // An unknown key is named as such here: load_config's own sentence would blame a
  // "command-line override" the user never typed.
  for (const auto& kv : entry.overrides) {
    const std::string key = kv.substr(0, kv.find('='));
    const auto& keys = config_keys();
    if (std::none_of(keys.begin(), keys.end(), [&](const ConfigKey& k) { return k.name == key; })) {
      throw std::invalid_argument(
          fmt::format("Bench entry '{}' sets {}, which is an unknown config key; leave the entry out of the sweep.",
                      entry.label, key));
    }
    // The ranks join once, before the first entry, as the sweep's settings group them.
    if (key.rfind("parallel.", 0) == 0) {
      throw std::invalid_argument(fmt::format(
          "Bench entry '{}' sets {}, but every entry of a sweep runs on the same ranks, joined once; set {} for the "
          "whole sweep (a key=value beside the options) and bench each value in its own sweep.",
          entry.label, key, key));
    }
  }
  std::vector<std::string> overrides = o.overrides;
  overrides.insert(overrides.end(), entry.overrides.begin(), entry.overrides.end());
  PreparedEntry p;
  try {
    // Validates the entry (its policy or budget syntax); the plan itself is solved once
    // the vocabulary is known.
    p.config = load_run_config(o.config_file, overrides);
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("Bench entry '{}': {}", entry.label, e.what()));
  }
  return p;
}

// This rank's model of `cfg` on `layout`: its share of every layer under tensor
// parallelism, its stage's layers under pipeline parallelism.
std::unique_ptr<Model> create_model(const Config& cfg, const Layout& layout, at::Device device, at::ScalarType dtype,
                                    dist::Comm* ranks) {
  return Model::create(cfg.model, device, dtype, static_cast<uint64_t>(cfg.run.seed), layout,
                       layout.tp > 1 ? &ranks->tensor() : nullptr);
}

// Trains one entry on a fresh model and measures the steps after the warm-up: on every
// rank of `ranks` at once, each step ending in their collectives; `run` is rank 0's.
BenchRow run_entry(const BenchEntry& entry, const PreparedEntry& p, const BenchOptions& o,
                   const data::TokenDataset& train_ds, at::Device device, at::ScalarType dtype, dist::Comm* ranks,
                   RunDir* run, ProgressBar& bar, int64_t& steps_done) {
  const Config& cfg = p.spec.cfg;
  const RunPlan& planned = p.spec.plan;
  const auto seed = static_cast<uint64_t>(cfg.run.seed);
  memory::release_cached(device);  // the earlier entries' segments are not this entry's
  auto model = create_model(cfg, p.spec.layout, device, dtype, ranks);
  apply_plan(*model, planned.plan, cfg.ac);
  TrainStep stepper(*model, p.spec.local.train, seed, ranks, cfg.parallel.zero, cfg.parallel.schedule,
                    cfg.parallel.overlap_grad_reduce);
  std::mt19937_64 rng(seed);  // the same batches for every entry

  BenchRow row;
  row.entry = entry.label;
  row.policy = planned.plan.policy;
  row.attention = attention_name(cfg.model.attention);
  row.loss_head = loss_head_name(cfg.model.loss_head);
  row.predicted_peak_bytes = planned.measured_peak();
  row.predicted_rank_peak_bytes = planned.rank_peaks(ranks != nullptr ? ranks->size() : 1, cfg.parallel.tp);
  row.stage_layers = planned.split;
  row.predicted_step_seconds = planned.step_seconds;
  row.predicted_copy_seconds = planned.predicted.copy_seconds;
  row.predicted_copy_wait_seconds = planned.predicted.copy_wait_seconds;
  row.predicted_copy_slowdown_seconds = planned.predicted.copy_slowdown_seconds;
  row.budget_bytes = planned.budget;
  row.predicted_cuda_allocated_bytes = planned.device_peak().allocated_peak;
  row.predicted_cuda_reserved_bytes = planned.device_peak().reserved_peak;
  row.predicted_activation_bytes = model->predict_activation_bytes(p.spec.local.train.batch, cfg.train.seq).total();
  for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
    const StepResult r = stepper.run(step, train_ds, rng);
    // After the timed step, so the gather costs the step time nothing.
    const RankStep gathered = gather_step(ranks, r.peak_bytes, 0, step + 1);
    const bool measured = step >= o.warmup;
    if (measured) {
      row.step_seconds.push_back(r.seconds);
      keep_highest(row.rank_peak_bytes, gathered.peaks);
      row.reserved_peak_bytes = std::max(row.reserved_peak_bytes, r.reserved_peak_bytes);
    }
    row.activation_bytes = r.activations.total();
    row.ops_recomputed = r.counters.ops_recomputed;
    row.bytes_recomputed = r.counters.bytes_recomputed;
    row.final_loss = r.loss;
    if (run != nullptr) {
      run->log_metrics({{"entry", entry.label},
                        {"step", step + 1},
                        {"measured", measured},
                        {"loss", r.loss},
                        {"step_seconds", r.seconds},
                        {"memory_bytes", r.current_bytes},
                        {"peak_bytes", *std::max_element(gathered.peaks.begin(), gathered.peaks.end())},
                        {"rank_peak_bytes", gathered.peaks},
                        {"activation_bytes", r.activations.total()},
                        {"ops_recomputed", r.counters.ops_recomputed}});
    }
    bar.update(++steps_done, fmt::format("{} step {}/{}", entry.label, step + 1, o.warmup + o.steps));
  }
  row.peak_bytes = *std::max_element(row.rank_peak_bytes.begin(), row.rank_peak_bytes.end());
  row.median_step_seconds = median(row.step_seconds);
  row.min_step_seconds = *std::min_element(row.step_seconds.begin(), row.step_seconds.end());
  row.max_step_seconds = *std::max_element(row.step_seconds.begin(), row.step_seconds.end());
  const auto& t = cfg.train;  // the whole batch, every data-parallel rank's rows
  row.tokens_per_second = static_cast<double>(t.batch * t.seq * t.grad_accum) / row.median_step_seconds;
  return row;
}

// One CSV field: quoted when it holds a comma, quote or line break (policies hold commas).
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string to_csv(const std::vector<BenchRow>& rows) {
  std::string out =
      "entry,policy,median_step_seconds,min_step_seconds,max_step_seconds,tokens_per_second,peak_bytes,"
      "activation_bytes,predicted_activation_bytes,ops_recomputed,bytes_recomputed,final_loss,"
      "predicted_peak_bytes,predicted_step_seconds,budget_bytes,rank_peak_bytes,reserved_peak_bytes,"
      "predicted_cuda_allocated_bytes,predicted_cuda_reserved_bytes\n";
  for (const auto& r : rows) {
    out += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", csv_field(r.entry),
                       csv_field(r.policy), r.median_step_seconds, r.min_step_seconds, r.max_step_seconds,
                       r.tokens_per_second, r.peak_bytes, r.activation_bytes, r.predicted_activation_bytes,
                       r.ops_recomputed, r.bytes_recomputed, r.final_loss, r.predicted_peak_bytes,
                       r.predicted_step_seconds, r.budget_bytes, fmt::join(r.rank_peak_bytes, " "),
                       r.reserved_peak_bytes, r.predicted_cuda_allocated_bytes, r.predicted_cuda_reserved_bytes);
  }
  return out;
}

nlohmann::json row_json(const BenchRow& r) {
  return {{"entry", r.entry},
          {"policy", r.policy},
          {"attention", r.attention},
          {"loss_head", r.loss_head},
          {"median_step_seconds", r.median_step_seconds},
          {"min_step_seconds", r.min_step_seconds},
          {"max_step_seconds", r.max_step_seconds},
          {"tokens_per_second", r.tokens_per_second},
          {"peak_bytes", r.peak_bytes},
          {"activation_bytes", r.activation_bytes},
          {"predicted_activation_bytes", r.predicted_activation_bytes},
          {"ops_recomputed", r.ops_recomputed},
          {"bytes_recomputed", r.bytes_recomputed},
          {"final_loss", r.final_loss},
          {"predicted_peak_bytes", r.predicted_peak_bytes},
          {"predicted_step_seconds", r.predicted_step_seconds},
          {"predicted_copy_seconds", r.predicted_copy_seconds},
          {"predicted_copy_wait_seconds", r.predicted_copy_wait_seconds},
          {"predicted_copy_slowdown_seconds", r.predicted_copy_slowdown_seconds},
          {"budget_bytes", r.budget_bytes},
          {"reserved_peak_bytes", r.reserved_peak_bytes},
          {"predicted_cuda_allocated_bytes", r.predicted_cuda_allocated_bytes},
          {"predicted_cuda_reserved_bytes", r.predicted_cuda_reserved_bytes},
          {"rank_peak_bytes", r.rank_peak_bytes},
          {"predicted_rank_peak_bytes", r.predicted_rank_peak_bytes},
          {"stage_layers", r.stage_layers},
          {"step_seconds", r.step_seconds}};
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

std::vector<BenchEntry> bench_entries(const std::vector<std::string>& policies,
                                      const std::vector<std::string>& budgets) {
  std::vector<BenchEntry> entries;
  for (const auto& p : policies) entries.push_back({p, {"ac.policy=" + p}});
  for (const auto& b : budgets) entries.push_back({"budget=" + b, {"ac.budget=" + b}});
  return entries;
}

namespace {

void check_options(const BenchOptions& o) {
  if (o.entries.empty()) {
    throw std::invalid_argument(
        "The sweep has no entries; give at least one policy (--policies) or budget (--budgets).");
  }
  if (o.steps < 1) throw std::invalid_argument(fmt::format("--steps must be at least 1, got {}.", o.steps));
  if (o.warmup < 0) throw std::invalid_argument(fmt::format("--warmup must be 0 or more, got {}.", o.warmup));
}

// The sweep's directory (rank 0's): under --out, or a new one under run.out_dir.
std::unique_ptr<RunDir> open_bench_dir(const BenchOptions& o, const Config& common) {
  std::filesystem::path out(o.out);
  if (!out.has_filename()) out = out.parent_path();  // "dir/" names dir
  auto run = std::make_unique<RunDir>(
      o.out.empty() ? common.run.out_dir : (out.has_parent_path() ? out.parent_path().string() : "."),
      o.out.empty() ? "bench-" + RunDir::timestamp() : out.filename().string(), common.model.preset);
  run->write_text("config.toml", config_to_toml(common));
  return run;
}

// The reference row (the first `none`, else the first) and whether every final loss is
// its, which every policy's is meant to be; warns on the lead rank where one is not.
void compare_losses(BenchResult& result, const Config& common, at::Device device, const RunDir* run) {
  for (size_t i = 0; i < result.rows.size(); ++i) {
    if (result.rows[i].policy == "none") {
      result.reference = i;
      break;
    }
  }
  const double reference_loss = result.rows[result.reference].final_loss;
  for (const auto& r : result.rows) result.losses_equal = result.losses_equal && r.final_loss == reference_loss;
  if (run == nullptr || result.losses_equal) return;
  std::string losses;
  for (const auto& r : result.rows) losses += fmt::format("{}{} {}", losses.empty() ? "" : ", ", r.entry, r.final_loss);
  if (device.is_cuda() && common.model.attention == Attention::sdpa) {
    // ATen's flash backward adds dq's key blocks in a varying order (docs/results.md).
    fmt::print(stderr,
               "warning: the final losses differ across entries ({}): on CUDA the sdpa op's flash backward sums "
               "each query's gradient over key blocks in an order that varies from run to run, so policies agree "
               "to rounding there, not bit for bit; model.attention = math is bitwise exact.\n",
               losses);
  } else {
    fmt::print(stderr,
               "warning: the final losses differ across entries ({}); every policy is meant to be bitwise "
               "exact, so this is a bug worth reporting with {}.\n",
               losses, run->file("bench.json"));
  }
}

// What the sweep ran on, for bench.json and the plot's title.
struct Machine {
  at::Device device;
  int threads = 0;
  bool ranked = false;  ///< several ranks (the peaks are the highest rank's)
};

// bench.csv, bench.json and bench.png in `run`.
void write_results(const BenchResult& result, const BenchOptions& o, const Config& common, const Config& local,
                   const Machine& machine, RunDir& run) {
  const auto& t = common.train;
  const at::Device device = machine.device;
  const int threads = machine.threads;
  run.write_text("bench.csv", to_csv(result.rows));
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& r : result.rows) rows.push_back(row_json(r));
  const nlohmann::json json = {
      {"machine",
       {{"device", device.str()},
        {"threads", threads},
        {"blas", blas_name()},
        {"dtype", common.run.dtype},
        {"preset", common.model.preset},
        {"batch", t.batch},
        {"seq", t.seq},
        {"grad_accum", t.grad_accum}}},
      {"ranks",
       {{"dp", local.parallel.dp},
        {"tp", common.parallel.tp},
        {"sp", common.parallel.sp},
        {"zero", common.parallel.zero},
        {"pp", common.parallel.pp},
        {"schedule", pipeline::schedule_name(common.parallel.schedule)}}},
      {"warmup", o.warmup},
      {"steps", o.steps},
      {"reference", result.rows[result.reference].entry},
      {"losses_equal", result.losses_equal},
      {"rows", rows},
  };
  run.write_text("bench.json", json.dump(2) + "\n");

  std::vector<PlotPoint> points;
  for (const auto& r : result.rows) points.push_back({mib(r.peak_bytes), r.median_step_seconds * 1e3, r.entry});
  std::string why;
  const bool plotted = run.plot_points(
      "bench.png",
      fmt::format("remat bench: {} on {} ({} threads{}), {} x {} tokens{}", common.model.preset, device.str(), threads,
                  machine.ranked ? " per rank" : "", t.batch, t.seq, describe_ranks(local)),
      machine.ranked ? "step peak of the highest rank (MiB)" : "step peak (MiB)", "median step (ms)", points, &why);
  fmt::print(stderr, "bench dir {}: bench.csv, bench.json{}, config.toml, metrics.jsonl\n", run.path(),
             plotted ? ", bench.png" : "");
  if (!plotted) fmt::print(stderr, "no plot: {}\n", why);
}

}  // namespace

BenchResult run_bench(const BenchOptions& o) {
  const util::Phase phase("benchmarking");
  check_options(o);

  Config common = load_config(o.config_file, o.overrides);
  std::vector<PreparedEntry> prepared;
  for (const auto& e : o.entries) prepared.push_back(prepare_entry(o, e));

  // Started by a launcher with several ranks, every rank runs every entry's steps in
  // lockstep (the steps' collectives join them); rank 0 alone prints and writes the files.
  const std::unique_ptr<dist::Comm> ranks = join_ranks(common, "bench");
  const bool lead = ranks == nullptr || ranks->rank() == 0;
  const QuietStderr quiet(!lead);
  const int threads = set_threads(rank_threads(common));
  const at::Device device = available_device(rank_device(common, ranks.get()));
  if (device.is_cuda()) memory::configure_cuda_allocator(common.run.expandable_segments);
  const at::ScalarType dtype = device_dtype(dtype_of(common.run.dtype), device);
  memory::install_cpu_tracking();
  data::CorpusInfo corpus;
  rank0_first(ranks.get(), "preparing the corpus", [&] { corpus = prepare_data(common.data); });
  // Both splits, as a training run holds them (its plan counts them).
  const data::TokenDataset train_ds = data::TokenDataset::open(corpus, data::Split::train);
  const data::TokenDataset val_ds = data::TokenDataset::open(corpus, data::Split::val);
  // Every entry's learning-rate schedule spans exactly the steps it runs.
  const int64_t entry_steps = o.warmup + o.steps;
  common.train.steps = entry_steps;
  RunInputs in;
  in.dtype = dtype;
  in.stage = common.parallel.pp > 1 ? ranks->pipeline().rank() : 0;
  in.corpus = corpus;
  in.corpus_dir = corpus_dir(common.data);
  in.memory_available = rank_memory(device, ranks.get());
  in.host_available = rank_memory(at::kCPU, ranks.get());
  // One price list per attention op and loss head for the sweep (every entry has the same
  // shapes), measured on a scratch model of the sweep's settings or read from the cache;
  // for the entries that offload, with the host copies measured as `remat train` does.
  // (Pipeline stages measure it on a probe of two layers, as `remat train` does.)
  const Config local = rank_share(resolve_config(common, corpus));
  const double matmul_rate = local.ac.profile ? 0.0
                                              : measure_matmul_flops(device, dtype, local.train.batch * local.train.seq,
                                                                     common.model.d_model, common.model.d_ff);
  PriceSource prices(
      [&](const Config& op) {
        Config probed = local;
        probed.model.attention = op.model.attention;
        probed.model.loss_head = op.model.loss_head;
        std::unique_ptr<Model> probe;  // freed once measured
        return run_prices(
            probed, device, dtype, train_ds, ranks.get(), matmul_rate,
            [&] { return create_model(probed, layout_of(probed, 0), device, dtype, ranks.get()); }, probe);
      },
      [&](const Config&, Prices& p) { add_host_copy(p, device, dtype, ranks.get()); });
  in.prices = &prices;
  // Every entry's plan and prediction, so an infeasible budget fails before anything trains.
  for (size_t i = 0; i < prepared.size(); ++i) {
    try {
      prepared[i].config.train.steps = entry_steps;
      prepared[i].spec = resolve_run(prepared[i].config, in);
    } catch (const std::exception& e) {
      throw std::invalid_argument(fmt::format("Bench entry '{}': {}", o.entries[i].label, e.what()));
    }
  }

  std::unique_ptr<RunDir> run;
  if (lead) run = open_bench_dir(o, common);

  const auto& t = common.train;
  fmt::print(stderr,
             "bench: {} entries x ({} warm-up + {} measured) steps of {} x {} tokens x {} accum{}; {} ({}) "
             "{} on {} ({} threads{}); run dir {}\n",
             o.entries.size(), o.warmup, o.steps, t.batch, t.seq, t.grad_accum, describe_ranks(local),
             common.model.preset, arch_name(common.model.arch), common.run.dtype, device.str(), threads,
             ranks != nullptr ? " per rank" : "", run ? run->path() : "");
  for (size_t i = 0; i < prepared.size(); ++i) {
    for (const Choice& c : prepared[i].spec.plan.choices) fmt::print(stderr, "{}: {}\n", o.entries[i].label, c.line());
  }

  BenchResult result;
  result.rank = ranks != nullptr ? ranks->rank() : 0;
  result.dir = run ? run->path() : "";
  const auto total_steps = static_cast<int64_t>(o.entries.size()) * (o.warmup + o.steps);
  // The bar only redraws in place on a terminal; logs get the one line per entry instead.
  ProgressBar bar(total_steps, common.run.progress && isatty(fileno(stderr)) != 0);
  int64_t steps_done = 0;
  for (size_t i = 0; i < o.entries.size(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    result.rows.push_back(
        run_entry(o.entries[i], prepared[i], o, train_ds, device, dtype, ranks.get(), run.get(), bar, steps_done));
    const BenchRow& r = result.rows.back();
    if (common.run.progress) {
      bar.message(fmt::format("[{}/{}] {}: median step {:.1f} ms, peak {}, final loss {:.4f} ({:.1f} s)", i + 1,
                              o.entries.size(), r.entry, r.median_step_seconds * 1e3,
                              memory::format_bytes(r.peak_bytes), r.final_loss,
                              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()));
    }
  }
  bar.finish();
  // Every collective is done: the ranks part, and the report is rank 0's.
  if (ranks != nullptr) ranks->finish();

  compare_losses(result, common, device, run.get());
  if (!lead) return result;
  write_results(result, o, common, local, {device, threads, ranks != nullptr}, *run);
  return result;
}

std::string format_bench_table(const BenchResult& result) {
  const BenchRow& ref = result.rows.at(result.reference);
  const bool none = ref.policy == "none";
  const std::string x = none ? "x none" : "x first";
  std::vector<std::array<std::string, 9>> cells;
  cells.push_back({"entry", "peak", "predicted", x, "step ms", "predicted", x, "tokens/s", "ops recomputed"});
  for (const auto& r : result.rows) {
    cells.push_back({r.entry, memory::format_bytes(r.peak_bytes), memory::format_bytes(r.predicted_peak_bytes),
                     fmt::format("{:.2f}", static_cast<double>(r.peak_bytes) / static_cast<double>(ref.peak_bytes)),
                     fmt::format("{:.1f}", r.median_step_seconds * 1e3),
                     r.predicted_step_seconds > 0 ? fmt::format("{:.1f}", r.predicted_step_seconds * 1e3) : "-",
                     fmt::format("{:.2f}", r.median_step_seconds / ref.median_step_seconds),
                     format_count(r.tokens_per_second), std::to_string(r.ops_recomputed)});
  }
  std::array<size_t, 9> width{};
  for (const auto& row : cells) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  if (!none) out += fmt::format("ratios are to the first entry, {} (the sweep has no none)\n", ref.entry);
  for (const auto& row : cells) {
    // The entry left-aligned, the figures right-aligned.
    out += fmt::format("{:<{}}", row[0], width[0]);
    for (size_t c = 1; c < row.size(); ++c) out += fmt::format("  {:>{}}", row[c], width[c]);
    out += "\n";
  }
  // CUDA: the allocator's model beside what the allocator did.
  for (const auto& r : result.rows) {
    if (r.predicted_cuda_reserved_bytes == 0) continue;
    out +=
        fmt::format("{} on CUDA: allocated {} (model {}), reserved {} (model {})\n", r.entry,
                    memory::format_bytes(r.peak_bytes), memory::format_bytes(r.predicted_cuda_allocated_bytes),
                    memory::format_bytes(r.reserved_peak_bytes), memory::format_bytes(r.predicted_cuda_reserved_bytes));
  }
  // Several ranks: the peak above is the highest rank's; each rank's beside its prediction.
  for (const auto& r : result.rows) {
    if (r.rank_peak_bytes.size() > 1) {
      out += fmt::format("{} peaks per rank: {}\n", r.entry,
                         format_rank_peaks(r.rank_peak_bytes, r.predicted_rank_peak_bytes));
    }
  }
  // Each budget entry against the fastest manual policy whose measured peak fits the
  // same budget: on CUDA the reserved peak, which a budget holds there.
  const auto held = [](const BenchRow& r) {
    return r.predicted_cuda_reserved_bytes > 0 ? r.reserved_peak_bytes : r.peak_bytes;
  };
  for (const auto& b : result.rows) {
    if (b.budget_bytes == 0) continue;
    const BenchRow* best = nullptr;
    for (const auto& r : result.rows) {
      if (r.budget_bytes == 0 && held(r) <= b.budget_bytes &&
          (best == nullptr || r.median_step_seconds < best->median_step_seconds)) {
        best = &r;
      }
    }
    out += fmt::format("{} ({}): {} {} the budget; ", b.entry, memory::format_bytes(b.budget_bytes),
                       b.predicted_cuda_reserved_bytes > 0 ? "reserved peak" : "peak",
                       held(b) <= b.budget_bytes ? "within" : "OVER");
    out += best == nullptr ? "no manual policy of the sweep fits it\n"
                           : fmt::format("{:.2f}x the step time of {}, the fastest manual policy that fits\n",
                                         b.median_step_seconds / best->median_step_seconds, best->entry);
  }
  return out;
}

}  // namespace remat
