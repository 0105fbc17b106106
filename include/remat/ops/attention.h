// Causal multi-head attention with grouped-query heads, math path:
//   scores = q k^T * scale (causal mask), probs = softmax(scores), probs_d = dropout(probs),
//   out = probs_d v.
// Query head h reads key/value head h / (Hq / Hkv). The products run by blocks of query
// positions, each against the keys up to its last position only: the blocks above the
// diagonal, all zeros after the mask, are never computed.
#pragma once

#include "remat/attention.h"
#include "remat/ops/common.h"
#include "remat/ops/dropout.h"

#include <string>

namespace remat::ops {

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};

/// The sizes of the attention ops' inputs q [B, T, Hq, D] and k, v [B, T, Hkv, D].
struct AttentionDims {
  int64_t B, T, Hq, Hkv, D, G;  ///< G = query heads per key/value head
  int64_t BK() const { return B * Hkv; }
};
/// The sizes of q, k and v after checking them as every attention op takes them (4-D, k
/// and v alike, B, T and D shared, Hq a multiple of Hkv, one dtype); `op` heads the error.
AttentionDims attention_dims(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

/// Why attention op `a` cannot run a model whose attention dropout is `dropout`, in `dtype`
/// with heads of `head_dim`, on CUDA or not, in this build, as a sentence a user can act on;
/// empty where it can. The ops refuse their inputs with it, validate_plan (remat/policy.h)
/// a config, and `auto` skips such ops.
std::string attention_refusal(Attention a, double dropout, bool cuda, at::ScalarType dtype, int64_t head_dim);

/// Positions per block of the products (queries in the forward and dq, keys in dk and dv).
/// At 64, head dimension 64 and 256 positions, the blocked forward took 0.70x the unblocked
/// products' time on 2 cores; 32 positions per block were slower again.
constexpr int64_t kAttentionBlock = 64;

struct AttentionSaved {
  at::Tensor q;        ///< [B, T, Hq, D]
  at::Tensor k;        ///< [B, T, Hkv, D]
  at::Tensor v;        ///< [B, T, Hkv, D]
  at::Tensor probs;    ///< softmax output, [B, Hkv, T, G, T] (G = Hq / Hkv: a group's rows by position, then head)
  at::Tensor mask;     ///< dropout keep-mask, [B, Hq, T, T] bool; undefined when p == 0
  at::Tensor probs_d;  ///< dropout output (input of probs . v), as probs; undefined when p == 0
  double p = 0.0;      ///< attention dropout probability
  std::vector<at::Tensor> tensors() const { return {q, k, v, probs, mask, probs_d}; }
};

/// Output [B, T, Hq, D], contiguous. q, k, v may be strided views (slices of a fused qkv
/// projection); they are saved as given, not copied. Scale 1/sqrt(D). When p > 0 the
/// keep-mask is dropout_mask({B, Hq, T, T}, p, key, q.device()), so it can be regenerated.
/// K and V are never repeated per query head; the scores are freed before returning.
/// `block`: positions per block (tests vary it; the results differ only in rounding).
Fwd<AttentionSaved> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double p,
                                      const DropoutKey& key, int64_t block = kAttentionBlock);

struct AttentionGrads {
  at::Tensor dq;  ///< [B, T, Hq, D]
  at::Tensor dk;  ///< [B, T, Hkv, D]
  at::Tensor dv;  ///< [B, T, Hkv, D]
};
/// dk and dv are summed over each key/value head's group of query heads; all contiguous.
AttentionGrads attention_backward(const at::Tensor& dout, const AttentionSaved& saved, int64_t block = kAttentionBlock);

/// Bytes AttentionSaved holds for `shape` (q, k, v, probs; mask and probs_d when p > 0).
int64_t attention_saved_bytes(const AttentionShape& shape, double p, at::ScalarType dtype);
/// (query, key) pairs the forward's blocks compute: B Hq times, per query block, its
/// positions times the keys up to its end (T (T + 1) / 2 at one position per block).
double attention_causal_scores(const AttentionShape& shape, int64_t block = kAttentionBlock);
/// Forward FLOPs over those pairs: the two products (4 D per pair) plus softmax and dropout.
double attention_flops(const AttentionShape& shape, double p, int64_t block = kAttentionBlock);
/// FLOPs of attention over `scores` (query, key) pairs of heads of `head_dim`: both
/// products, the softmax and the dropout (what the math and tiled ops share).
double attention_flops_over(double scores, int64_t head_dim, double p);

}  // namespace remat::ops
