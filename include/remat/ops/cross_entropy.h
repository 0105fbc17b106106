// Language-model head fused with cross-entropy, chunked over tokens, in two variants.
//
// The [tokens x vocab] logits never live across the backward. The recomputing head
// (cross_entropy_*) computes them a chunk at a time in the forward and keeps only each
// token's log-sum-exp; its backward recomputes each chunk's logits, turns them into dlogits
// and consumes them at once. The fused head (fused_cross_entropy_*) knows each chunk's
// dlogits (softmax minus one-hot, over the count) as soon as its logits exist, so its
// forward also computes the gradients of x and w and keeps those: one product fewer per
// chunk, for a kept [V, C] weight gradient instead of x and the log-sum-exp.
//
// Both split over a vocabulary-parallel group (Megatron's vocab-parallel cross-entropy):
// given a VocabShard, w is this rank's [V/t, C] rows and the targets stay global; each
// chunk's logits are this rank's columns, and two all-reduces over the group (the row max;
// then the row sums of exp together with the target logits, each taken on the rank holding
// the target) complete the log-sum-exp, so the loss is the same on every rank. dw is this
// rank's rows and dx this rank's part of x's gradient: the caller sums dx over the group.
#pragma once

#include "remat/ops/common.h"
#include "remat/ops/vocab_shard.h"

#include <optional>

namespace remat::dist {
class Group;
}

namespace remat::ops {

/// Targets equal to this are ignored (no loss, no gradient).
constexpr int64_t kIgnoreIndex = -1;

struct CrossEntropySaved {
  at::Tensor x;                     ///< final hidden states, [N, C]
  at::Tensor targets;               ///< [N] int64
  at::Tensor lse;                   ///< log-sum-exp of each token's logits, [N] float32 (float64 for float64 x)
  int64_t chunk = 0;                ///< tokens per chunk
  std::optional<VocabShard> shard;  ///< the rows w holds, when it holds a share of the vocabulary
  std::vector<at::Tensor> tensors() const { return {x, targets, lse}; }
};

/// Mean cross-entropy of logits = x w^T ([N, V], never materialised whole) against
/// `targets`, as a 0-dim float32/float64 tensor. x [N, C], w [V, C] (same dtype), targets [N]
/// in [0, V) or kIgnoreIndex (others are refused; this reads their range back to the host).
/// Logits and the loss are reduced in float32 even for bfloat16 x. When every target is
/// ignored the loss is 0 (not NaN) and backward gives zero gradients.
/// With `shard`, w holds the vocabulary rows [offset, offset + w.size(0)) of V =
/// shard->vocab, the other ranks of `group` (rank r the r-th rows; null: one rank, whose
/// share is the whole vocabulary) the rest, and every rank calls this with the same x and
/// targets; the loss and the saved log-sum-exp are then the same on every rank.
Fwd<CrossEntropySaved> cross_entropy_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets,
                                             int64_t chunk_tokens, std::optional<VocabShard> shard = std::nullopt,
                                             dist::Group* group = nullptr);
/// `dloss` scales the gradient of the mean (1 for a plain backward). Returns dx [N, C];
/// accumulates (or writes, `into`) dw [V, C] (a float32 dw for bfloat16 x takes the float32
/// dlogits). With saved.shard, dx is this rank's part (the sum over the ranks is x's
/// gradient) and dw its rows; no collective runs (the saved log-sum-exp is already the whole
/// vocabulary's).
at::Tensor cross_entropy_backward(double dloss, const CrossEntropySaved& saved, const at::Tensor& w, at::Tensor& dw,
                                  GradInto into = GradInto::add);

/// What the fused head's backward reads: the gradients of the mean loss (dloss = 1).
struct FusedCrossEntropySaved {
  at::Tensor dx;  ///< [N, C], x's dtype
  at::Tensor dw;  ///< [V, C], in the statistics' dtype (float32 for bfloat16 x)
  std::vector<at::Tensor> tensors() const { return {dx, dw}; }
};

/// The loss of cross_entropy_forward (bitwise the same value) and, when `grads`, its
/// gradients with respect to x and w, computed chunk by chunk from the same logits (a
/// forward for evaluation passes grads = false and keeps nothing). `shard` and `group` as
/// there: dx is then this rank's part and dw its rows.
Fwd<FusedCrossEntropySaved> fused_cross_entropy_forward(const at::Tensor& x, const at::Tensor& w,
                                                        const at::Tensor& targets, int64_t chunk_tokens, bool grads,
                                                        std::optional<VocabShard> shard = std::nullopt,
                                                        dist::Group* group = nullptr);
/// Returns dx = dloss * saved.dx (new memory); accumulates (or writes, `into`) dloss *
/// saved.dw into dw.
at::Tensor fused_cross_entropy_backward(double dloss, const FusedCrossEntropySaved& saved, at::Tensor& dw,
                                        GradInto into = GradInto::add);

/// Bytes CrossEntropySaved holds for N tokens.
int64_t cross_entropy_saved_bytes(int64_t tokens, int64_t C, at::ScalarType dtype);
/// Bytes FusedCrossEntropySaved holds for N tokens of width C and a vocabulary of V.
int64_t fused_cross_entropy_saved_bytes(int64_t tokens, int64_t C, int64_t vocab, at::ScalarType dtype);
/// Largest temporary, in forward and backward alike: one chunk's logits (chunk x V, V the
/// rows w holds), in float32 (float64 for float64 x) and, for half/bfloat16 x, also in x's
/// dtype. The softmax and dlogits are computed in place over the float32 logits.
int64_t cross_entropy_workspace_bytes(int64_t chunk_tokens, int64_t vocab, at::ScalarType dtype);
/// Forward FLOPs: 2 N C V for the logits plus about 4 N V for the log-sum-exp (with a
/// share of the vocabulary, V is its rows: the FLOPs this rank runs).
double cross_entropy_flops(int64_t tokens, int64_t C, int64_t vocab);

}  // namespace remat::ops
