// The activation plan of a training run: from the policy the ac.* settings name, or,
// with ac.budget, solved by the planner; with the cost model's prediction of the step.
#pragma once

#include "remat/config.h"
#include "remat/cost.h"
#include "remat/plan.h"
#include "train/profile.h"

#include <string>

namespace remat {

struct RunPlan {
  ActivationPlan plan;
  cost::StepPrediction predicted;  ///< peak, breakdown and recompute of one step
  int64_t budget = 0;              ///< bytes; 0 without ac.budget
  double step_seconds = 0;         ///< predicted step time; 0 without a measured profile
  int64_t none_peak = 0;           ///< predicted peak of the same step keeping everything
  double none_step_seconds = 0;    ///< its predicted time; 0 without a measured profile
  /// Per layer: what is kept, its bytes and its predicted recompute FLOPs; then the
  /// predicted peak and its breakdown (printed before the first step and in plan.txt).
  std::string text;
};

/// Plans `cfg` (vocab_size set) at its train.* shape in `dtype`, one rank's share (under
/// parallel.zero = 1 the optimizer sharded over parallel.dp ranks); `profile` prices
/// recompute (and, when measured, the whole step); `resident` bytes (the token corpus)
/// stay live through every step. Throws std::invalid_argument with the minimum feasible
/// budget when ac.budget is below it.
RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const TimeProfile& profile, int64_t resident);

}  // namespace remat
