#include "remat/trainer.h"

#include "remat/caching_allocator.h"
#include "remat/data.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "remat/safetensors.h"
#include "remat/store.h"
#include "remat/tokenizer.h"
#include "remat/trace.h"
#include "config/changed_keys.h"
#include "run/run.h"
#include "train/checkpoints.h"
#include "dist/ranks.h"
#include "train/data_parallel.h"
#include "util/device.h"
#include "train/generate.h"
#include "train/pipeline_step.h"
#include "profile/profile.h"
#include "util/progress.h"
#include "util/stop_signals.h"
#include "train/run_dir.h"
#include "train/step.h"
#include "util/atomic_file.h"
#include "util/utf8.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/version.h>

#include <algorithm>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

namespace remat {
namespace {

constexpr double kPi = 3.14159265358979323846;

// run.record_allocations: the device's allocations from the run's start (before any, so
// that the allocator's model replays them from empty) to the end of its second step.
class AllocationTrace {
 public:
  AllocationTrace(const RunConfig& run, at::Device device) : path_(run.record_allocations) {
    if (path_.empty()) return;
    util::check_new_file(path_, "the allocation trace", "run.record_allocations, --record-allocations");
    header_ = fmt::format("# allocations on {} (LibTorch {}), expandable_segments {}\n", device.str(), TORCH_VERSION,
                          run.expandable_segments ? "on" : "off");
    recorder_.emplace(device.type());
  }
  // Writes the trace after the second step of the run (or its last, of fewer).
  void after_step(int64_t step, int64_t steps, bool lead) {
    if (!recorder_ || (step < 1 && step + 1 < steps)) return;
    std::ostringstream out;
    out << header_;
    memory::write_allocation_trace(out, recorder_->entries());
    recorder_.reset();
    if (lead) util::write_file_atomically(path_, out.str());
  }

 private:
  std::string path_, header_;
  std::optional<memory::AllocationRecorder> recorder_;
};

// Mean loss per token over the first eval_batches sequential batches of train.batch
// sequences (the last may be short). With `ranks`, each data-parallel rank evaluates its
// share of the rows of every batch and the sums are added up; with `pipe`, through the
// pipeline's stages.
double validation_loss(Model& model, const data::TokenDataset& val, const TrainConfig& t, int64_t step,
                       dist::Group* ranks, dist::Group* pipe) {
  const int64_t n = std::min<int64_t>(t.eval_batches, val.num_sequential_batches(t.batch, t.seq));
  const int64_t share = ranks != nullptr ? t.batch / ranks->size() : t.batch;
  const int64_t first = ranks != nullptr ? ranks->rank() * share : 0;
  at::Tensor sums = at::zeros({2}, at::kDouble);  // loss x rows, rows
  double* sr = sums.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    auto b = val.sequential(i, t.batch, t.seq);
    // A short last batch may not reach this rank's rows. It skips the batch, or, where the
    // weights are gathered for every part (ZeRO-3), evaluates a row it does not count, so
    // that it joins the other ranks' gathers.
    const int64_t rows = std::min(share, b.tokens.size(0) - first);
    if (rows <= 0 && !model.values_sharded()) continue;
    const int64_t from = rows > 0 ? first : 0, count = std::max<int64_t>(rows, 1);
    const at::Tensor tokens = b.tokens.narrow(0, from, count), targets = b.targets.narrow(0, from, count);
    const at::Tensor on_device = tokens.to(model.device()), targets_on_device = targets.to(model.device());
    const double loss = pipe != nullptr ? evaluate_pipeline(model, *pipe, on_device, targets_on_device, t.ce_chunk,
                                                            fmt::format("the validation of step {}", step))
                                        : model.evaluate(on_device, targets_on_device, t.ce_chunk);
    if (rows <= 0) continue;
    sr[0] += static_cast<double>(rows) * loss;
    sr[1] += static_cast<double>(rows);
  }
  if (ranks != nullptr) {
    std::vector<at::Tensor> both{sums};
    ranks->all_reduce(both, dist::Reduce::sum, fmt::format("the validation of step {}", step));
  }
  const double loss = sr[0] / sr[1];
  // Training checks every step's weights, so this is the held-out text overflowing the
  // forward; nothing is saved after it.
  if (!std::isfinite(loss)) {
    throw std::runtime_error(fmt::format(
        "The validation loss is {} {} though every weight is finite: the model overflows on held-out text; lower "
        "train.lr (now {}) or raise train.warmup (now {}) and train again.",
        loss, step == 0 ? std::string("before the first step") : fmt::format("after step {}", step), t.lr, t.warmup));
  }
  return loss;
}

void check_split_fits(const data::TokenDataset& ds, const char* split, int64_t seq) {
  if (ds.size() < seq + 1) {
    throw std::invalid_argument(fmt::format(
        "The {} split has {} tokens, fewer than one sequence of train.seq = {} plus its next token; lower train.seq{}, "
        "or train on a longer text.",
        split, ds.size(), seq, std::string(split) == "validation" ? " or raise data.val_fraction" : ""));
  }
}

namespace fs = std::filesystem;

// This process's place in the job (alone: rank 0 of one, no groups).
struct Ranks {
  std::unique_ptr<dist::Comm> comm;
  bool lead = true;
  int dp = 1, world = 1;
  dist::Group* data = nullptr;    // the data-parallel ranks
  dist::Group* tensor = nullptr;  // the tensor-parallel ranks sharing every layer
  dist::Group* pipe = nullptr;    // the pipeline's stages
  int64_t stage = 0;
};

// Several ranks: each data-parallel rank trains on its share of every batch, each group
// of parallel.tp ranks shares every layer; rank 0 alone prints and writes the run directory.
Ranks join(const Config& cfg) {
  Ranks r;
  r.comm = join_ranks(cfg, "train");
  if (r.comm == nullptr) return r;
  r.lead = r.comm->rank() == 0;
  r.dp = r.comm->data().size();
  r.world = r.comm->size();
  r.data = &r.comm->data();
  if (cfg.parallel.tp > 1) r.tensor = &r.comm->tensor();
  if (cfg.parallel.pp > 1) {
    r.pipe = &r.comm->pipeline();
    r.stage = r.pipe->rank();
  }
  return r;
}

// Where a resumed run starts: its newest whole checkpoint, the plan it trained with (older
// checkpoints hold none: planned again), the metrics logged up to it (rank 0's), and the
// directory's lock.
struct Resumed {
  ResumePoint point;
  std::vector<nlohmann::json> logged;
  std::optional<SavedPlan> plan;
  std::unique_ptr<RunLock> lock;
};

Resumed open_resume(const std::string& dir, const Ranks& ranks, const data::CorpusInfo& corpus, const Config& cfg) {
  Resumed r;
  // Rank 0 takes the directory's lock (held to the end) before anything in it is read or
  // removed, clears what a killed write left and sets damaged checkpoints aside, before
  // any other rank lists them; a refusal there ends every rank.
  rank0_first(ranks.comm.get(), "checking the run's checkpoints", [&] {
    if (ranks.lead) {
      r.lock = std::make_unique<RunLock>(dir);
      remove_temp_files(dir);
    }
    r.point = resume_point(dir, ranks.lead, [](const std::string& note) { fmt::print(stderr, "{}\n", note); });
    // Rank 0 writes a missing or damaged tokenizer.model back before the others read it.
    const std::string restored = check_same_data(dir, corpus, r.point.metadata, ranks.lead);
    if (!restored.empty() && ranks.lead) fmt::print(stderr, "{}\n", restored);
  });
  // One that stopped after its last step but before its final files writes those.
  if (r.point.steps >= cfg.train.steps && fs::exists(fs::path(dir) / "summary.json") &&
      fs::exists(fs::path(dir) / "model.safetensors")) {
    throw std::invalid_argument(
        fmt::format("{} finished all {} steps; there is nothing to resume.", dir, cfg.train.steps));
  }
  if (const auto plan = r.point.metadata.find("plan"); plan != r.point.metadata.end()) {
    r.plan = parse_saved_plan(plan->second, cfg.model.n_layer, cfg.parallel.pp);
  }
  // A hand-edited config.toml (the learning rate, the steps, the seed) once resumed silently.
  if (const auto saved = r.point.metadata.find("config"); ranks.lead && saved != r.point.metadata.end()) {
    std::vector<std::string> ignored = resume_settings();
    ignored.insert(ignored.end(), {"run.trace", "run.record_allocations"});
    const auto changes =
        changed_keys(saved->second, util::read_file((fs::path(dir) / "config.toml").string(), "config.toml"), ignored);
    if (!changes.empty()) {
      fmt::print(stderr,
                 "note: {}/config.toml was changed since {} was written ({}); the run goes on with config.toml's "
                 "values, so it is no longer the run it began as.\n",
                 dir, r.point.path.filename().string(),
                 util::printable(fmt::format("{}", fmt::join(changes, ", ")), 1000));
    }
  }
  if (ranks.lead) r.logged = keep_metrics(dir, r.point.steps);
  return r;
}

// Rank 0's run directory: a new one, or the resumed one under its lock.
std::unique_ptr<RunDir> open_run_dir(const Config& cfg, const std::string& resume_dir, std::unique_ptr<RunLock> lock,
                                     const data::CorpusInfo& corpus) {
  auto run = resume_dir.empty() ? std::make_unique<RunDir>(cfg.run.out_dir, cfg.run.name, cfg.model.preset)
                                : std::make_unique<RunDir>(resume_dir, std::move(lock));
  run->write_text("config.toml", config_to_toml(cfg));
  // A resumed run keeps the tokenizer it trained with (check_same_data held it to it).
  if (resume_dir.empty()) {
    run->write_text("tokenizer.model", util::read_file(corpus.tokenizer_path(), "the prepared tokenizer"));
    // What a restart of this job looks for (find_job_run).
    if (const JobStart job = job_start(); job.max_restarts > 0 && !job.run_id.empty()) {
      run->write_text(kJobIdFile, job.run_id + "\n");
    }
  }
  return run;
}

// The loss curves and step times of a run.
struct Curves {
  std::vector<std::pair<int64_t, double>> train, val;
  std::vector<double> step_times;
};

// What a resumed run's kept metrics said, into `sum` and `curves`, as if it ran them now.
void replay_metrics(const std::vector<nlohmann::json>& logged, int64_t tokens_per_step, TrainSummary& sum,
                    Curves& curves) {
  for (const nlohmann::json& j : logged) {
    const int64_t s = j["step"].get<int64_t>();
    if (j["kind"] == "val") {
      curves.val.emplace_back(s, j["val_loss"].get<double>());
      (s == 0 ? sum.initial_val_loss : sum.final_val_loss) = j["val_loss"].get<double>();
    } else if (j["kind"] == "train") {
      curves.train.emplace_back(s, j["loss"].get<double>());
      curves.step_times.push_back(j["step_seconds"].get<double>());
      sum.losses.push_back(j["loss"].get<double>());
      sum.tokens += tokens_per_step;
      sum.peak_bytes = std::max(sum.peak_bytes, j["peak_bytes"].get<int64_t>());
      keep_highest(sum.rank_peak_bytes, j.value("rank_peak_bytes", std::vector<int64_t>{}));
      sum.activation_bytes = j["activation_bytes"].get<int64_t>();
      if (s == 1) {
        sum.recompute_ops_per_step = j["ops_recomputed"].get<int64_t>();
        sum.recomputed_bytes_per_step = j["bytes_recomputed"].get<int64_t>();
      }
    }
  }
}

// The job's parameters (sum.num_params) and model FLOPs per training token: what every rank
// computes per token of its data-parallel share. A tensor-parallel group does each token's
// work once between its ranks (and the whole parts on each); a pipeline's stages each hold
// and run their own layers (the tied embedding's copy on the last stage counted once).
double count_work(Model& model, const Ranks& ranks, const Config& cfg, TrainSummary& sum) {
  const int64_t seq = cfg.train.seq, tp = cfg.parallel.tp;
  sum.num_params = model.num_params();
  double forward_flops = model.forward_flops(seq) * static_cast<double>(tp);
  if (ranks.pipe != nullptr) {
    int64_t own = model.num_params();
    for (const Param& p : model.params()) own -= p.tied && !model.first_stage() ? p.value.numel() : 0;
    forward_flops = 0;
    sum.num_params = 0;
    // Each rank's FLOPs are its share; its parameters are counted whole on every
    // tensor-parallel rank.
    for (const auto& f : ranks.comm->all_gather({std::llround(model.forward_flops(seq)), own},
                                                "gathering the stages' parameter counts and FLOPs")) {
      forward_flops += static_cast<double>(f[0]) / ranks.dp;
      sum.num_params += f[1] / (ranks.dp * tp);
    }
  }
  return 3.0 * forward_flops / static_cast<double>(seq);
}

// The model the run trains: the one the time profile measured if it runs the chosen
// attention op and loss head (not a pipeline's probe), else this stage's, made anew.
void keep_or_create(std::unique_ptr<Model>& model, const RunSpec& spec,
                    const std::function<std::unique_ptr<Model>(const ModelConfig&, const Layout&)>& create) {
  const ModelConfig& m = spec.cfg.model;
  if (model && (model->config().attention != m.attention || model->config().loss_head != m.loss_head)) model.reset();
  if (!model) model = create(m, spec.layout);
}

// The plan's predictions and budget, as the summary reports them beside the measured.
void take_predictions(const RunPlan& planned, TrainSummary& sum) {
  sum.predicted_peak_bytes = planned.measured_peak();
  sum.budget_bytes = planned.budget;
  sum.predicted_reserved_bytes = planned.device_peak().reserved_peak;
  sum.predicted_host_peak_bytes = planned.predicted.host_peak;
  sum.predicted_step_seconds = planned.step_seconds;
}

// The lines before the first step: the model, the data, the steps, then the run as
// `remat plan` prints it (and plan.txt, with every layer spelled out).
void print_header(const RunSpec& spec, const TrainSummary& sum, const std::string& where, const data::Tokenizer& tok,
                  RunDir* run) {
  const Config& cfg = spec.cfg;
  const TrainConfig& t = cfg.train;
  fmt::print(stderr, "remat: {} ({}), {} parameters, {} layers, d_model {}, context {}; {}\n", cfg.model.preset,
             arch_name(cfg.model.arch), format_count(static_cast<double>(sum.num_params)), cfg.model.n_layer,
             cfg.model.d_model, cfg.model.max_seq, where);
  // Padding rows (model.vocab_multiple x parallel.tp, or a larger model.vocab_size) are said
  // here, since the config shows only the padded size.
  const data::CorpusInfo& corpus = *spec.corpus;
  const int64_t padding = cfg.model.vocab_size - tok.vocab_size();
  fmt::print(stderr, "data: {} train / {} validation tokens, vocabulary {}{}, unigram entropy {:.3f} nats/token\n",
             format_count(static_cast<double>(corpus.train_tokens)),
             format_count(static_cast<double>(corpus.val_tokens)), tok.vocab_size(),
             padding > 0
                 ? fmt::format(" (the model's {} rows: {} padding rows no token uses)", cfg.model.vocab_size, padding)
                 : "",
             corpus.train_unigram_entropy);
  fmt::print(stderr, "training: {} steps x {} tokens ({} x {} x {} accum{}); run dir {}\n", t.steps,
             t.batch * t.seq * t.grad_accum, t.batch, t.seq, t.grad_accum, describe_ranks(spec.local), sum.run_dir);
  const std::string plan_text = render_text(spec);
  fmt::print(stderr, "{}", plan_text);
  const RunPlan& planned = spec.plan;
  if (spec.layout.tp > 1) {
    const cost::NodeTimes& links = planned.prices.times;
    fmt::print(stderr,
               "tensor-parallel links measured at {:.2f} GB/s a rank sends and {:.1f} us a ring step; the "
               "recompute re-runs {:.1f} ms of collectives\n",
               links.link_bytes_per_second / 1e9, 1e6 * links.link_latency_seconds,
               1e3 * planned.predicted.recompute_link_seconds);
  }
  if (run != nullptr) run->write_text("plan.txt", plan_text + "\n" + plan_listing(spec));
}

// One step's line of metrics.jsonl; `peaks` every rank's.
nlohmann::json step_metrics(int64_t step, const StepResult& r, const std::vector<int64_t>& peaks,
                            int64_t tokens_per_step, int64_t predicted_activations, int64_t predicted_peak) {
  const StoreCounters& c = r.counters;
  return {{"kind", "train"},
          {"step", step},
          {"loss", r.loss},
          {"lr", r.lr},
          {"grad_norm", r.grad_norm},
          {"step_seconds", r.seconds},
          {"tokens_per_second", tokens_per_step / r.seconds},
          {"memory_bytes", r.current_bytes},
          {"peak_bytes", *std::max_element(peaks.begin(), peaks.end())},
          {"rank_peak_bytes", peaks},
          {"activation_bytes", r.activations.total()},
          {"predicted_activation_bytes", predicted_activations},
          {"predicted_peak_bytes", predicted_peak},
          {"ops_recomputed", c.ops_recomputed},
          {"bytes_recomputed", c.bytes_recomputed},
          {"pool_hits", c.pool.hits},
          {"pool_misses", c.pool.misses},
          {"pool_bytes_served", c.pool.bytes_served},
          {"host_peak_bytes", r.host_peak_bytes},
          {"host_pinned_bytes", r.host_pinned_bytes},
          {"reduce_buckets", r.reduce_buckets},
          {"reduce_buckets_overlapped", r.reduce_buckets_overlapped}};
}

// The first step's word on what it saved and recomputed, beside the prediction.
std::string first_step_line(const StepResult& r, int64_t peak, int64_t predicted_activations) {
  const StoreCounters& c = r.counters;
  const int64_t pooled = c.pool.hits + c.pool.misses;
  return fmt::format("step 1: saved activations {} (predicted {}), peak {}; recompute re-ran {} ops, {} recomputed{}",
                     memory::format_bytes(r.activations.total()), memory::format_bytes(predicted_activations),
                     memory::format_bytes(peak), c.ops_recomputed, memory::format_bytes(c.bytes_recomputed),
                     pooled > 0 ? fmt::format(", {} of {} allocations from the pool", c.pool.hits, pooled) : "");
}

// The trained weights into model.safetensors (the tokenizer's rows only: the shapes
// Hugging Face expects; the training checkpoints keep the padding rows, so that a resume
// continues bitwise) and the sample. Tensor-parallel ranks gather the weights and sample
// together (each token's logits gathered from the vocabulary's shares); a pipeline's stages
// give their weights to rank 0, which samples from the whole model once they are written,
// as it does where every data-parallel rank keeps a share of the weights (ZeRO-3), which
// they gather for it. The ranks part here: what follows is rank 0's.
void export_weights(std::unique_ptr<Model>& model, const RunSpec& spec, at::Device device, const Ranks& ranks,
                    const data::Tokenizer& tok, RunDir* run, TrainSummary& sum, const util::StopSignals& signals) {
  const Config& cfg = spec.cfg;
  // A signal ends the sample after the token under way; the tensor-parallel ranks, which
  // sample together, agree on it first so that they stop at the same token.
  const auto sample = [&](dist::Group* together) {
    ProgressBar bar(cfg.run.sample_tokens, cfg.run.progress && ranks.lead);
    int stop = 0;
    int64_t made = 0;
    sum.sample = sample_text(*model, tok, cfg.run.prompt, cfg.run.sample_tokens, 0.8, 40,
                             static_cast<uint64_t>(cfg.run.seed), {}, &made, [&](int64_t done) {
                               bar.update(done, "sampling");
                               stop = agreed_signal(together, signals.caught());
                               return stop == 0;
                             });
    bar.finish();
    sum.stopped_by = stop;
    if (stop != 0 && ranks.lead) {
      fmt::print(stderr, "{} while sampling: the sample ends after {} of its {} tokens; the weights are written\n",
                 util::stop_name(stop), made, cfg.run.sample_tokens);
    }
  };
  std::vector<std::pair<std::string, at::Tensor>> weights;
  const bool sharded = model->values_sharded();
  const std::map<std::string, std::string> metadata{
      {"format", "pt"}, {"remat.arch", arch_name(cfg.model.arch)}, {"remat.preset", cfg.model.preset}};
  if (ranks.pipe != nullptr) {
    if (ranks.data->rank() == 0 || sharded) {
      // Whole from the tensor-parallel parts (every rank of the group) and the
      // data-parallel shares, then from the stages.
      auto stage_weights = model->whole_params(tok.vocab_size());
      if (ranks.data->rank() == 0 && (ranks.tensor == nullptr || ranks.tensor->rank() == 0)) {
        write_on_first_stage(*ranks.pipe, std::move(stage_weights), ranks.lead ? run->file("model.safetensors") : "",
                             metadata, "gathering the stages' weights for model.safetensors");
      }
    }
  } else if (sharded) {
    weights = model->whole_params(tok.vocab_size());
  } else if (ranks.lead || ranks.tensor != nullptr) {
    weights = model->whole_params(tok.vocab_size());
    if (cfg.run.sample_tokens > 0) sample(ranks.tensor);
  }
  if (ranks.comm != nullptr) ranks.comm->finish();
  if (!ranks.lead) return;
  if (ranks.pipe == nullptr) model::save_safetensors(run->file("model.safetensors"), weights, metadata);
  if ((ranks.pipe != nullptr || sharded) && cfg.run.sample_tokens > 0) {
    model.reset();  // the stage's memory goes before the whole model comes
    model = Model::create(cfg.model, device, spec.dtype, static_cast<uint64_t>(cfg.run.seed));
    model->load(run->file("model.safetensors"));
    sample(nullptr);
  }
  if (cfg.run.sample_tokens > 0) run->write_text("sample.txt", sum.sample + "\n");
}

// The median step time past the first steps, which pay for allocation and caches.
double steady_median(const std::vector<double>& times) {
  return median({times.begin() + (times.empty() ? 0 : std::min<size_t>(times.size() - 1, 2)), times.end()});
}

// What a run stopped by `signal` after `step` says: where its checkpoint is and how to go on.
std::string stopped_line(int signal, int64_t step, const std::string& run_dir, int world) {
  return fmt::format("{} after step {}: the checkpoint is in {}; continue with `remat {}train --resume {}`\n",
                     util::stop_name(signal), step, checkpoint_dir(run_dir).string(),
                     world > 1 ? fmt::format("launch --nproc {} ", world) : "", run_dir);
}

// The machine a run trained on, as summary.json and the report name it.
struct Machine {
  at::Device device;
  int threads = 0;
  double matmul_rate = 0;  // this rank's measured matmul FLOP/s
};

// summary.json and the lines after the last step: loss, speed against the machine's
// matmul rate, and the measured peak against the prediction and the budget.
void report(const RunSpec& spec, const Ranks& ranks, const Machine& machine, const TrainSummary& sum,
            int64_t predicted_activations, const std::vector<int64_t>& rank_predicted, RunDir& run,
            const Curves& curves, int64_t traced_step) {
  const Config& cfg = spec.cfg;
  const RunPlan& planned = spec.plan;
  std::string why;
  const bool plotted = run.plot_loss(curves.train, curves.val, sum.unigram_entropy, &why);
  const nlohmann::json summary = {
      {"steps", sum.steps},
      {"tokens", sum.tokens},
      {"parameters", sum.num_params},
      {"initial_val_loss", sum.initial_val_loss},
      {"final_val_loss", sum.final_val_loss},
      {"final_train_loss", sum.losses.empty() ? nlohmann::json() : nlohmann::json(sum.losses.back())},
      {"unigram_entropy", sum.unigram_entropy},
      {"median_step_seconds", sum.median_step_seconds},
      {"tokens_per_second", sum.tokens_per_second},
      {"model_flops_per_second", sum.model_flops_per_second},
      {"matmul_flops_per_second", sum.matmul_flops_per_second},
      {"efficiency", sum.model_flops_per_second / sum.matmul_flops_per_second},
      {"peak_bytes", sum.peak_bytes},
      {"ranks", ranks.dp},
      {"tp", cfg.parallel.tp},
      {"pp", cfg.parallel.pp},
      {"stage_layers", planned.split},
      {"predicted_rank_peak_bytes", rank_predicted},
      {"sp", cfg.parallel.sp},
      {"rank_peak_bytes", sum.rank_peak_bytes},
      {"activation_bytes", sum.activation_bytes},
      {"threads", machine.threads},
      {"blas", blas_name()},
      {"device", machine.device.str()},
      {"dtype", cfg.run.dtype},
      {"recompute", planned.plan.policy},
      {"predicted_activation_bytes", predicted_activations},
      {"recompute_ops_per_step", sum.recompute_ops_per_step},
      {"recomputed_bytes_per_step", sum.recomputed_bytes_per_step},
      {"predicted_peak_bytes", sum.predicted_peak_bytes},
      {"predicted_recompute_flops_per_step", planned.predicted.recompute_flops},
      {"budget_bytes", sum.budget_bytes},
      {"reserved_peak_bytes", sum.reserved_peak_bytes},
      {"predicted_reserved_bytes", sum.predicted_reserved_bytes},
      {"host_peak_bytes", sum.host_peak_bytes},
      {"host_pinned_bytes", sum.host_pinned_bytes},
      {"predicted_host_peak_bytes", sum.predicted_host_peak_bytes},
      {"predicted_step_seconds", sum.predicted_step_seconds},
      {"other_cpus", sum.other_cpus ? nlohmann::json(*sum.other_cpus) : nlohmann::json(nullptr)},
      {"predicted_none_peak_bytes", planned.none_peak},
      {"predicted_none_step_seconds", planned.none_step_seconds},
  };
  run.write_text("summary.json", summary.dump(2) + "\n");

  fmt::print(stderr, "\n");
  if (cfg.run.sample_tokens > 0) fmt::print(stderr, "sample: {}\n\n", sum.sample);
  fmt::print(stderr, "validation loss {:.4f} -> {:.4f} nats/token (unigram entropy of the corpus {:.4f})\n",
             sum.initial_val_loss, sum.final_val_loss, sum.unigram_entropy);
  fmt::print(stderr, "step time {:.1f} ms (median, recompute {}), {} tokens/s\n", sum.median_step_seconds * 1e3,
             planned.plan.policy, format_count(sum.tokens_per_second));
  if (sum.predicted_step_seconds > 0) {
    fmt::print(stderr, "predicted step time {:.1f} ms: measured {:+.1f}%\n", sum.predicted_step_seconds * 1e3,
               100.0 * (sum.median_step_seconds - sum.predicted_step_seconds) / sum.predicted_step_seconds);
    const std::string why =
        util::load_explanation(sum.predicted_step_seconds, sum.median_step_seconds, sum.other_cpus,
                               spec.plan.prices.other_cpus, sum.tolerated_other_cpus, util::machine_cpus());
    if (!why.empty()) fmt::print(stderr, "  {}\n", why);
  }
  fmt::print(stderr, "compute {} FLOP/s of a measured {} FLOP/s {} matmul peak{}: efficiency {:.0f}%\n",
             format_count(sum.model_flops_per_second), format_count(sum.matmul_flops_per_second), cfg.run.dtype,
             ranks.world > 1 ? fmt::format(" ({} ranks x {})", ranks.world, format_count(machine.matmul_rate)) : "",
             100.0 * sum.model_flops_per_second / sum.matmul_flops_per_second);
  fmt::print(stderr,
             "memory peak {} per step (predicted {}, {:+.1f}%), of which saved activations {} per "
             "microbatch (predicted {})\n",
             memory::format_bytes(sum.peak_bytes), memory::format_bytes(sum.predicted_peak_bytes),
             100.0 * static_cast<double>(sum.peak_bytes - sum.predicted_peak_bytes) /
                 static_cast<double>(sum.predicted_peak_bytes),
             memory::format_bytes(sum.activation_bytes), memory::format_bytes(predicted_activations));
  if (ranks.world > 1) {
    fmt::print(stderr, "memory peak per rank: {}\n", format_rank_peaks(sum.rank_peak_bytes, rank_predicted));
  }
  if (sum.predicted_host_peak_bytes > 0) {
    fmt::print(
        stderr, "host memory of the offloaded slots: peak {} (predicted {}){}\n",
        memory::format_bytes(sum.host_peak_bytes), memory::format_bytes(sum.predicted_host_peak_bytes),
        cfg.run.device.is_cuda() ? fmt::format(", page-locked {}", memory::format_bytes(sum.host_pinned_bytes)) : "");
  }
  if (sum.predicted_reserved_bytes > 0) {
    fmt::print(stderr, "CUDA caching allocator: reserved peak {} (its model predicted {})\n",
               memory::format_bytes(sum.reserved_peak_bytes), memory::format_bytes(sum.predicted_reserved_bytes));
  }
  if (sum.budget_bytes > 0) {
    // On CUDA the budget holds the reserved bytes.
    const int64_t held = sum.predicted_reserved_bytes > 0 ? sum.reserved_peak_bytes : sum.peak_bytes;
    fmt::print(stderr, "budget {}: measured {} {} it; without recompute the step would peak at {} (predicted){}\n",
               memory::format_bytes(sum.budget_bytes), sum.predicted_reserved_bytes > 0 ? "reserved peak" : "peak",
               held <= sum.budget_bytes ? "stayed within" : "EXCEEDED", memory::format_bytes(planned.none_peak),
               planned.none_step_seconds > 0
                   ? fmt::format(" and take {:.1f} ms (predicted; this plan: {:.1f} ms measured, {:.1f} ms predicted)",
                                 1e3 * planned.none_step_seconds, 1e3 * sum.median_step_seconds,
                                 1e3 * sum.predicted_step_seconds)
                   : "");
  }
  fmt::print(stderr,
             "run directory {}: config.toml, prices.json, plan.txt, metrics.jsonl, model.safetensors, config.json, "
             "tokenizer.model{}{}, summary.json\n",
             run.path(), plotted ? ", loss.png" : "", cfg.run.sample_tokens > 0 ? ", sample.txt" : "");
  if (!plotted) fmt::print(stderr, "no loss plot: {}\n", why);
  if (traced_step >= 0) {
    fmt::print(stderr, "trace of step {}: {} (open it in https://ui.perfetto.dev)\n", traced_step + 1, cfg.run.trace);
  }
}

}  // namespace

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step < t.warmup) return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, t.steps - 1 - t.warmup));
  const double progress = std::min(1.0, static_cast<double>(step - t.warmup) / span);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(kPi * progress));
}

namespace {

// A name for the files `pattern` names: a file's stem, or a glob's with its wildcards
// spelled out (…/shard_*.bin: shard_all), after its folder's name where the stem is only
// wildcards (…/fineweb/*.bin: fineweb-all).
std::string source_name(const std::string& pattern) {
  namespace fs = std::filesystem;
  std::string name;
  bool literal = false;
  for (const char ch : fs::path(pattern).stem().string()) {
    const bool wild = ch == '*' || ch == '?' || ch == '[' || ch == ']';
    literal = literal || !wild;
    name += ch == '*' ? "all" : ch == '?' ? "x" : wild ? "" : std::string(1, ch);
  }
  const std::string folder = fs::path(pattern).lexically_normal().parent_path().filename().string();
  return literal || folder.empty() ? name : folder + "-" + name;
}

}  // namespace

std::string corpus_dir(const DataConfig& d) {
  namespace fs = std::filesystem;
  std::string source = d.text.empty() ? "kjv" : source_name(d.text);
  if (d.format == DataFormat::jsonl) source += d.field == "text" ? "-jsonl" : "-" + d.field;
  if (d.format == DataFormat::tokens) source += "-tokens";
  if (d.tokenizer.empty()) return fmt::format("{}/{}-v{}", d.dir, source, d.vocab_size);
  // A model's tokenizer is named by its folder (…/gpt2/tokenizer.json: gpt2).
  fs::path tokenizer = fs::path(d.tokenizer).lexically_normal();
  if (!tokenizer.has_filename()) tokenizer = tokenizer.parent_path();
  const bool generic = tokenizer.stem() == "tokenizer" && tokenizer.has_parent_path();
  return fmt::format("{}/{}-{}", d.dir, source,
                     (generic ? tokenizer.parent_path().filename() : tokenizer.stem()).string());
}

namespace {

// The weights model.init names: a file (.safetensors, or a shards' .index.json), or the
// model.safetensors or model.safetensors.index.json in its folder; checked before any work,
// so that a wrong path costs nothing.
std::string init_weights(const std::string& init) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir(init);
  if (!fs::is_directory(dir, ec)) {
    if (fs::is_regular_file(dir, ec)) return init;
    throw std::invalid_argument(
        fmt::format("model.init = '{}' names no weights: it is {}; give a .safetensors file "
                    "or a Hugging Face model's folder.",
                    init, fs::exists(dir, ec) ? "not a regular file" : "missing"));
  }
  for (const char* name : {"model.safetensors", "model.safetensors.index.json"}) {
    if (fs::is_regular_file(dir / name, ec)) return (dir / name).string();
  }
  throw std::invalid_argument(
      fmt::format("model.init = '{}' names no weights: the folder holds neither model.safetensors nor "
                  "model.safetensors.index.json (a model saved in shards); give a Hugging Face model's folder, or a "
                  ".safetensors file.",
                  init));
}

}  // namespace

data::CorpusInfo prepare_data(const DataConfig& d) {
  const util::Phase phase("preparing the corpus");
  data::PrepareOptions prep;
  if (!d.text.empty()) prep.text_file = d.text;
  prep.format = d.format;
  prep.field = d.field;
  // Fail before minutes of tokenizer training if the cache cannot exist.
  std::error_code ec;
  std::filesystem::create_directories(d.dir, ec);
  if (ec || ::access(d.dir.c_str(), W_OK) != 0) {
    throw std::invalid_argument(
        fmt::format("Cannot {} the data directory {} (data.dir): {}; set data.dir to a "
                    "writable directory.",
                    ec ? "create" : "write into", d.dir, ec ? ec.message() : std::strerror(errno)));
  }
  prep.out_dir = corpus_dir(d);
  prep.vocab_size = static_cast<int>(d.vocab_size);
  if (!d.tokenizer.empty()) prep.tokenizer = d.tokenizer;
  prep.val_fraction = d.val_fraction;
  return data::prepare_corpus(prep, [](const std::string& line) { fmt::print(stderr, "{}\n", line); });
}

TrainSummary train(const Config& cfg_in, const std::string& resume_dir) {
  const util::Phase phase("setting up the run");
  Config cfg = cfg_in;
  const auto& t = cfg.train;
  const Ranks ranks = join(cfg);
  const QuietStderr quiet(!ranks.lead);
  const int threads = set_threads(rank_threads(cfg));
  const at::Device device =
      available_device(rank_device(cfg, ranks.comm.get()), resume_dir.empty() ? DeviceAsk::config : DeviceAsk::resumed);
  if (device.is_cuda()) memory::configure_cuda_allocator(cfg.run.expandable_segments);
  const at::ScalarType dtype = device_dtype(dtype_of(cfg.run.dtype), device);
  memory::install_cpu_tracking();
  // A bad trace path should cost nothing, not the minutes before the traced step.
  if (!cfg.run.trace.empty()) trace::check_writable(cfg.run.trace);
  AllocationTrace allocations(cfg.run, device);

  const std::string init = cfg.model.init.empty() || !resume_dir.empty() ? "" : init_weights(cfg.model.init);
  // Data: prepared once per (text, vocabulary) and cached.
  data::CorpusInfo corpus;
  rank0_first(ranks.comm.get(), "preparing the corpus", [&] { corpus = prepare_data(cfg.data); });
  const data::Tokenizer tok = data::Tokenizer::load(corpus.tokenizer_path());
  cfg = resolve_config(cfg, corpus);
  data::TokenDataset train_ds = data::TokenDataset::open(corpus, data::Split::train);
  data::TokenDataset val_ds = data::TokenDataset::open(corpus, data::Split::val);
  check_split_fits(train_ds, "training", t.seq);
  check_split_fits(val_ds, "validation", t.seq);
  Resumed resumed = resume_dir.empty() ? Resumed{} : open_resume(resume_dir, ranks, corpus, cfg);
  const int64_t first_step = resumed.point.steps;

  // The run resolved: the time profile is measured on the whole model (a pipeline plans
  // before its stage exists, from a probe's), once per attention op and loss head.
  const auto create = [&](const ModelConfig& m, const Layout& layout) {
    return Model::create(m, device, dtype, static_cast<uint64_t>(cfg.run.seed), layout, ranks.tensor);
  };
  const Machine machine{
      device, threads,
      measure_matmul_flops(device, dtype, rank_share(cfg).train.batch * t.seq, cfg.model.d_model, cfg.model.d_ff)};
  std::unique_ptr<Model> model;
  RunInputs in{dtype, ranks.stage, corpus, corpus_dir(cfg.data), {}};
  in.saved = resumed.plan ? &*resumed.plan : nullptr;
  in.memory_available = rank_memory(device, ranks.comm.get());
  in.host_available = rank_memory(at::kCPU, ranks.comm.get());
  // The host copies are measured at every start that may offload.
  PriceSource prices(
      [&](const Config& op) {
        return run_prices(
            op, device, dtype, train_ds, ranks.comm.get(), machine.matmul_rate,
            [&] { return create(op.model, layout_of(op, 0)); }, model);
      },
      [&](const Config&, Prices& p) { add_host_copy(p, device, dtype, ranks.comm.get()); });
  in.prices = &prices;
  const RunSpec spec = resolve_run(cfg, in);
  cfg = spec.cfg;  // the autos resolved
  const RunPlan& planned = spec.plan;
  keep_or_create(model, spec, create);
  if (!init.empty()) model->load(init);
  apply_plan(*model, planned.plan, cfg.ac);
  const int64_t predicted = model->predict_activation_bytes(spec.local.train.batch, t.seq).total();
  TrainStep stepper(*model, spec.local.train, static_cast<uint64_t>(cfg.run.seed), ranks.comm.get(), cfg.parallel.zero,
                    cfg.parallel.schedule, cfg.parallel.overlap_grad_reduce);
  const std::vector<int64_t> rank_predicted = planned.rank_peaks(ranks.world, cfg.parallel.tp);
  std::unique_ptr<RunDir> run;
  if (ranks.lead) {
    run = open_run_dir(cfg, resume_dir, std::move(resumed.lock), corpus);
    run->write_text("prices.json", prices.record());
    // With the weights, what transformers loads the run directory from.
    run->write_text("config.json", hf_config_json(cfg.model, tok.vocab_size(), tok.bos_id(), tok.eos_id()));
    for (const auto& [name, text] : tok.hf_files()) run->write_text(name, text);
  }

  TrainSummary sum;
  sum.run_dir = run ? run->path() : resume_dir;
  sum.unigram_entropy = corpus.train_unigram_entropy;
  sum.predicted_activation_bytes = predicted;
  const double flops_per_token = count_work(*model, ranks, cfg, sum);
  // The job's rate: each rank measured its own, at its threads, beside the others.
  sum.matmul_flops_per_second = machine.matmul_rate * ranks.world;
  take_predictions(planned, sum);
  print_header(spec, sum,
               fmt::format("{} on {} ({} threads{})", cfg.run.dtype, device.str(), threads,
                           ranks.comm ? fmt::format(", ranks over {}", dist::backend_name(ranks.comm->backend())) : ""),
               tok, run.get());
  const auto log_metrics = [&](const nlohmann::json& record) {
    if (run) run->log_metrics(record);
  };
  const int64_t tokens_per_step = t.batch * t.seq * t.grad_accum;
  std::mt19937_64 rng(static_cast<uint64_t>(cfg.run.seed));
  Curves curves;
  if (first_step == 0) {
    sum.initial_val_loss = validation_loss(*model, val_ds, t, 0, ranks.data, ranks.pipe);
    curves.val.emplace_back(0, sum.initial_val_loss);
    log_metrics({{"kind", "val"}, {"step", 0}, {"val_loss", sum.initial_val_loss}});
  } else {
    stepper.load_checkpoint(resumed.point.path.string(), rng);
    replay_metrics(resumed.logged, tokens_per_step, sum, curves);
    fmt::print(stderr, "{} {} after step {} from {}\n",
               first_step < t.steps ? "resuming" : "writing the final files of", sum.run_dir, first_step,
               resumed.point.path.string());
  }

  ProgressBar bar(t.steps, cfg.run.progress);
  if (first_step == 0) bar.message(fmt::format("step 0: validation loss {:.4f}", sum.initial_val_loss));
  // The traced step is the third (or the last of fewer): the first two pay for allocation and caches.
  const int64_t traced_step = cfg.run.trace.empty() ? -1 : std::min<int64_t>(2, t.steps - 1);
  std::map<std::string, std::string> checkpoint_metadata = data_digests(corpus);
  checkpoint_metadata.emplace("plan", saved_plan_json(planned.plan, planned.split));
  checkpoint_metadata.emplace("config", config_to_toml(cfg));
  const util::StopSignals signals;
  const util::CpuTimes started = cpu_times();  // how busy other processes keep the machine meanwhile
  for (int64_t step = first_step; step < t.steps; ++step) {
    const StepResult r = stepper.run(step, train_ds, rng, step == traced_step);
    if (step == traced_step && ranks.lead) util::write_file_atomically(cfg.run.trace, r.trace);
    allocations.after_step(step, t.steps, ranks.lead);
    // Every rank's peak, and whether a signal reached any rank: they all stop after the
    // same step.
    const RankStep gathered = gather_step(ranks.comm.get(), r.peak_bytes, signals.caught(), step + 1);
    const int64_t peak = *std::max_element(gathered.peaks.begin(), gathered.peaks.end());
    curves.step_times.push_back(r.seconds);
    curves.train.emplace_back(step + 1, r.loss);
    sum.losses.push_back(r.loss);
    sum.tokens += tokens_per_step;
    sum.peak_bytes = std::max(sum.peak_bytes, peak);
    sum.reserved_peak_bytes = std::max(sum.reserved_peak_bytes, r.reserved_peak_bytes);
    sum.host_peak_bytes = r.host_peak_bytes;
    sum.host_pinned_bytes = r.host_pinned_bytes;
    keep_highest(sum.rank_peak_bytes, gathered.peaks);
    sum.activation_bytes = r.activations.total();
    if (step == 0) {
      bar.message(first_step_line(r, peak, predicted));
      sum.recompute_ops_per_step = r.counters.ops_recomputed;
      sum.recomputed_bytes_per_step = r.counters.bytes_recomputed;
    }
    log_metrics(step_metrics(step + 1, r, gathered.peaks, tokens_per_step, predicted, sum.predicted_peak_bytes));
    bar.update(step + 1, fmt::format("loss {:.4f} | {} tok/s | mem {} (peak {})", r.loss,
                                     format_count(tokens_per_step / r.seconds), memory::format_bytes(r.current_bytes),
                                     memory::format_bytes(peak)));
    const bool last = step + 1 == t.steps;
    if (last || (t.eval_every > 0 && (step + 1) % t.eval_every == 0)) {
      const double v = validation_loss(*model, val_ds, t, step + 1, ranks.data, ranks.pipe);
      curves.val.emplace_back(step + 1, v);
      log_metrics({{"kind", "val"}, {"step", step + 1}, {"val_loss", v}});
      bar.message(fmt::format("step {}: validation loss {:.4f}", step + 1, v));
      sum.final_val_loss = v;
    }
    // Every data-parallel rank holds the same parameters: rank 0's copy is the checkpoint,
    // its tensor-parallel peers' parts and, under ZeRO-1, the other ranks' moments
    // gathered into it.
    const int stop = gathered.stop;
    if ((ranks.lead || stepper.gives_to_checkpoint()) && ((step + 1) % t.checkpoint_every == 0 || last || stop != 0)) {
      write_checkpoint(stepper, sum.run_dir, step + 1, rng, t.keep_checkpoints, ranks.lead, checkpoint_metadata);
    }
    if (stop != 0 && !last) {
      bar.finish();
      fmt::print(stderr, "{}", stopped_line(stop, step + 1, sum.run_dir, ranks.world));
      sum.stopped_by = stop;
      if (ranks.comm != nullptr) ranks.comm->finish();
      return sum;
    }
  }
  bar.finish();
  const MachineLoad load = machine_load(ranks.comm.get(), started, cpu_times());
  sum.other_cpus = load.other_cpus;
  sum.tolerated_other_cpus = load.tolerated;

  sum.steps = t.steps;
  sum.median_step_seconds = steady_median(curves.step_times);
  sum.tokens_per_second = tokens_per_step / sum.median_step_seconds;
  sum.model_flops_per_second = flops_per_token * sum.tokens_per_second;
  export_weights(model, spec, device, ranks, tok, run.get(), sum, signals);
  if (ranks.lead) report(spec, ranks, machine, sum, predicted, rank_predicted, *run, curves, traced_step);
  return sum;
}

}  // namespace remat
