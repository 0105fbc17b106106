// Causal grouped-query attention through ATen's fused kernels, the FlashAttention-2
// algorithm (LibTorch 2.9 and later): at::_scaled_dot_product_flash_attention_for_cpu and
// its backward on the CPU, at::_scaled_dot_product_flash_attention and its backward on
// CUDA in bfloat16 or float16: out = softmax(q k^T / sqrt(D) + causal mask) v, as
// attention.h computes it without dropout. Like tiled_attention.h it keeps q, k, v, the
// output and one log-sum-exp per row, and no [T x T] tensor exists; the kernels read q, k
// and v where they lie (strided views of a fused projection too) and take grouped-query
// heads without repeating K and V. They draw no dropout, so attention dropout is refused
// (ops::attention_refusal).
#pragma once

#include "remat/ops/attention.h"
#include "remat/ops/common.h"
#include "remat/ops/tiled_attention.h"

#include <torch/version.h>

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
/// float32 and heads of other than a multiple of 8 values on CUDA (the flash kernel's), and
/// any input where this build's LibTorch lacks the kernel.
Fwd<SdpaAttentionSaved> sdpa_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

/// dq, dk, dv in the inputs' dtype, contiguous; dk and dv summed over each key/value head's
/// query heads. The kernel recomputes each block's probabilities from q, k and the
/// log-sum-exp. `dout` [B, T, Hq, D] is read as given (a strided one is copied first).
AttentionGrads sdpa_attention_backward(const at::Tensor& dout, const SdpaAttentionSaved& saved);

/// Whether ATen's CUDA flash forward keeps its random state on the device even without
/// dropout (two small tensors it returns) rather than on the CPU: from LibTorch 2.10 by
/// ATen's source, as measured on 2.11.
constexpr bool kFlashStateOnDevice = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10);

/// How many parts ATen's CUDA flash forward splits each row's keys into (its split-KV
/// heuristic without dropout): one where the B x Hq x (query blocks of 64) tiles nearly fill
/// the device's waves (twice its multiprocessors from LibTorch 2.10, once before), else the
/// fewest parts whose wave efficiency is within 85% of the best. Each part above one costs
/// float32 partial outputs and log-sum-exps until the kernel returns.
int64_t flash_key_splits(int64_t B, int64_t T, int64_t Hq, int64_t D, int64_t multiprocessors = cuda_multiprocessors());

/// The query and key positions per block the kernel runs at sequence length `seq`, as
/// ATen chooses them: 32, 64 or 256 queries (from 192 and 768 positions on), 512 keys,
/// neither more than `seq`. Its blocks above the diagonal are skipped, so its FLOPs are
/// tiled_attention_flops(shape, 0, sdpa_attention_blocks(seq)).
AttentionTiles sdpa_attention_blocks(int64_t seq);

}  // namespace remat::ops
