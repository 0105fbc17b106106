// Causal multi-head attention with grouped-query heads, math path:
//   scores = q k^T * scale (causal mask), probs = softmax(scores), probs_d = dropout(probs),
//   out = probs_d v.
// Query head h reads key/value head h / (Hq / Hkv).
#pragma once

#include "remat/ops/common.h"
#include "remat/ops/dropout.h"

namespace remat::ops {

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};

struct AttentionSaved {
  at::Tensor q;        ///< [B, T, Hq, D]
  at::Tensor k;        ///< [B, T, Hkv, D]
  at::Tensor v;        ///< [B, T, Hkv, D]
  at::Tensor probs;    ///< softmax output, [B, Hq, T, T]
  at::Tensor mask;     ///< dropout keep-mask, [B, Hq, T, T] bool; undefined when p == 0
  at::Tensor probs_d;  ///< dropout output (input of probs . v), [B, Hq, T, T]; undefined when p == 0
  double p = 0.0;      ///< attention dropout probability
  std::vector<at::Tensor> tensors() const { return {q, k, v, probs, mask, probs_d}; }
};

/// Output [B, T, Hq, D], contiguous. q, k, v may be strided views (slices of a fused qkv
/// projection); they are saved as given, not copied. Scale 1/sqrt(D). When p > 0 the
/// keep-mask is dropout_mask({B, Hq, T, T}, p, key, q.device()), so it can be regenerated.
/// K and V are never repeated per query head; the scores are freed before returning.
Fwd<AttentionSaved> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      double p, const DropoutKey& key);

struct AttentionGrads {
  at::Tensor dq;  ///< [B, T, Hq, D]
  at::Tensor dk;  ///< [B, T, Hkv, D]
  at::Tensor dv;  ///< [B, T, Hkv, D]
};
/// dk and dv are summed over each key/value head's group of query heads; all contiguous.
AttentionGrads attention_backward(const at::Tensor& dout, const AttentionSaved& saved);

/// Bytes AttentionSaved holds for `shape` (q, k, v, probs; mask and probs_d when p > 0).
int64_t attention_saved_bytes(const AttentionShape& shape, double p, at::ScalarType dtype);
/// Forward FLOPs: the two batched matmuls (4 B Hq T^2 D) plus softmax and dropout.
double attention_flops(const AttentionShape& shape, double p);
/// FLOPs of attention over `scores` (query, key) pairs of heads of `head_dim`: both
/// products, the softmax and the dropout (what the math and tiled ops share).
double attention_flops_over(double scores, int64_t head_dim, double p);

}  // namespace remat::ops
