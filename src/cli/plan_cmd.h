// `remat plan`: the run `remat train` would run, resolved and priced without allocating,
// then what else is worth knowing before choosing a budget (minimum, frontier, collectives).
#pragma once

#include "remat/config.h"

#include <string>

namespace remat::cli {

struct PlanArgs {
  std::string budget;               ///< sets ac.budget; empty: the config's ac settings decide
  bool pareto = false;              ///< print and plot the memory/time frontier
  bool json = false;                ///< everything as JSON on stdout
  std::string plot = "pareto.png";  ///< where --pareto draws
  int points = 24;                  ///< budgets sampled along the frontier
  bool explain_block = false;       ///< print the block graph's value table instead of a plan
  /// A run directory (or its prices.json) whose recorded prices price the plan, instead of
  /// parallel.compute_rate, link_rate and ac.offload_rate: that run's plan, made again.
  std::string prices;
};

/// Resolves the run `cfg` describes (resolve_run: the prepared corpus counted where there is
/// one, time priced by FLOPs at parallel.compute_rate, or by a run's recorded prices) and
/// prints it as `remat train` does before its first step,
/// then the analyses (or, with explain_block, the table of one block's values, shapes,
/// bytes and slots). Throws std::invalid_argument with a sentence for a budget below the
/// minimum.
int cmd_plan(const Config& cfg, const PlanArgs& args);

}  // namespace remat::cli
