// The attention ops a block may run (ModelConfig::attention, LayerPlan::attention): apart
// from the config so that activation plans name them without the whole configuration.
#pragma once

namespace remat {

/// How a block computes causal attention: `math` materialises the [T x T] scores and keeps
/// the probabilities (and dropout mask) for the backward (remat/ops/attention.h); `tiled`
/// computes over tiles with an online softmax, keeps one log-sum-exp per row and recomputes
/// the probabilities tile by tile in the backward (remat/ops/tiled_attention.h).
/// `automatic` ("auto") leaves the choice to the planner (src/run/auto.h):
/// commands resolve it to math or tiled before anything is built or planned (under a budget
/// with both ops' measured times, the plan may run the other op in some layers), and
/// building a block with it unresolved throws.
enum class Attention { math, tiled, automatic };
/// The ops `auto` chooses among, the default first.
constexpr Attention kAttentionOps[] = {Attention::math, Attention::tiled};
/// "math" / "tiled" / "auto", as configs spell it.
const char* attention_name(Attention a);

}  // namespace remat
