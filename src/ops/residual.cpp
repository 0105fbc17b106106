#include "remat/ops/residual.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <ATen/ExpandUtils.h>

namespace remat::ops {

Fwd<ResidualSaved> residual_forward(const at::Tensor& a, const at::Tensor& b) {
  const trace::Scope trace_scope("residual", trace::Category::forward);
  TORCH_CHECK(at::is_expandable_to(b.sizes(), a.sizes()), "[residual] b must have a's shape or broadcast to it, got a ",
              a.sizes(), " and b ", b.sizes());
  return {at::add(a, b), ResidualSaved{}};
}

at::Tensor residual_backward(const at::Tensor& dy, const ResidualSaved&) { return dy; }

double residual_flops(int64_t numel) { return static_cast<double>(numel); }

}  // namespace remat::ops

namespace remat::graph {
namespace {

// Inputs {a, b}; outputs {a + b}. Both inputs receive the output gradient itself.
class ResidualDef final : public detail::Elementwise {
 public:
  ResidualDef() : Elementwise("residual", 2) {}
  TensorParallel tensor_parallel() const override { return TensorParallel::position_wise; }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    return ops::residual_flops(in[0].numel());
  }
  int grad_alias(size_t) const override { return 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs&,
                                  const RunContext&) const override {
    return {ops::residual_forward(in[0], in[1]).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext&) const override {
    const at::Tensor d = ops::residual_backward(dy[0], {});
    return {d, d};
  }
};

}  // namespace

const OpDef& op::residual() {
  static const ResidualDef def;
  return def;
}

}  // namespace remat::graph
