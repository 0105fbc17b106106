// Fused SwiGLU: y = silu(gate) * up. Saves only its two inputs; silu(gate) and the
// product are rebuilt in backward instead of being kept.
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

struct SwiGLUSaved {
  at::Tensor gate;  ///< [..., F]
  at::Tensor up;    ///< [..., F]
  std::vector<at::Tensor> tensors() const { return {gate, up}; }
};

Fwd<SwiGLUSaved> swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
struct SwiGLUGrads {
  at::Tensor dgate;  ///< [..., F]
  at::Tensor dup;    ///< [..., F]
};
SwiGLUGrads swiglu_backward(const at::Tensor& dy, const SwiGLUSaved& saved);
/// Bytes SwiGLUSaved holds: gate and up, `numel` elements each.
int64_t swiglu_saved_bytes(int64_t numel, at::ScalarType dtype);
/// Forward FLOPs (about 6 per output element).
double swiglu_flops(int64_t numel);

}  // namespace remat::ops
