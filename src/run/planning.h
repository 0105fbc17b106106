// The activation plan of a training run: from the policy the ac.* settings name, or,
// with ac.budget, the planner's (remat/planner.h); with the cost model's prediction of the
// step.
#pragma once

#include "remat/config.h"
#include "remat/cost.h"
#include "remat/layout.h"
#include "remat/plan.h"
#include "remat/planner.h"
#include "remat/prices.h"
#include "run/saved_plan.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace remat {

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

/// Whether the run trains on a CUDA device (its memory is the caching allocator's).
bool on_cuda(const RunConfig& run);

/// A run's activation plan and what the cost model predicts of its step.
struct RunPlan {
  ActivationPlan plan;
  cost::StepPrediction predicted;    ///< peak, breakdown and recompute of one step (of this rank's stage)
  std::vector<int64_t> split;        ///< layers per pipeline stage (one stage: every layer)
  std::vector<int64_t> stage_peaks;  ///< each stage's predicted peak (one stage: predicted.peak)
  /// The highest stage peak: what a per-rank budget holds.
  int64_t peak() const { return *std::max_element(stage_peaks.begin(), stage_peaks.end()); }
  /// With AdamW's state sharded over data-parallel ranks: each one's predicted peak on every
  /// stage, [rank][stage] (Planner::rank_peaks); empty where a stage's ranks hold the same.
  /// Walked when asked, so that the plans an `auto` weighs and drops walk no ranks.
  std::vector<std::vector<int64_t>> dp_rank_peaks() const { return planner->rank_peaks(plan, split); }
  /// Each of `world` ranks' predicted peak, in dist::Comm::connect's order (stage, then
  /// data-parallel rank, then tensor-parallel rank, `tp` of them): its stage's, or with a
  /// sharded optimizer its own share's.
  std::vector<int64_t> rank_peaks(int world, int64_t tp) const;
  /// With pipeline stages: every stage's prediction, the bottleneck and the schedule's time.
  std::optional<PlanResult> pipeline;
  int64_t stage = 0;               ///< the stage `predicted` is of
  int64_t budget = 0;              ///< bytes; 0 without ac.budget
  int64_t host_budget = 0;         ///< bytes the offloaded slots may hold at once (ac.host_budget resolved)
  double step_seconds = 0;         ///< predicted step time; 0 without a measured profile
  int64_t none_peak = 0;           ///< predicted peak of the same step keeping everything
  double none_step_seconds = 0;    ///< its predicted time; 0 without a measured profile
  bool resumed = false;            ///< the plan is a checkpoint's (SavedPlan), predicted as it is
  std::vector<std::string> slots;  ///< the slots the model's block has (of block_slots()), in order
  Prices prices;                   ///< what it was priced with
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
  /// The planner that planned it: `remat plan` asks it for the frontier and the least budget.
  std::shared_ptr<const Planner> planner;
};

/// The shape of one microbatch of `local` (a rank share: train.batch is the rank's rows)
/// in `dtype`, as the cost model prices it.
cost::StepShape step_shape(const Config& local, at::ScalarType dtype);

/// The layout of stage `stage`'s ranks of `local`: the parallel.* groups, and the layers
/// per stage ac.num_layers_per_stage gives, or, without ac.budget, the even split (with
/// one, the planner chooses them).
Layout layout_of(const Config& local, int64_t stage);

/// Plans `cfg` (vocab_size set; a rank share: from parallel.zero = 1 the optimizer sharded
/// over parallel.dp ranks, at 2 the gradients too) at its train.* shape in `dtype`, for stage `stage`'s ranks
/// (layout_of); `prices` price recompute (and, when measured, the whole step). Throws
/// BudgetTooSmall, with the minimum feasible budget, when ac.budget is below it;
/// `budget_reference` (bytes, 0: this plan's no-recompute peak) is what a fractional
/// ac.budget ("0.6") is a fraction of; the offloaded slots of a budget plan may hold
/// `host_budget` bytes. With several pipeline stages every stage is planned and `predicted`
/// is stage `stage`'s. A `saved` plan (a resumed run's) is predicted as it is, neither
/// compiled from the policy nor solved again.
RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const Prices& prices, int64_t stage = 0,
                 int64_t budget_reference = 0, const SavedPlan* saved = nullptr, int64_t host_budget = 0);

/// The least peak any plan of `cfg`'s one-stage run reaches with `host_budget` bytes of
/// host memory (Planner::least_budget), with any attention op and loss head its autos may
/// choose, where it is above `room` bytes, else nullopt: bytes need no prices, so this runs
/// before a time profile would run a step of the batch. Full recompute's peak (one
/// prediction) is tried first, the search only where it is above.
std::optional<int64_t> least_peak_above(const Config& cfg, at::ScalarType dtype, int64_t host_budget, int64_t room);

}  // namespace remat
