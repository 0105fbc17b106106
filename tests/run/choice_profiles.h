// Time profiles for the tests of the `auto` choices (attention op, loss head), without a
// model: recompute priced at 1 GFLOP/s, the base pass `base[k]` seconds (0: unmeasured)
// for the choice k a config names, and the calls counted per choice.
#pragma once

#include "run/auto.h"

#include <gtest/gtest.h>

#include <map>

namespace remat::testing {

/// `Key` is the choice's enum; `field` the ModelConfig member naming it; `automatic` its
/// unresolved value, which no profile may be asked for.
template <class Key, Key ModelConfig::*field, Key automatic>
struct ChoiceProfiles {
  std::map<Key, double> base;
  std::map<Key, int> calls;
  PricesOf of() {
    return [this](const Config& c) {
      const Key k = c.model.*field;
      EXPECT_NE(k, automatic);
      ++calls[k];
      Prices p;
      p.times.flops_per_second = 1e9;
      p.base_seconds = base[k];
      return p;
    };
  }
};

using AttentionProfiles = ChoiceProfiles<Attention, &ModelConfig::attention, Attention::automatic>;

/// The least budget `cfg` (its loss head named) plans in with attention op `a`: the
/// planner's minimum feasible.
inline int64_t least_budget(Config cfg, Attention a) {
  cfg.model.attention = a;
  cfg.ac.budget = "1KiB";
  Prices p;
  p.times.flops_per_second = 1e9;
  try {
    plan_run(cfg, at::kFloat, p, 0);
  } catch (const BudgetTooSmall& e) {
    return e.min_budget;
  }
  ADD_FAILURE() << "1 KiB fits a plan";
  return 0;
}
using HeadProfiles = ChoiceProfiles<LossHead, &ModelConfig::loss_head, LossHead::automatic>;

}  // namespace remat::testing
