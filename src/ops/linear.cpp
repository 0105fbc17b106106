#include "remat/ops/linear.h"

#include "ops/op_def.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<LinearSaved> linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const trace::Scope trace_scope("linear", trace::Category::forward);
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1),
              "[linear] input features must match weight [out, in], got x ", x.sizes(), " and w ",
              w.sizes());
  at::Tensor y = b.defined() ? at::linear(x, w, b) : at::matmul(x, w.t());
  return {y, LinearSaved{x}};
}

at::Tensor linear_backward(const at::Tensor& dy, const LinearSaved& saved, const at::Tensor& w,
                           at::Tensor& dw, at::Tensor* db) {
  const trace::Scope trace_scope("linear", trace::Category::backward);
  const int64_t in = w.size(1), out = w.size(0);
  at::Tensor dy2 = dy.reshape({-1, out});
  at::Tensor x2 = saved.x.reshape({-1, in});
  // dw += dy^T x in one GEMM, straight into the accumulator when dtypes agree.
  if (dw.scalar_type() == dy.scalar_type()) {
    dw.addmm_(dy2.t(), x2);
  } else {
    accumulate(dw, at::mm(dy2.t(), x2));
  }
  if (db != nullptr && db->defined()) accumulate(*db, dy2.sum(0));
  return at::matmul(dy, w);
}

int64_t linear_saved_bytes(int64_t rows, int64_t in, at::ScalarType dtype) {
  return nbytes(rows * in, dtype);
}

double linear_flops(int64_t rows, int64_t in, int64_t out, bool bias) {
  return 2.0 * rows * in * out + (bias ? 1.0 * rows * out : 0.0);
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::bytes_of;
using detail::flags;
using detail::rows;

// Inputs {x}, parameters {weight} or {weight, bias}; outputs {y}.
class LinearDef final : public OpDef {
 public:
  const char* kind() const override { return "linear"; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == 1 && (p.size() == 1 || p.size() == 2) && p[0].sizes.size() == 2 &&
                    p[0].sizes[1] == in[0].sizes.back(),
                "[linear] needs x [..., in] and weight [out, in]");
    auto s = in[0].sizes;
    s.back() = p[0].sizes[0];
    return {in[0].with_sizes(s)};
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p, const Attrs&) const override {
    return ops::linear_flops(rows(in[0]), p[0].sizes[1], p[0].sizes[0], p.size() == 2);
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0}); }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs&,
                                  const RunContext&) const override {
    return {ops::linear_forward(in[0], p[0], p.size() == 2 ? p[1] : at::Tensor()).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>& p,
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext&) const override {
    return {ops::linear_backward(dy[0], ops::LinearSaved{in[0]}, p[0], *g[0], g.size() == 2 ? g[1] : nullptr)};
  }
  // A strided x is copied into contiguous rows for the GEMM.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    const int64_t copy = in[0].reshape_is_view({rows(in[0]), in[0].sizes.back()}) ? -1 : e.temp(in[0].bytes());
    e.out(0);
    if (copy >= 0) e.release(copy);
  }
  // The weight gradient goes straight into a float32 accumulator of the same dtype; a
  // narrower one is computed, cast and added. The bias gradient is a row sum.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>& out, const Attrs&) const override {
    const int64_t copy = in[0].reshape_is_view({rows(in[0]), in[0].sizes.back()}) ? -1 : e.temp(in[0].bytes());
    const at::ScalarType acc = in[0].dtype == at::kDouble ? at::kDouble : at::kFloat;
    const int64_t W = p[0].numel();
    if (acc != in[0].dtype) {
      const int64_t mm = e.temp(bytes_of(W, in[0].dtype)), cast = e.temp(bytes_of(W, acc));
      e.release(cast);
      e.release(mm);
    }
    if (p.size() == 2) {
      const int64_t sum = e.temp(bytes_of(p[1].numel(), in[0].dtype));
      const int64_t cast = acc != in[0].dtype ? e.temp(bytes_of(p[1].numel(), acc)) : -1;
      if (cast >= 0) e.release(cast);
      e.release(sum);
    }
    e.out(0);
    if (copy >= 0) e.release(copy);
  }
};

}  // namespace

const OpDef& op::linear() {
  static const LinearDef def;
  return def;
}

}  // namespace remat::graph
