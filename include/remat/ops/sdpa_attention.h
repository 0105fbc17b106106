// Causal grouped-query attention through ATen's fused CPU kernel (the FlashAttention-2
// algorithm: at::_scaled_dot_product_flash_attention_for_cpu and its backward, LibTorch 2.9
// and later): out = softmax(q k^T / sqrt(D) + causal mask) v, as attention.h computes it
// without dropout. Like tiled_attention.h it keeps q, k, v, the output and one log-sum-exp
// per row, and no [T x T] tensor exists; the kernel reads q, k and v where they lie (strided
// views of a fused projection too) and takes grouped-query heads without repeating K and V.
// It draws no dropout, so attention dropout is refused (remat::attention_refusal).
#pragma once

#include "remat/ops/attention.h"
#include "remat/ops/common.h"
#include "remat/ops/tiled_attention.h"

namespace remat::ops {

struct SdpaAttentionSaved {
  at::Tensor q;    ///< [B, T, Hq, D], as given (may be a strided view)
  at::Tensor k;    ///< [B, T, Hkv, D], as given
  at::Tensor v;    ///< [B, T, Hkv, D], as given
  at::Tensor out;  ///< the forward's output, [B, T, Hq, D], contiguous
  at::Tensor lse;  ///< per-row log-sum-exp of the scaled, masked scores, [B, T, Hq], float32 (float64 for float64)
  std::vector<at::Tensor> tensors() const { return {q, k, v, out, lse}; }
};

/// Output [B, T, Hq, D], contiguous; scale 1/sqrt(D); query head h reads key/value head
/// h / (Hq / Hkv). The kernel accumulates in float32 (float64 for float64 inputs). Refuses
/// inputs off the CPU, and any input where this build's LibTorch lacks the kernel.
Fwd<SdpaAttentionSaved> sdpa_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

/// dq, dk, dv in the inputs' dtype, contiguous; dk and dv summed over each key/value head's
/// query heads. The kernel recomputes each block's probabilities from q, k and the
/// log-sum-exp. `dout` [B, T, Hq, D] is read as given (a strided one is copied first).
AttentionGrads sdpa_attention_backward(const at::Tensor& dout, const SdpaAttentionSaved& saved);

/// The query and key positions per block the kernel runs at sequence length `seq`, as
/// ATen chooses them: 32, 64 or 256 queries (from 192 and 768 positions on), 512 keys,
/// neither more than `seq`. Its blocks above the diagonal are skipped, so its FLOPs are
/// tiled_attention_flops(shape, 0, sdpa_attention_blocks(seq)).
AttentionTiles sdpa_attention_blocks(int64_t seq);

}  // namespace remat::ops
