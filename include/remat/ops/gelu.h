// GELU with the tanh approximation (GPT-2's "gelu_new").
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

struct GeluSaved {
  at::Tensor x;  ///< input, any shape
  std::vector<at::Tensor> tensors() const { return {x}; }
};

/// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Fwd<GeluSaved> gelu_forward(const at::Tensor& x);
at::Tensor gelu_backward(const at::Tensor& dy, const GeluSaved& saved);
int64_t gelu_saved_bytes(int64_t numel, at::ScalarType dtype);
/// Forward FLOPs (about 10 per element).
double gelu_flops(int64_t numel);

}  // namespace remat::ops
