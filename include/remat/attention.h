// The attention ops a block may run (ModelConfig::attention, LayerPlan::attention): apart
// from the config so that activation plans name them without the whole configuration.
#pragma once

#include <torch/version.h>

namespace remat {

/// How a block computes causal attention: `math` materialises the [T x T] scores and keeps
/// the probabilities (and dropout mask) for the backward (remat/ops/attention.h); `tiled`
/// computes over tiles with an online softmax, keeps one log-sum-exp per row and recomputes
/// the probabilities tile by tile in the backward, in loops of its own on the CPU
/// (remat/ops/tiled_attention.h); `sdpa` does what tiled does through ATen's fused kernels
/// (the CPU's, and the flash kernel in 16-bit on CUDA), without dropout, on LibTorch 2.9
/// and later (remat/ops/sdpa_attention.h).
/// `automatic` ("auto") leaves the choice to the planner (src/run/auto.h):
/// commands resolve it to one of kAttentionOps before anything is built or planned (under a
/// budget with the ops' measured times, the plan may run another op in some layers), and
/// building a block with it unresolved throws.
enum class Attention { math, tiled, sdpa, automatic };

/// Whether this build's LibTorch has ATen's fused CPU attention with grouped-query heads
/// (its flash kernel takes fewer key/value heads than query heads from 2.9 on).
#define REMAT_SDPA_BUILT (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9))
constexpr bool kSdpaBuilt = REMAT_SDPA_BUILT;

/// The ops `auto` chooses among, the default first (sdpa where this build has it).
#if REMAT_SDPA_BUILT
constexpr Attention kAttentionOps[] = {Attention::math, Attention::tiled, Attention::sdpa};
#else
constexpr Attention kAttentionOps[] = {Attention::math, Attention::tiled};
#endif

/// "math" / "tiled" / "sdpa" / "auto", as configs spell it.
const char* attention_name(Attention a);

}  // namespace remat
