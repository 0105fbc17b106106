#include "remat/ops/swiglu.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<SwiGLUSaved> swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  const trace::Scope trace_scope("swiglu", trace::Category::forward);
  TORCH_CHECK(gate.sizes() == up.sizes(), "[swiglu] gate and up must have the same shape, got ",
              gate.sizes(), " and ", up.sizes());
  return {at::silu(gate).mul_(up), SwiGLUSaved{gate, up}};
}

SwiGLUGrads swiglu_backward(const at::Tensor& dy, const SwiGLUSaved& saved) {
  const trace::Scope trace_scope("swiglu", trace::Category::backward);
  TORCH_CHECK(dy.sizes() == saved.gate.sizes(), "[swiglu] gradient must match the gate shape ",
              saved.gate.sizes(), ", got ", dy.sizes());
  // silu(gate) is rebuilt rather than kept; silu_backward applies silu' to dy * up.
  at::Tensor dgate = at::silu_backward(at::mul(dy, saved.up), saved.gate);
  at::Tensor dup = at::silu(saved.gate).mul_(dy);
  return {dgate, dup};
}

int64_t swiglu_saved_bytes(int64_t numel, at::ScalarType dtype) { return 2 * nbytes(numel, dtype); }

double swiglu_flops(int64_t numel) { return 6.0 * numel; }

}  // namespace remat::ops
