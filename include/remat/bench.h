// `remat bench`: a sweep of recompute settings measured on one machine, in one process or
// in the ranks of one launched job (`remat launch`, torchrun).
//
// Every entry trains a fresh model from the same seed on the same batches for a few
// warm-up steps and then the measured steps, through the step `remat train` runs, and
// reports the peak tensor memory and the median step time. Step times depend on the
// machine and on whatever else runs on it, so a sweep's results are read as ratios to its
// own `none` entry, measured minutes apart in the same process, not as absolute figures.
//
// Under a launcher every rank runs every step together (data parallel over parallel.dp
// ranks, tensor parallel over parallel.tp, with parallel.sp, pipeline stages over
// parallel.pp, each entry on its own split of the layers, as `remat train` would), and
// every rank's peak is gathered after each step; rank 0 prints and writes the report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace remat {

/// One configuration of a sweep: `key=value` overrides applied on top of the sweep's
/// configuration (the config file and the common overrides).
struct BenchEntry {
  std::string label;                   ///< its name in the table and files: the policy as given, or "budget=B"
  std::vector<std::string> overrides;  ///< e.g. {"ac.policy=every:2"} or {"ac.budget=96MiB"}
};

/// One entry per policy (setting ac.policy), then one per budget (setting ac.budget: a
/// byte size such as 96MiB, or a fraction such as 0.6 of the no-recompute peak).
std::vector<BenchEntry> bench_entries(const std::vector<std::string>& policies,
                                      const std::vector<std::string>& budgets);

struct BenchOptions {
  std::string config_file;             ///< TOML config file; empty: defaults
  std::vector<std::string> overrides;  ///< key=value settings common to every entry
  std::vector<BenchEntry> entries;     ///< at least one
  int64_t steps = 10;                  ///< measured steps per entry (>= 1), after the warm-up
  int64_t warmup = 3;                  ///< unmeasured steps per entry before them (>= 0)
  std::string out;                     ///< output directory; empty: <run.out_dir>/bench-<timestamp>
};

/// What one entry measured. Peak and activation bytes are tensor bytes (memory.h).
///
/// Beside the measured figures, the cost model's predicted step peak and the step time
/// predicted from the sweep's measured time profile.
struct BenchRow {
  std::string entry;                 ///< BenchEntry::label
  std::string policy;                ///< canonical policy it ran (ActivationPlan::policy)
  std::string attention;             ///< the attention op it ran (model.attention = auto resolved)
  std::string loss_head;             ///< the loss head it ran (model.loss_head = auto resolved)
  std::vector<double> step_seconds;  ///< every measured step, in order (rank 0's: each step
                                     ///< ends in a collective, so it spans the slowest rank's)
  double median_step_seconds = 0;
  double min_step_seconds = 0;
  double max_step_seconds = 0;
  double tokens_per_second = 0;            ///< training tokens per step / median step time
  int64_t peak_bytes = 0;                  ///< highest step peak over the measured steps (of any rank)
  std::vector<int64_t> rank_peak_bytes;    ///< the same per rank, in rank order (one: this process)
  int64_t activation_bytes = 0;            ///< saved activations of one microbatch, measured
  int64_t predicted_activation_bytes = 0;  ///< the same, predicted from the plan before running
  int64_t predicted_peak_bytes = 0;        ///< the cost model's step peak for the entry's plan (the busiest rank's)
  std::vector<int64_t> predicted_rank_peak_bytes;  ///< per rank: its pipeline stage's (all alike without stages)
  std::vector<int64_t> stage_layers;               ///< layers per pipeline stage (one: every layer)
  double predicted_step_seconds = 0;               ///< from the time profile (0 with ac.profile=false)
  /// Of the prediction: the copies of offloaded slots to host memory and back, the time the
  /// compute waits for them and the time it runs longer beside them
  /// (cost::StepPrediction::copy_seconds, copy_wait_seconds, copy_slowdown_seconds).
  double predicted_copy_seconds = 0, predicted_copy_wait_seconds = 0, predicted_copy_slowdown_seconds = 0;
  int64_t budget_bytes = 0;  ///< ac.budget of a budget entry, else 0
  /// CUDA: the caching allocator's reserved peak over the measured steps (this rank's),
  /// and the allocated and reserved peaks its model predicts for the plan (the busiest
  /// stage's); 0 on the CPU.
  int64_t reserved_peak_bytes = 0;
  int64_t predicted_cuda_allocated_bytes = 0;
  int64_t predicted_cuda_reserved_bytes = 0;
  int64_t ops_recomputed = 0;    ///< forward ops the store re-ran in the last step
  int64_t bytes_recomputed = 0;  ///< bytes it recomputed in the last step
  double final_loss = 0;         ///< training loss of the last step
};

struct BenchResult {
  int rank = 0;                ///< this process's rank in a launched job: rank 0's result is the report
  std::string dir;             ///< where the files went (rank 0; empty on the other ranks)
  std::vector<BenchRow> rows;  ///< one per entry, in sweep order
  size_t reference = 0;        ///< the row ratios are to: the first running `none`, else the first
  bool losses_equal = true;    ///< whether every final loss is bitwise the reference's
};

/// Runs the sweep. Every entry's configuration is loaded and its policy compiled before
/// anything runs, so a bad entry fails in seconds with a sentence naming it. Then each
/// entry trains warmup + steps steps (train.steps is set to that count, so the learning
/// rate schedule is the same for every entry), and the directory receives bench.csv,
/// bench.json (the rows and the machine), bench.png (gnuplot; skipped with a note when it
/// is missing), config.toml (the common configuration) and metrics.jsonl (every step).
/// A header, a line per entry (unless run.progress=false) and a warning when the final
/// losses differ go to stderr. Throws std::exception with a user-facing sentence.
///
/// Started by a launcher (include/remat/dist.h), every rank must call it with the same
/// options: the ranks join as `remat train` joins them (parallel.dp x parallel.tp x
/// parallel.pp must be the ranks started; parallel.* cannot differ between entries), each
/// plans and runs its share, and only rank 0 prints and writes the directory.
BenchResult run_bench(const BenchOptions& options);

/// The result as a text table: entry | peak | predicted | x ref | step ms | predicted |
/// x ref | tokens/s | ops recomputed, the ratios to the reference row ("x none", or
/// "x first" with a line saying which entry that is when the sweep has no `none`). With
/// several ranks the peak is the highest rank's, and a line per entry gives every rank's
/// peak beside the prediction.
std::string format_bench_table(const BenchResult& result);

}  // namespace remat
