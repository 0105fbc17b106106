#include "remat/ops/gelu.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<GeluSaved> gelu_forward(const at::Tensor& x) {
  const trace::Scope trace_scope("gelu", trace::Category::forward);
  return {at::gelu(x, "tanh"), GeluSaved{x}};
}

at::Tensor gelu_backward(const at::Tensor& dy, const GeluSaved& saved) {
  const trace::Scope trace_scope("gelu", trace::Category::backward);
  TORCH_CHECK(dy.sizes() == saved.x.sizes(), "[gelu] gradient must match the input shape ",
              saved.x.sizes(), ", got ", dy.sizes());
  return at::gelu_backward(dy, saved.x, "tanh");
}

int64_t gelu_saved_bytes(int64_t numel, at::ScalarType dtype) { return nbytes(numel, dtype); }

double gelu_flops(int64_t numel) { return 10.0 * numel; }

}  // namespace remat::ops
