// Language-model head fused with cross-entropy, chunked over tokens.
//
// The [tokens x vocab] logits never live across the backward: forward computes them a
// chunk at a time and keeps only each token's log-sum-exp; backward recomputes each
// chunk's logits, turns them into dlogits and consumes them at once.
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

/// Targets equal to this are ignored (no loss, no gradient).
constexpr int64_t kIgnoreIndex = -1;

struct CrossEntropySaved {
  at::Tensor x;        ///< final hidden states, [N, C]
  at::Tensor targets;  ///< [N] int64
  at::Tensor lse;      ///< log-sum-exp of each token's logits, [N] float32 (float64 for float64 x)
  int64_t chunk = 0;   ///< tokens per chunk
  std::vector<at::Tensor> tensors() const { return {x, targets, lse}; }
};

/// Mean cross-entropy of logits = x w^T ([N, V], never materialised whole) against
/// `targets`, as a 0-dim float32/float64 tensor. x [N, C], w [V, C] (same dtype), targets [N]
/// in [0, V) or kIgnoreIndex (others are refused; this reads their range back to the host).
/// Logits and the loss are reduced in float32 even for bfloat16 x. When every target is
/// ignored the loss is 0 (not NaN) and backward gives zero gradients.
Fwd<CrossEntropySaved> cross_entropy_forward(const at::Tensor& x, const at::Tensor& w,
                                             const at::Tensor& targets, int64_t chunk_tokens);
/// `dloss` scales the gradient of the mean (1 for a plain backward). Returns dx [N, C];
/// accumulates dw [V, C] (a float32 dw for bfloat16 x takes the float32 dlogits).
at::Tensor cross_entropy_backward(double dloss, const CrossEntropySaved& saved, const at::Tensor& w,
                                  at::Tensor& dw);

/// Bytes CrossEntropySaved holds for N tokens.
int64_t cross_entropy_saved_bytes(int64_t tokens, int64_t C, at::ScalarType dtype);
/// Largest temporary, in forward and backward alike: one chunk's logits (chunk x V), in
/// float32 (float64 for float64 x) and, for half/bfloat16 x, also in x's dtype. The softmax
/// and dlogits are computed in place over the float32 logits.
int64_t cross_entropy_workspace_bytes(int64_t chunk_tokens, int64_t vocab, at::ScalarType dtype);
/// Forward FLOPs: 2 N C V for the logits plus about 4 N V for the log-sum-exp.
double cross_entropy_flops(int64_t tokens, int64_t C, int64_t vocab);

}  // namespace remat::ops
