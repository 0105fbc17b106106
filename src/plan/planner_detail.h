// What the planner's programs share (src/plan/{options,one_stage,stages,planner}.cpp).
#pragma once

#include "remat/planner.h"

#include <algorithm>

namespace remat::detail {

/// The most a layer holds at once above the layers below it, forward or backward: what
/// the programs check against the budget.
inline int64_t top(const LayerOption& o) { return std::max(o.cost.forward_peak, o.cost.backward_peak); }

/// The least budget in [lo, hi] that `feasible` admits, feasibility rising with the budget
/// (hi admitted).
template <typename Feasible>
int64_t least_budget(int64_t lo, int64_t hi, const Feasible& feasible) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (feasible(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return hi;
}

}  // namespace remat::detail
