#include "remat/ops/swiglu.h"

#include "ops/op_def.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<SwiGLUSaved> swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  const trace::Scope trace_scope("swiglu", trace::Category::forward);
  TORCH_CHECK(gate.sizes() == up.sizes(), "[swiglu] gate and up must have the same shape, got ", gate.sizes(), " and ",
              up.sizes());
  return {at::silu(gate).mul_(up), SwiGLUSaved{gate, up}};
}

SwiGLUGrads swiglu_backward(const at::Tensor& dy, const SwiGLUSaved& saved) {
  const trace::Scope trace_scope("swiglu", trace::Category::backward);
  TORCH_CHECK(dy.sizes() == saved.gate.sizes(), "[swiglu] gradient must match the gate shape ", saved.gate.sizes(),
              ", got ", dy.sizes());
  // silu(gate) is rebuilt rather than kept; silu_backward applies silu' to dy * up.
  at::Tensor dgate = at::silu_backward(at::mul(dy, saved.up), saved.gate);
  at::Tensor dup = at::silu(saved.gate).mul_(dy);
  return {dgate, dup};
}

int64_t swiglu_saved_bytes(int64_t numel, at::ScalarType dtype) { return 2 * nbytes(numel, dtype); }

double swiglu_flops(int64_t numel) { return 6.0 * numel; }

}  // namespace remat::ops

namespace remat::graph {
namespace {

// Inputs {gate, up}; outputs {silu(gate) * up}; the backward reads both inputs only.
class SwiGLUDef final : public detail::Elementwise {
 public:
  SwiGLUDef() : Elementwise("swiglu", 2) {}
  TensorParallel tensor_parallel() const override { return TensorParallel::share_wise; }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    return ops::swiglu_flops(in[0].numel());
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return detail::flags(n, {0, 1}); }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs&,
                                  const RunContext&) const override {
    return {ops::swiglu_forward(in[0], in[1]).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext&) const override {
    auto g = ops::swiglu_backward(dy[0], ops::SwiGLUSaved{in[0], in[1]});
    return {g.dgate, g.dup};
  }
  // dgate from silu' of dy * up (a temporary); dup = silu(gate) * dy.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    const int64_t m = e.temp(in[0].with_sizes(in[0].sizes).bytes());
    e.out(0);
    e.release(m);
    e.out(1);
  }
};

}  // namespace

const OpDef& op::swiglu() {
  static const SwiGLUDef def;
  return def;
}

}  // namespace remat::graph
