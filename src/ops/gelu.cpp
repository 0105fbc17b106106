#include "remat/ops/gelu.h"

#include "ops/op_def.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<GeluSaved> gelu_forward(const at::Tensor& x) {
  const trace::Scope trace_scope("gelu", trace::Category::forward);
  return {at::gelu(x, "tanh"), GeluSaved{x}};
}

at::Tensor gelu_backward(const at::Tensor& dy, const GeluSaved& saved) {
  const trace::Scope trace_scope("gelu", trace::Category::backward);
  TORCH_CHECK(dy.sizes() == saved.x.sizes(), "[gelu] gradient must match the input shape ", saved.x.sizes(), ", got ",
              dy.sizes());
  return at::gelu_backward(dy, saved.x, "tanh");
}

int64_t gelu_saved_bytes(int64_t numel, at::ScalarType dtype) { return nbytes(numel, dtype); }

double gelu_flops(int64_t numel) { return 10.0 * numel; }

}  // namespace remat::ops

namespace remat::graph {
namespace {

// Inputs {x}; outputs {gelu(x)}; the backward reads x.
class GeluDef final : public detail::Elementwise {
 public:
  GeluDef() : Elementwise("gelu", 1) {}
  TensorParallel tensor_parallel() const override { return TensorParallel::share_wise; }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    return ops::gelu_flops(in[0].numel());
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return detail::flags(n, {0}); }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs&,
                                  const RunContext&) const override {
    return {ops::gelu_forward(in[0]).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext&) const override {
    return {ops::gelu_backward(dy[0], ops::GeluSaved{in[0]})};
  }
};

}  // namespace

const OpDef& op::gelu() {
  static const GeluDef def;
  return def;
}

}  // namespace remat::graph
