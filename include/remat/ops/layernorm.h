// LayerNorm over the last dimension, with affine weight and bias.
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

struct LayerNormSaved {
  at::Tensor x;     ///< input, [..., C]
  at::Tensor mean;  ///< per-row mean, [...] in stats_dtype(x)
  at::Tensor rstd;  ///< per-row 1/sqrt(var + eps), [...] in stats_dtype(x)
  std::vector<at::Tensor> tensors() const { return {x, mean, rstd}; }
};

/// y = (x - mean) * rstd * w + b, statistics over the last dim (biased variance). Output in
/// x's dtype; on CPU, half/bfloat16 x is normalised in float32 (the native CPU kernel would
/// keep its statistics in x's dtype).
Fwd<LayerNormSaved> layernorm_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps);
/// Returns dx; accumulates (or writes, `into`) dw[C] and db[C].
at::Tensor layernorm_backward(const at::Tensor& dy, const LayerNormSaved& saved, const at::Tensor& w, at::Tensor& dw,
                              at::Tensor& db, GradInto into = GradInto::add);
/// Bytes LayerNormSaved holds for `rows` rows of `C` features of `dtype`.
int64_t layernorm_saved_bytes(int64_t rows, int64_t C, at::ScalarType dtype);
/// Forward FLOPs (about 8 per element).
double layernorm_flops(int64_t rows, int64_t C);

}  // namespace remat::ops
