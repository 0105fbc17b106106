// `remat plan`: the fastest recompute plan within a memory budget, without allocating.
#pragma once

#include "remat/config.h"

#include <string>

namespace remat::cli {

struct PlanArgs {
  std::string budget;             ///< overrides ac.budget; empty: ac.budget, else the no-recompute peak
  bool pareto = false;            ///< print and plot the memory/time frontier
  bool json = false;              ///< everything as JSON on stdout
  std::string plot = "pareto.png";  ///< where --pareto draws
  int points = 24;                ///< budgets sampled along the frontier
  bool explain_block = false;     ///< print the block graph's value table instead of a plan
};

/// Plans `cfg`'s model at train.batch x train.seq in run.dtype and prints the result (or,
/// with explain_block, the table of one block's values, shapes, bytes and slots).
/// Throws std::invalid_argument with a sentence for a budget below the minimum.
int cmd_plan(const Config& cfg, const PlanArgs& args);

}  // namespace remat::cli
