// RMSNorm over the last dimension (Llama), with affine weight.
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

struct RMSNormSaved {
  at::Tensor x;     ///< input, [..., C]
  at::Tensor rstd;  ///< per-row 1/sqrt(mean(x^2) + eps), [...] in stats_dtype(x)
  std::vector<at::Tensor> tensors() const { return {x, rstd}; }
};

/// y = x * rstd * w.
Fwd<RMSNormSaved> rmsnorm_forward(const at::Tensor& x, const at::Tensor& w, double eps);
/// Returns dx; accumulates (or writes, `into`) dw[C].
at::Tensor rmsnorm_backward(const at::Tensor& dy, const RMSNormSaved& saved, const at::Tensor& w, at::Tensor& dw,
                            GradInto into = GradInto::add);
int64_t rmsnorm_saved_bytes(int64_t rows, int64_t C, at::ScalarType dtype);
/// Forward FLOPs (about 5 per element).
double rmsnorm_flops(int64_t rows, int64_t C);

}  // namespace remat::ops
