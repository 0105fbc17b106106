// Residual add: y = a + b. Its backward needs nothing from forward.
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

struct ResidualSaved {
  std::vector<at::Tensor> tensors() const { return {}; }
};

/// `b` has a's shape or broadcasts to it (position embeddings [T, C] onto [B, T, C]).
Fwd<ResidualSaved> residual_forward(const at::Tensor& a, const at::Tensor& b);
/// Both inputs receive dy unchanged; returned once, for the caller to route (a broadcast b
/// sums it over the broadcast dims, as position_embedding_backward does).
at::Tensor residual_backward(const at::Tensor& dy, const ResidualSaved& saved);
double residual_flops(int64_t numel);

}  // namespace remat::ops
