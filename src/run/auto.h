// model.loss_head = auto and model.attention = auto: the head and the attention op a run
// takes, each chosen by planning the run once per candidate and handing the plans to the
// one chooser (run/choice.h). Every command resolves them here, before it builds a model.
#pragma once

#include "remat/config.h"
#include "run/planning.h"
#include "remat/prices.h"

#include <functional>

namespace remat {

/// The prices of a run's rank share `local`, whose model.attention and model.loss_head are
/// named (not auto): each op and head has its own (PriceSource::of).
using PricesOf = std::function<Prices(const Config& local)>;

/// plan_run of `local` (the rank share of `cfg`) with prices_of(local)'s times, with both
/// `auto` settings resolved and written into both configs (each profile taken once).
///
/// model.loss_head = auto, candidates fused then recompute: without ac.budget, fused alone
/// (the recompute head saves bytes only a budget has use for); with one, both heads are
/// planned (each with its attention op resolved as below), held to the same bytes (a
/// fraction is of the fused head's no-recompute peak, with math where the op is auto), and
/// choose() takes one, weighing without measured times the plan's recompute FLOPs plus the
/// recompute head's extra [tokens x d_model x vocab] product (one stage only: a pipeline's
/// ranks each see their own stage's FLOPs, so there fused).
///
/// model.attention = auto, candidates kAttentionOps (math, tiled, then sdpa where this build
/// has it and the model has no attention dropout: attention_refusal): without ac.budget and
/// ac.profile, math alone (measured faster on this CPU); otherwise every candidate is
/// planned (a fraction of math's no-recompute peak) and choose() takes one, the first
/// without measured times. With a budget and every profile measured, a plan running the
/// chosen op and one other per layer (cost::OtherAttention) is taken instead where it mixes
/// the ops and is predicted faster.
///
/// The plan's `choices` and the lines leading its text say what was taken and why. Every
/// rank of a job calls this alike, with profiles alike (rank 0's times), and so chooses
/// alike. A `saved` plan (a resumed run's) is for named settings (its config.toml names what
/// auto chose) and is predicted as it is, with the other op's times where its layers run
/// both. Where no candidate fits, throws BudgetTooSmall with every candidate's minimum.
/// A budget plan's offloaded slots may hold `host_budget` bytes (plan_run).
RunPlan plan_run_auto(Config& cfg, Config& local, at::ScalarType dtype, const PricesOf& prices_of, int64_t stage = 0,
                      const SavedPlan* saved = nullptr, int64_t host_budget = 0);

}  // namespace remat
