// Causal grouped-query attention computed over tiles, never holding a [T x T] tensor
// (the FlashAttention-2 algorithm, on the CPU with ATen):
//   out = dropout(softmax(q k^T / sqrt(D) + causal mask)) v, as attention.h computes it.
// The forward walks tiles of queries and, inside, tiles of keys up to the diagonal (tiles
// entirely above it are skipped), keeping a running row maximum and sum (online softmax);
// it saves q, k, v, the output and one log-sum-exp per row. The backward recomputes each
// tile's probabilities from q, k and the log-sum-exp. The working set is a few tiles.
#pragma once

#include "remat/ops/attention.h"
#include "remat/ops/common.h"
#include "remat/ops/dropout.h"

namespace remat::ops {

/// Query and key positions per tile. A tile's working set is (Hq/Hkv) q x k scores per
/// batch row and key/value head. The defaults were measured (docs/attention.md).
struct AttentionTiles {
  int64_t q = 64;
  int64_t k = 64;
};

struct TiledAttentionSaved {
  at::Tensor q;    ///< [B, T, Hq, D], as given (may be a strided view)
  at::Tensor k;    ///< [B, T, Hkv, D], as given
  at::Tensor v;    ///< [B, T, Hkv, D], as given
  at::Tensor out;  ///< the forward's output, [B, T, Hq, D]
  at::Tensor lse;  ///< per-row log-sum-exp of the scaled, masked scores, [B, Hq, T], float32 (float64 for float64)
  double p = 0.0;  ///< attention dropout probability
  DropoutKey key;  ///< the dropout key: the backward redraws each tile's mask from it
  AttentionTiles tiles;
  std::vector<at::Tensor> tensors() const { return {q, k, v, out, lse}; }
};

/// Output [B, T, Hq, D], contiguous; scale 1/sqrt(D); query head h reads key/value head
/// h / (Hq / Hkv). With p > 0 the probability of query i and key j in head h of batch row
/// b is dropped iff dropout_mask({B, Hq, T, T}, p, key) drops that element (drawn per tile
/// with DropoutDraw, CPU only), so the math op (attention.h) drops the same elements. The
/// arithmetic runs in float32 (float64 for float64 inputs) whatever the input dtype.
/// Refuses tiles below 1 and p > 0 off the CPU.
Fwd<TiledAttentionSaved> tiled_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 double p, const DropoutKey& key, AttentionTiles tiles = {});

/// dq, dk, dv in the inputs' dtype, contiguous; dk and dv summed over each key/value
/// head's query heads. Recomputes each tile's probabilities (and dropout mask) from the
/// saved q, k, lse and key: no [T x T] tensor is made.
AttentionGrads tiled_attention_backward(const at::Tensor& dout, const TiledAttentionSaved& saved);

/// Bytes TiledAttentionSaved holds for `shape`: q, k, v, the output and the log-sum-exp.
int64_t tiled_attention_saved_bytes(const AttentionShape& shape, at::ScalarType dtype);
/// Forward FLOPs of the scores the tiles compute (tiles above the diagonal skipped): the
/// two matmuls (4 D per score), the softmax (5 per score) and dropout (1 per score, p > 0).
double tiled_attention_flops(const AttentionShape& shape, double p, AttentionTiles tiles);

}  // namespace remat::ops
