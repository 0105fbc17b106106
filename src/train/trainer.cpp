#include "remat/trainer.h"

#include "remat/data.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "remat/safetensors.h"
#include "remat/store.h"
#include "remat/tokenizer.h"
#include "remat/trace.h"
#include "run/run.h"
#include "train/checkpoints.h"
#include "train/data_parallel.h"
#include "train/device.h"
#include "train/generate.h"
#include "train/pipeline_step.h"
#include "train/profile.h"
#include "train/progress.h"
#include "train/run_dir.h"
#include "train/step.h"
#include "util/atomic_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>

namespace remat {
namespace {

constexpr double kPi = 3.14159265358979323846;

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
    const int64_t rows = std::min(share, b.tokens.size(0) - first);
    if (rows <= 0) continue;  // a short last batch may not reach this rank's rows
    const at::Tensor tokens = b.tokens.narrow(0, first, rows), targets = b.targets.narrow(0, first, rows);
    const at::Tensor on_device = tokens.to(model.device()), targets_on_device = targets.to(model.device());
    sr[0] += static_cast<double>(rows) *
             (pipe != nullptr ? evaluate_pipeline(model, *pipe, on_device, targets_on_device, t.ce_chunk,
                                                  fmt::format("the validation of step {}", step))
                              : model.evaluate(on_device, targets_on_device, t.ce_chunk));
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
        "or train on a longer text.", split, ds.size(), seq, std::string(split) == "validation" ?
        " or raise data.val_fraction" : ""));
  }
}

namespace fs = std::filesystem;

volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int signal) { g_stop_signal = signal; }

// SIGINT and SIGTERM, for the training loop only: they ask it to stop after the step in
// progress and its checkpoint. The previous handlers come back afterwards.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int caught() const { return g_stop_signal; }

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

}  // namespace

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step < t.warmup) return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, t.steps - 1 - t.warmup));
  const double progress = std::min(1.0, static_cast<double>(step - t.warmup) / span);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(kPi * progress));
}

std::string corpus_dir(const DataConfig& d) {
  const std::string source = d.text.empty() ? "kjv" : std::filesystem::path(d.text).stem().string();
  return fmt::format("{}/{}-v{}", d.dir, source, d.vocab_size);
}

data::CorpusInfo prepare_data(const DataConfig& d) {
  data::PrepareOptions prep;
  if (!d.text.empty()) prep.text_file = d.text;
  // Fail before minutes of tokenizer training if the cache cannot exist.
  std::error_code ec;
  std::filesystem::create_directories(d.dir, ec);
  if (ec || ::access(d.dir.c_str(), W_OK) != 0) {
    throw std::invalid_argument(fmt::format("Cannot {} the data directory {} (data.dir): {}; set data.dir to a "
                                            "writable directory.", ec ? "create" : "write into", d.dir,
                                            ec ? ec.message() : std::strerror(errno)));
  }
  prep.out_dir = corpus_dir(d);
  prep.vocab_size = static_cast<int>(d.vocab_size);
  prep.val_fraction = d.val_fraction;
  return data::prepare_corpus(prep, [](const std::string& line) { fmt::print(stderr, "{}\n", line); });
}

TrainSummary train(const Config& cfg_in, const std::string& resume_dir) {
  Config cfg = cfg_in;
  const auto& t = cfg.train;
  // Several ranks: each data-parallel rank trains on its share of every batch, each group
  // of parallel.tp ranks shares every layer; rank 0 alone prints and writes the run
  // directory.
  const std::unique_ptr<dist::Comm> ranks = join_ranks(cfg, "train");
  const bool lead = ranks == nullptr || ranks->rank() == 0;
  const int dp = ranks != nullptr ? ranks->data().size() : 1;
  const int64_t tp = cfg.parallel.tp, pp = cfg.parallel.pp;
  const int world = ranks != nullptr ? ranks->size() : 1;
  dist::Group* data_ranks = ranks != nullptr ? &ranks->data() : nullptr;
  dist::Group* tensor_ranks = tp > 1 ? &ranks->tensor() : nullptr;
  // Pipeline parallel: this rank's stage, and the ranks of its pipeline.
  dist::Group* pipe = pp > 1 ? &ranks->pipeline() : nullptr;
  const int64_t stage = pipe != nullptr ? pipe->rank() : 0;
  const QuietStderr quiet(!lead);
  const int threads = set_threads(rank_threads(cfg));
  const at::Device device = parse_device(cfg.run.device);
  const at::ScalarType dtype = parse_dtype(cfg.run.dtype, device);
  memory::install_cpu_tracking();
  // A bad trace path should cost nothing, not the minutes before the traced step.
  if (!cfg.run.trace.empty()) trace::check_writable(cfg.run.trace);

  // Data: prepared once per (text, vocabulary) and cached.
  data::CorpusInfo corpus;
  rank0_first(ranks.get(), "preparing the corpus", [&] { corpus = prepare_data(cfg.data); });
  const data::Tokenizer tok = data::Tokenizer::load(corpus.tokenizer_path());
  cfg = resolve_config(cfg, corpus);
  data::TokenDataset train_ds = data::TokenDataset::open(corpus, data::Split::train);
  data::TokenDataset val_ds = data::TokenDataset::open(corpus, data::Split::val);
  check_split_fits(train_ds, "training", t.seq);
  check_split_fits(val_ds, "validation", t.seq);

  // A resumed run continues from its newest whole checkpoint, with the plan it trained with
  // (older checkpoints hold none: planned again), and the metrics logged up to it. One that
  // stopped after its last step but before its final files writes those.
  ResumePoint resumed;
  int64_t first_step = 0;
  std::vector<nlohmann::json> logged;
  std::optional<SavedPlan> saved_plan;
  std::unique_ptr<RunLock> run_lock;
  if (!resume_dir.empty()) {
    // Rank 0 takes the directory's lock (held to the end) before anything in it is read or
    // removed, clears what a killed write left and sets damaged checkpoints aside, before
    // any other rank lists them; a refusal there ends every rank.
    rank0_first(ranks.get(), "checking the run's checkpoints", [&] {
      if (lead) {
        run_lock = std::make_unique<RunLock>(resume_dir);
        remove_temp_files(resume_dir);
      }
      resumed = resume_point(resume_dir, lead, [](const std::string& note) { fmt::print(stderr, "{}\n", note); });
    });
    first_step = resumed.steps;
    const std::map<std::string, std::string>& meta = resumed.metadata;
    if (first_step >= t.steps && fs::exists(fs::path(resume_dir) / "summary.json") &&
        fs::exists(fs::path(resume_dir) / "model.safetensors")) {
      throw std::invalid_argument(fmt::format("{} finished all {} steps; there is nothing to resume.", resume_dir,
                                              t.steps));
    }
    check_same_data(resume_dir, corpus, meta);
    if (const auto plan = meta.find("plan"); plan != meta.end()) {
      saved_plan = parse_saved_plan(plan->second, cfg.model.n_layer, pp);
    }
    if (lead) logged = keep_metrics(resume_dir, first_step);
  }

  const auto create = [&](const ModelConfig& m, StageSpan span) {
    return Model::create(m, device, dtype, static_cast<uint64_t>(cfg.run.seed), tensor_ranks, cfg.parallel.sp, span);
  };
  const double matmul_rate =
      measure_matmul_flops(device, dtype, rank_share(cfg).train.batch * t.seq, cfg.model.d_model, cfg.model.d_ff);
  // The time profile is measured on the whole model; a pipeline plans before its stage
  // exists (the planner chooses its layers), from a probe's. Under model.attention = auto,
  // once per op.
  std::unique_ptr<Model> model;
  RunInputs in;
  in.dtype = dtype;
  in.stage = stage;
  in.corpus = corpus;
  in.corpus_dir = corpus_dir(cfg.data);
  in.saved = saved_plan ? &*saved_plan : nullptr;
  in.profile_of = [&](const Config& op) {
    return run_time_profile(op, device, dtype, train_ds, ranks.get(), matmul_rate,
                            [&] { return create(op.model, {}); }, model);
  };
  const RunSpec spec = resolve_run(cfg, in);
  cfg = spec.cfg;  // the autos resolved
  const Config& local = spec.local;
  const RunPlan& planned = spec.plan;
  // Profiled another op or head last.
  if (model && (model->config().attention != cfg.model.attention || model->config().loss_head != cfg.model.loss_head)) {
    model.reset();
  }
  const std::string plan_json = saved_plan_json(planned);
  if (!model) {
    int64_t first = 0;
    for (int64_t s = 0; s < stage; ++s) first += planned.split[static_cast<size_t>(s)];
    model = create(cfg.model, {first, planned.split[static_cast<size_t>(stage)]});
  }
  const ActivationPlan& plan = planned.plan;
  apply_plan(*model, plan, cfg.ac);
  const ActivationBytes predicted = model->predict_activation_bytes(local.train.batch, t.seq);
  TrainStep stepper(*model, local.train, static_cast<uint64_t>(cfg.run.seed), ranks.get(), cfg.parallel.zero,
                    cfg.parallel.schedule, cfg.parallel.overlap_grad_reduce);
  // Each rank's predicted peak: its stage's (rank = stage x dp x tp + ...).
  const std::vector<int64_t> rank_predicted = rank_predictions(planned.stage_peaks, world, dp * tp);

  // Rank 0 alone writes the run directory.
  std::unique_ptr<RunDir> run;
  if (lead) {
    run = resume_dir.empty() ? std::make_unique<RunDir>(cfg.run.out_dir, cfg.run.name, cfg.model.preset)
                             : std::make_unique<RunDir>(resume_dir, std::move(run_lock));
    run->write_text("config.toml", config_to_toml(cfg));
    // A resumed run keeps the tokenizer it trained with (check_same_data held it to it).
    if (resume_dir.empty()) {
      run->write_text("tokenizer.model", util::read_file(corpus.tokenizer_path(), "the prepared tokenizer"));
    }
  }

  TrainSummary sum;
  const std::string run_path = run ? run->path() : resume_dir;
  sum.run_dir = run_path;
  const auto log_metrics = [&](const nlohmann::json& record) {
    if (run) run->log_metrics(record);
  };
  sum.unigram_entropy = corpus.train_unigram_entropy;
  sum.num_params = model->num_params();
  sum.predicted_activation_bytes = predicted.total();
  const int64_t tokens_per_step = t.batch * t.seq * t.grad_accum;
  // What every rank computes per token of its data-parallel share: a tensor-parallel group
  // does each token's work once between its ranks (and the whole parts on each).
  // A pipeline's stages each hold and run their own layers: parameters (the tied
  // embedding's copy on the last stage counted once) and FLOPs summed over the stages.
  double forward_flops = model->forward_flops(t.seq) * static_cast<double>(tp);
  if (pipe != nullptr) {
    int64_t own = model->num_params();
    for (const Param& p : model->params()) own -= p.tied && !model->first_stage() ? p.value.numel() : 0;
    forward_flops = 0;
    sum.num_params = 0;
    // Each rank's FLOPs are its share; its parameters are counted whole on every
    // tensor-parallel rank.
    for (const auto& f : ranks->all_gather({std::llround(model->forward_flops(t.seq)), own},
                                           "gathering the stages' parameter counts and FLOPs")) {
      forward_flops += static_cast<double>(f[0]) / dp;
      sum.num_params += f[1] / (dp * tp);
    }
  }
  const double flops_per_token = 3.0 * forward_flops / static_cast<double>(t.seq);
  // The job's rate: each rank measured its own, at its threads, beside the others.
  sum.matmul_flops_per_second = matmul_rate * world;
  sum.predicted_peak_bytes = planned.peak();
  sum.budget_bytes = planned.budget;
  sum.predicted_step_seconds = planned.step_seconds;

  fmt::print(stderr, "remat: {} ({}), {} parameters, {} layers, d_model {}, context {}; {} on {} ({} threads)\n",
             cfg.model.preset, arch_name(cfg.model.arch), format_count(static_cast<double>(sum.num_params)), cfg.model.n_layer,
             cfg.model.d_model, cfg.model.max_seq, cfg.run.dtype, device.str(), threads);
  // Padding rows (model.vocab_multiple x parallel.tp, or a larger model.vocab_size) are said
  // here, since the config shows only the padded size.
  const int64_t padding = cfg.model.vocab_size - tok.vocab_size();
  fmt::print(stderr, "data: {} train / {} validation tokens, vocabulary {}{}, unigram entropy {:.3f} nats/token\n",
             format_count(static_cast<double>(corpus.train_tokens)), format_count(static_cast<double>(corpus.val_tokens)),
             tok.vocab_size(),
             padding > 0 ? fmt::format(" (the model's {} rows: {} padding rows no token uses)", cfg.model.vocab_size,
                                       padding)
                         : "",
             corpus.train_unigram_entropy);
  fmt::print(stderr, "training: {} steps x {} tokens ({} x {} x {} accum{}); run dir {}\n", t.steps,
             tokens_per_step, t.batch, t.seq, t.grad_accum, describe_ranks(local), run_path);
  const std::string plan_text = render_text(spec);
  fmt::print(stderr, "{}", plan_text);
  if (tp > 1) {
    const cost::NodeTimes& links = planned.profile.times;
    const double unit = planned.profile.seconds_per_unit;
    fmt::print(stderr, "tensor-parallel links measured at {:.2f} GB/s a rank sends and {:.1f} us a ring step; the "
               "recompute re-runs {:.1f} ms of collectives\n", links.link_bytes_per_second / unit / 1e9,
               1e6 * links.link_latency_seconds * unit, 1e3 * planned.predicted.recompute_link_seconds * unit);
  }
  if (run) run->write_text("plan.txt", plan_text + "\n" + plan_listing(spec));

  std::mt19937_64 rng(static_cast<uint64_t>(cfg.run.seed));
  std::vector<std::pair<int64_t, double>> train_curve, val_curve;
  std::vector<double> step_times;
  if (first_step == 0) {
    sum.initial_val_loss = validation_loss(*model, val_ds, t, 0, data_ranks, pipe);
    val_curve.emplace_back(0, sum.initial_val_loss);
    log_metrics({{"kind", "val"}, {"step", 0}, {"val_loss", sum.initial_val_loss}});
  } else {
    stepper.load_checkpoint(resumed.path.string(), rng);
    for (const nlohmann::json& j : logged) {
      const int64_t s = j["step"].get<int64_t>();
      if (j["kind"] == "val") {
        val_curve.emplace_back(s, j["val_loss"].get<double>());
        (s == 0 ? sum.initial_val_loss : sum.final_val_loss) = j["val_loss"].get<double>();
      } else if (j["kind"] == "train") {
        train_curve.emplace_back(s, j["loss"].get<double>());
        step_times.push_back(j["step_seconds"].get<double>());
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
    fmt::print(stderr, "{} {} after step {} from {}\n", first_step < t.steps ? "resuming" : "writing the final files of",
               run_path, first_step, resumed.path.string());
  }

  ProgressBar bar(t.steps, cfg.run.progress);
  if (first_step == 0) bar.message(fmt::format("step 0: validation loss {:.4f}", sum.initial_val_loss));
  // The traced step is the third (or the last of fewer): the first two pay for allocation and caches.
  const int64_t traced_step = cfg.run.trace.empty() ? -1 : std::min<int64_t>(2, t.steps - 1);
  const StopSignals signals;
  for (int64_t step = first_step; step < t.steps; ++step) {
    const StepResult r = stepper.run(step, train_ds, rng, step == traced_step);
    if (step == traced_step && lead) util::write_file_atomically(cfg.run.trace, r.trace);
    // Every rank's peak, and whether a signal reached any rank: they all stop after the
    // same step.
    const RankStep gathered = gather_step(ranks.get(), r.peak_bytes, signals.caught(), step + 1);
    const std::vector<int64_t>& rank_peaks = gathered.peaks;
    const int stop = gathered.stop;
    const int64_t peak = *std::max_element(rank_peaks.begin(), rank_peaks.end());
    step_times.push_back(r.seconds);
    sum.losses.push_back(r.loss);
    sum.tokens += tokens_per_step;
    sum.peak_bytes = std::max(sum.peak_bytes, peak);
    keep_highest(sum.rank_peak_bytes, rank_peaks);
    sum.activation_bytes = r.activations.total();
    const StoreCounters& counters = r.counters;
    if (step == 0) {
      const int64_t pooled = counters.pool.hits + counters.pool.misses;
      bar.message(fmt::format("step 1: saved activations {} (predicted {}), peak {}; recompute re-ran {} ops, "
                              "{} recomputed{}", memory::format_bytes(r.activations.total()),
                              memory::format_bytes(predicted.total()), memory::format_bytes(peak),
                              counters.ops_recomputed, memory::format_bytes(counters.bytes_recomputed),
                              pooled > 0 ? fmt::format(", {} of {} allocations from the pool", counters.pool.hits,
                                                       pooled)
                                         : ""));
      sum.recompute_ops_per_step = counters.ops_recomputed;
      sum.recomputed_bytes_per_step = counters.bytes_recomputed;
    }
    train_curve.emplace_back(step + 1, r.loss);
    log_metrics({{"kind", "train"}, {"step", step + 1}, {"loss", r.loss}, {"lr", r.lr},
                 {"grad_norm", r.grad_norm}, {"step_seconds", r.seconds},
                 {"tokens_per_second", tokens_per_step / r.seconds}, {"memory_bytes", r.current_bytes},
                 {"peak_bytes", peak}, {"rank_peak_bytes", rank_peaks},
                 {"activation_bytes", r.activations.total()},
                 {"predicted_activation_bytes", predicted.total()},
                 {"predicted_peak_bytes", sum.predicted_peak_bytes},
                 {"ops_recomputed", counters.ops_recomputed}, {"bytes_recomputed", counters.bytes_recomputed},
                 {"pool_hits", counters.pool.hits}, {"pool_misses", counters.pool.misses},
                 {"pool_bytes_served", counters.pool.bytes_served},
                 {"reduce_buckets", r.reduce_buckets}, {"reduce_buckets_overlapped", r.reduce_buckets_overlapped}});
    bar.update(step + 1, fmt::format("loss {:.4f} | {} tok/s | mem {} (peak {})", r.loss,
                                     format_count(tokens_per_step / r.seconds), memory::format_bytes(r.current_bytes),
                                     memory::format_bytes(peak)));
    const bool last = step + 1 == t.steps;
    if (last || (t.eval_every > 0 && (step + 1) % t.eval_every == 0)) {
      const double v = validation_loss(*model, val_ds, t, step + 1, data_ranks, pipe);
      val_curve.emplace_back(step + 1, v);
      log_metrics({{"kind", "val"}, {"step", step + 1}, {"val_loss", v}});
      bar.message(fmt::format("step {}: validation loss {:.4f}", step + 1, v));
      sum.final_val_loss = v;
    }
    // Every data-parallel rank holds the same parameters: rank 0's copy is the checkpoint,
    // its tensor-parallel peers' parts and, under ZeRO-1, the other ranks' moments
    // gathered into it.
    if ((lead || stepper.gives_to_checkpoint()) && ((step + 1) % t.checkpoint_every == 0 || last || stop != 0)) {
      std::map<std::string, std::string> extra = data_digests(corpus);
      extra.emplace("plan", plan_json);
      write_checkpoint(stepper, run_path, step + 1, rng, t.keep_checkpoints, lead, extra);
    }
    if (stop != 0 && !last) {
      bar.finish();
      fmt::print(stderr, "{} after step {}: the checkpoint is in {}; continue with `remat {}train --resume {}`\n",
                 stop == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)", step + 1,
                 checkpoint_dir(run_path).string(), world > 1 ? fmt::format("launch --nproc {} ", world) : "",
                 run_path);
      sum.stopped_by = stop;
      if (ranks != nullptr) ranks->finish();
      return sum;
    }
  }
  bar.finish();

  sum.steps = t.steps;
  // The first steps pay for allocation and caches; the median of the rest is the rate.
  const std::vector<double> steady(
      step_times.begin() + (step_times.empty() ? 0 : std::min<size_t>(step_times.size() - 1, 2)), step_times.end());
  sum.median_step_seconds = median(steady);
  sum.tokens_per_second = tokens_per_step / sum.median_step_seconds;
  sum.model_flops_per_second = flops_per_token * sum.tokens_per_second;
  // Tensor-parallel ranks gather the weights and sample together (each token's logits are
  // gathered from the vocabulary's shares); the ranks part here, and the rest (the files,
  // the report) is rank 0's.
  // A pipeline's stages give their weights to rank 0, which samples from the whole model
  // once they are written.
  std::vector<std::pair<std::string, at::Tensor>> weights;
  const std::map<std::string, std::string> export_metadata{
      {"format", "pt"}, {"remat.arch", arch_name(cfg.model.arch)}, {"remat.preset", cfg.model.preset}};
  if (pipe != nullptr) {
    if (data_ranks->rank() == 0) {
      // Whole from the tensor-parallel parts (every rank of the group), then from the stages.
      auto stage_weights = model->whole_params(tok.vocab_size());
      if (tensor_ranks == nullptr || tensor_ranks->rank() == 0) {
        write_on_first_stage(*pipe, std::move(stage_weights), lead ? run->file("model.safetensors") : "",
                             export_metadata, "gathering the stages' weights for model.safetensors");
      }
    }
  } else if (lead || tp > 1) {
    // The export has the tokenizer's rows only (the shapes Hugging Face expects); the
    // training checkpoints keep the padding rows, so that a resume continues bitwise.
    weights = model->whole_params(tok.vocab_size());
    if (cfg.run.sample_tokens > 0) {
      sum.sample = sample_text(*model, tok, cfg.run.prompt, cfg.run.sample_tokens, 0.8, 40,
                               static_cast<uint64_t>(cfg.run.seed));
    }
  }
  if (ranks != nullptr) ranks->finish();
  if (!lead) return sum;

  if (pipe == nullptr) model::save_safetensors(run->file("model.safetensors"), weights, export_metadata);
  if (pipe != nullptr && cfg.run.sample_tokens > 0) {
    model.reset();  // the stage's memory goes before the whole model comes
    model = Model::create(cfg.model, device, dtype, static_cast<uint64_t>(cfg.run.seed));
    model->load(run->file("model.safetensors"));
    sum.sample = sample_text(*model, tok, cfg.run.prompt, cfg.run.sample_tokens, 0.8, 40,
                             static_cast<uint64_t>(cfg.run.seed));
  }
  if (cfg.run.sample_tokens > 0) run->write_text("sample.txt", sum.sample + "\n");
  std::string why;
  const bool plotted = run->plot_loss(train_curve, val_curve, sum.unigram_entropy, &why);

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
      {"ranks", dp},
      {"tp", tp},
      {"pp", pp},
      {"stage_layers", planned.split},
      {"predicted_rank_peak_bytes", rank_predicted},
      {"sp", cfg.parallel.sp},
      {"rank_peak_bytes", sum.rank_peak_bytes},
      {"activation_bytes", sum.activation_bytes},
      {"threads", threads},
      {"blas", blas_name()},
      {"device", device.str()},
      {"dtype", cfg.run.dtype},
      {"recompute", plan.policy},
      {"predicted_activation_bytes", predicted.total()},
      {"recompute_ops_per_step", sum.recompute_ops_per_step},
      {"recomputed_bytes_per_step", sum.recomputed_bytes_per_step},
      {"predicted_peak_bytes", sum.predicted_peak_bytes},
      {"predicted_recompute_flops_per_step", planned.predicted.recompute_flops},
      {"budget_bytes", sum.budget_bytes},
      {"predicted_step_seconds", sum.predicted_step_seconds},
      {"predicted_none_peak_bytes", planned.none_peak},
      {"predicted_none_step_seconds", planned.none_step_seconds},
  };
  run->write_text("summary.json", summary.dump(2) + "\n");

  fmt::print(stderr, "\n");
  if (cfg.run.sample_tokens > 0) fmt::print(stderr, "sample: {}\n\n", sum.sample);
  fmt::print(stderr, "validation loss {:.4f} -> {:.4f} nats/token (unigram entropy of the corpus {:.4f})\n",
             sum.initial_val_loss, sum.final_val_loss, sum.unigram_entropy);
  fmt::print(stderr, "step time {:.1f} ms (median, recompute {}), {} tokens/s\n", sum.median_step_seconds * 1e3,
             plan.policy, format_count(sum.tokens_per_second));
  if (sum.predicted_step_seconds > 0) {
    fmt::print(stderr, "predicted step time {:.1f} ms: measured {:+.1f}%\n", sum.predicted_step_seconds * 1e3,
               100.0 * (sum.median_step_seconds - sum.predicted_step_seconds) / sum.predicted_step_seconds);
  }
  fmt::print(stderr, "compute {} FLOP/s of a measured {} FLOP/s {} matmul peak{}: efficiency {:.0f}%\n",
             format_count(sum.model_flops_per_second), format_count(sum.matmul_flops_per_second), cfg.run.dtype,
             world > 1 ? fmt::format(" ({} ranks x {})", world, format_count(matmul_rate)) : "",
             100.0 * sum.model_flops_per_second / sum.matmul_flops_per_second);
  fmt::print(stderr, "memory peak {} per step (predicted {}, {:+.1f}%), of which saved activations {} per "
             "microbatch (predicted {})\n", memory::format_bytes(sum.peak_bytes),
             memory::format_bytes(sum.predicted_peak_bytes),
             100.0 * static_cast<double>(sum.peak_bytes - sum.predicted_peak_bytes) /
                 static_cast<double>(sum.predicted_peak_bytes),
             memory::format_bytes(sum.activation_bytes), memory::format_bytes(predicted.total()));
  if (world > 1) fmt::print(stderr, "memory peak per rank: {}\n", format_rank_peaks(sum.rank_peak_bytes, rank_predicted));
  if (sum.budget_bytes > 0) {
    fmt::print(stderr, "budget {}: measured peak {} it; without recompute the step would peak at {} (predicted){}\n",
               memory::format_bytes(sum.budget_bytes), sum.peak_bytes <= sum.budget_bytes ? "stayed within" : "EXCEEDED",
               memory::format_bytes(planned.none_peak),
               planned.none_step_seconds > 0
                   ? fmt::format(" and take {:.1f} ms (predicted; this plan: {:.1f} ms measured, {:.1f} ms predicted)",
                                 1e3 * planned.none_step_seconds, 1e3 * sum.median_step_seconds,
                                 1e3 * sum.predicted_step_seconds)
                   : "");
  }
  fmt::print(stderr, "run directory {}: config.toml, plan.txt, metrics.jsonl, model.safetensors, tokenizer.model{}{}, "
             "summary.json\n", run_path, plotted ? ", loss.png" : "", cfg.run.sample_tokens > 0 ? ", sample.txt" : "");
  if (!plotted) fmt::print(stderr, "no loss plot: {}\n", why);
  if (traced_step >= 0) {
    fmt::print(stderr, "trace of step {}: {} (open it in https://ui.perfetto.dev)\n", traced_step + 1, cfg.run.trace);
  }
  return sum;
}

}  // namespace remat
