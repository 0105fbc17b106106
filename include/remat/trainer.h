// Training: data, model, AdamW with warmup + cosine, gradient accumulation and clipping,
// periodic validation, memory and speed measured every step, a run directory at the end.
#pragma once

#include "remat/config.h"
#include "remat/data.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace remat {

struct TrainSummary {
  std::string run_dir;
  int64_t steps = 0;
  int64_t tokens = 0;           ///< training tokens consumed
  std::vector<double> losses;   ///< mean training loss of every step
  double initial_val_loss = 0;  ///< before the first step
  double final_val_loss = 0;
  double unigram_entropy = 0;  ///< of the training tokens, nats/token
  double median_step_seconds = 0;
  double tokens_per_second = 0;
  double model_flops_per_second = 0;     ///< 3 x forward FLOPs per token x tokens/s
  double matmul_flops_per_second = 0;    ///< measured on this machine, same dtype; summed over the ranks
  int64_t peak_bytes = 0;                ///< highest per-step peak of tensor bytes (of any rank)
  std::vector<int64_t> rank_peak_bytes;  ///< the same, per data-parallel rank
  int64_t predicted_peak_bytes = 0;      ///< the cost model's step peak for the plan, before the first step
  int64_t budget_bytes = 0;              ///< ac.budget in bytes (0: no budget)
  /// CUDA: the caching allocator's highest reserved bytes (this rank's), what a budget
  /// holds there, and what its model predicted for the plan's busiest stage; 0 on CPU.
  int64_t reserved_peak_bytes = 0;
  int64_t predicted_reserved_bytes = 0;
  /// Offloaded slots (LayerPlan::offloaded): the most bytes this rank held in host memory,
  /// and the cost model's figure; 0 without offload.
  int64_t host_peak_bytes = 0;
  int64_t host_pinned_bytes = 0;  ///< of the host pool's buffers, page-locked for CUDA copies
  int64_t predicted_host_peak_bytes = 0;
  double predicted_step_seconds = 0;  ///< from the measured time profile (0: ac.profile=false)
  /// The CPUs other processes kept busy on average while the steps ran (rank 0's machine,
  /// less the job's own processes there); unknown where /proc/stat could not be read.
  std::optional<double> other_cpus;
  double tolerated_other_cpus = 0;         ///< beyond which they slow the run's threads
  int64_t activation_bytes = 0;            ///< saved-activation bytes of one microbatch, measured
  int64_t predicted_activation_bytes = 0;  ///< the same, predicted from the plan before the first step
  int64_t recompute_ops_per_step = 0;      ///< forward ops the store re-executed in the first step
  int64_t recomputed_bytes_per_step = 0;
  int64_t num_params = 0;
  std::string sample;  ///< text generated at the end
  /// SIGINT, SIGTERM or SIGHUP when one stopped the run: after a step and its checkpoint
  /// (no final weights then), or during the final sample (cut short, the weights written);
  /// 0: it ran to the end.
  int stopped_by = 0;
};

/// Learning rate of 0-based `step`: linear warmup over train.warmup steps to train.lr,
/// then cosine decay reaching train.min_lr at the last step.
double learning_rate(const TrainConfig& t, int64_t step);

/// Where the corpus `data` describes is prepared: `<data.dir>/<source>-v<vocab_size>`, or
/// `<data.dir>/<source>-<tokenizer's name>` with a given tokenizer. <source> is the text's
/// stem (a glob's with its wildcards spelled out), then the format where it is not text.
std::string corpus_dir(const DataConfig& data);

/// Prepares (or finds cached) the corpus `data` describes, under corpus_dir(data), logging
/// to stderr.
data::CorpusInfo prepare_data(const DataConfig& data);

/// Lines of progress and results go to stderr (a progress bar on a terminal).
/// Throws std::exception with a user-facing sentence on bad input. Every
/// train.checkpoint_every steps, at the end, and when SIGINT or SIGTERM arrives (the run
/// then stops after the step in progress), the training state goes to
/// `<run>/checkpoints/step-NNNNNNNN.safetensors`; with `resume_dir` (a run directory, `cfg`
/// read from its config.toml) training continues from its newest checkpoint, and the
/// losses and weights are bitwise those of a run never stopped (on CPU). Started by a
/// launcher with several ranks (remat launch, torchrun; include/remat/dist.h), the ranks
/// share every batch (data parallel); rank 0 alone prints and writes the run directory,
/// and the summary of the other ranks ends after the last step.
TrainSummary train(const Config& cfg, const std::string& resume_dir = "");

/// Receives generated text piece by piece, as it is sampled.
using TextSink = std::function<void(std::string_view)>;

/// Samples `tokens` tokens after `prompt` from the weights of a finished run, on `device`
/// ("cpu", "cuda[:N]"; empty: the run's own device). On CPU the model runs in float32
/// whatever dtype it was trained in. `on_text` streams the text and `generated` receives
/// the tokens sampled (sample_text).
std::string generate_from_run(const std::string& run_dir, const std::string& prompt, int64_t tokens, double temperature,
                              int64_t top_k, uint64_t seed, const std::string& device = "",
                              const TextSink& on_text = {}, int64_t* generated = nullptr);

}  // namespace remat
