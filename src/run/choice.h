// The one chooser behind every `auto` setting (model.attention, model.loss_head): given the
// run planned once per candidate configuration, it takes the candidate the run trains with
// and says why, in a typed reason with its figures.
#pragma once

#include "run/planning.h"

#include <optional>
#include <string>
#include <vector>

namespace remat {

/// One candidate configuration of an `auto` setting, planned.
struct Candidate {
  std::string name;             ///< as sentences name it: "math", "the fused head"
  std::optional<RunPlan> plan;  ///< its plan, or nullopt when no plan fits the budget
  std::string unfit;            ///< then the planner's sentence
  int64_t least = 0;            ///< and the least budget that fits (bytes)
  /// FLOPs a step spends that the candidates differ by (recompute, and what the candidate
  /// runs more), weighed where no time is measured and the setting weighs FLOPs.
  double weighed_flops = 0;
};

/// The candidate taken: its index in the list, the reason, and the sentence with figures.
struct Chosen {
  size_t index = 0;
  ChoiceReason reason = ChoiceReason::preferred;
  std::string text;
};

/// How a setting breaks a tie where no time is measured.
struct ChoiceRules {
  std::string setting;     ///< "model.attention"
  std::string candidates;  ///< what the candidates are, for the sentence where none fits: "attention ops"
  /// Weigh FLOPs without measured times (fewer_flops); else the first candidate is taken.
  bool weigh_flops = false;
  std::string flops_what;     ///< what the weighed FLOPs are: "of recompute and head products"
  std::string preferred_why;  ///< why the first candidate is the default: "math, the faster op on this CPU"
};

/// Takes one of `candidates` (first: the default), all planned for the same budget:
///  - none fits: throws BudgetTooSmall naming each candidate's least budget, with the
///    sentence of the one with the lowest (and that as its minimum);
///  - one fits: that one;
///  - several fit: the lowest predicted step time where every fitting candidate has one,
///    else (rules.weigh_flops) the fewest weighed FLOPs, else the first that fits.
/// Ties go to the earlier candidate.
Chosen choose(const std::vector<Candidate>& candidates, const ChoiceRules& rules);

}  // namespace remat
