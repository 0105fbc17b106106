// The activation plan of a training run: from the policy the ac.* settings name, or,
// with ac.budget, solved by the planner; with the cost model's prediction of the step.
#pragma once

#include "remat/config.h"
#include "remat/cost.h"
#include "remat/plan.h"
#include "remat/planner.h"
#include "train/profile.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace remat {

/// What plan_run throws when ac.budget fits no plan: the sentence, and the least budget
/// that fits (model.attention = auto compares it between the attention ops).
struct BudgetTooSmall : std::invalid_argument {
  BudgetTooSmall(const std::string& sentence, int64_t least) : std::invalid_argument(sentence), min_budget(least) {}
  int64_t min_budget;  ///< bytes: the minimum feasible budget of the run (of every stage, pipelined)
};

/// Why an `auto` setting's candidate was taken (run/choice.h).
enum class ChoiceReason {
  only_candidate,    ///< the setting had one candidate worth planning (the text says why)
  only_fit,          ///< the only candidate whose plans fit the budget
  faster_predicted,  ///< every fitting candidate has a measured step time: the lowest
  fewer_flops,       ///< no measured times: the fewest weighed FLOPs
  preferred,         ///< no measured times, nor FLOPs to weigh: the default candidate
  mixed_per_layer,   ///< model.attention: a plan running the ops per layer, predicted faster
};

/// What an `auto` setting resolved to, and why.
struct Choice {
  std::string label;    ///< "attention", "loss head"
  std::string setting;  ///< "model.attention"
  std::string taken;    ///< the value taken: "tiled"
  ChoiceReason reason = ChoiceReason::preferred;
  std::string why;  ///< the reason with its figures, a clause
  /// "attention: tiled (model.attention = auto): <why>", without newline.
  std::string line() const;
};

/// A run's activation plan and what the cost model predicts of its step.
/// Whether the run trains on a CUDA device (its memory is the caching allocator's).
bool on_cuda(const RunConfig& run);

struct RunPlan {
  ActivationPlan plan;
  cost::StepPrediction predicted;    ///< peak, breakdown and recompute of one step (of this rank's stage)
  std::vector<int64_t> split;        ///< layers per pipeline stage (one stage: every layer)
  std::vector<int64_t> stage_peaks;  ///< each stage's predicted peak (one stage: predicted.peak)
  /// The highest stage peak: what a per-rank budget holds.
  int64_t peak() const { return *std::max_element(stage_peaks.begin(), stage_peaks.end()); }
  /// With pipeline stages: every stage's prediction, the bottleneck and the schedule's time.
  std::optional<PipelinePlan> pipeline;
  int64_t stage = 0;               ///< the stage `predicted` is of
  int64_t budget = 0;              ///< bytes; 0 without ac.budget
  double step_seconds = 0;         ///< predicted step time; 0 without a measured profile
  int64_t none_peak = 0;           ///< predicted peak of the same step keeping everything
  double none_step_seconds = 0;    ///< its predicted time; 0 without a measured profile
  bool resumed = false;            ///< the plan is a checkpoint's (SavedPlan), predicted as it is
  std::vector<std::string> slots;  ///< the slots the model's block has (of block_slots()), in order
  TimeProfile profile;             ///< the times it was priced with
  /// On CUDA, what the caching allocator holds at its highest on each stage (the cost
  /// model's allocations replayed by its model); what a budget holds there is the reserved
  /// bytes. Empty on the CPU.
  std::vector<cost::DeviceMemory> device;
  /// The highest allocated and reserved peaks of `device` over the stages (zeros on the CPU).
  cost::DeviceMemory device_peak() const;
  /// The prediction of the peak a run measures: on CUDA the allocator model's allocated
  /// bytes (requests rounded up, the cuBLAS workspace among them), on the CPU peak().
  int64_t measured_peak() const { return device.empty() ? peak() : device_peak().allocated_peak; }
  /// What the `auto` settings resolved to (loss head first), none where the config named
  /// them.
  std::vector<Choice> choices;
};

/// The plan a run trained with, as its training checkpoints keep it: a resumed run runs it
/// again, whatever planning would choose now (another machine's measured times, a cache
/// measured again), so that its memory stays what was predicted and printed.
struct SavedPlan {
  ActivationPlan plan;         ///< every layer's, of the whole model
  std::vector<int64_t> split;  ///< layers per pipeline stage
};

/// `r`'s plan and split as one JSON text (a checkpoint's "plan" metadata).
std::string saved_plan_json(const RunPlan& r);

/// The plan `json` holds, for a model of `n_layers` blocks on `stages` pipeline stages.
/// Throws std::invalid_argument with a sentence when it is damaged or was made for another
/// model (the layer count, the split, a slot no block has).
SavedPlan parse_saved_plan(const std::string& json, int64_t n_layers, int64_t stages);

/// The shape of one microbatch of `local` (a rank share: train.batch is the rank's rows)
/// in `dtype`, with `resident` bytes held besides the model, as the cost model prices it.
cost::StepShape step_shape(const Config& local, at::ScalarType dtype, int64_t resident);

/// The planner's options a run of `cfg` takes: ac.early_stop, and ac.host_budget's bytes
/// (as resolve_run writes them; unset: nothing offloaded).
PlannerOptions planner_options(const Config& cfg);

/// Plans `cfg` (vocab_size set) at its train.* shape in `dtype`, one rank's share (under
/// parallel.zero = 1 the optimizer sharded over parallel.dp ranks); `profile` prices
/// recompute (and, when measured, the whole step); `resident` bytes (the token corpus)
/// stay live through every step. Throws BudgetTooSmall, with the minimum feasible budget,
/// when ac.budget is below it; `budget_reference` (bytes, 0: this plan's no-recompute peak)
/// is what a fractional ac.budget ("0.6") is a fraction of. With parallel.pp stages, every stage is planned (with
/// ac.budget the split and the plans together, Planner::solve_pipeline) and `predicted` is
/// stage `stage`'s. A `saved` plan (a resumed run's) is predicted as it is, neither
/// compiled from the policy nor solved again.
RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const TimeProfile& profile, int64_t resident,
                 int64_t stage = 0, int64_t budget_reference = 0, const SavedPlan* saved = nullptr);

}  // namespace remat
