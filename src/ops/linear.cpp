#include "remat/ops/linear.h"

#include "ops/op_def.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<LinearSaved> linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const trace::Scope trace_scope("linear", trace::Category::forward);
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1),
              "[linear] input features must match weight [out, in], got x ", x.sizes(), " and w ", w.sizes());
  at::Tensor y = b.defined() ? at::linear(x, w, b) : at::matmul(x, w.t());
  return {y, LinearSaved{x}};
}

namespace {

// dw += dy^T x (dw = dy^T x when writing) for dy [rows, out] and x [rows, in] in one GEMM,
// straight into the accumulator when dtypes agree.
void accumulate_weight_grad(at::Tensor& dw, const at::Tensor& dy2, const at::Tensor& x2, GradInto into) {
  if (dw.scalar_type() != dy2.scalar_type()) {
    accumulate(dw, at::mm(dy2.t(), x2), into);
  } else if (into == GradInto::write) {
    at::mm_out(dw, dy2.t(), x2);
  } else {
    dw.addmm_(dy2.t(), x2);
  }
}

}  // namespace

at::Tensor linear_backward(const at::Tensor& dy, const LinearSaved& saved, const at::Tensor& w, at::Tensor& dw,
                           at::Tensor* db, GradInto into) {
  const trace::Scope trace_scope("linear", trace::Category::backward);
  const int64_t in = w.size(1), out = w.size(0);
  at::Tensor dy2 = dy.reshape({-1, out});
  accumulate_weight_grad(dw, dy2, saved.x.reshape({-1, in}), into);
  if (db != nullptr && db->defined()) accumulate(*db, dy2.sum(0), into);
  return at::matmul(dy, w);
}

std::vector<at::Tensor> linears_forward(const at::Tensor& x, const std::vector<at::Tensor>& ws) {
  const trace::Scope trace_scope("linears", trace::Category::forward);
  const int64_t in = x.size(-1);
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == in, "[linears] input features must match every weight [out, in], got x ",
                x.sizes(), " and w ", w.sizes());
  }
  // One copy into rows (none when x is contiguous) serves every GEMM.
  const at::Tensor x2 = x.reshape({-1, in});
  std::vector<at::Tensor> ys;
  for (const auto& w : ws) {
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    ys.push_back(at::mm(x2, w.t()).view(sizes));
  }
  return ys;
}

at::Tensor linears_backward(const std::vector<at::Tensor>& dys, const LinearSaved& saved,
                            const std::vector<at::Tensor>& ws, const std::vector<at::Tensor*>& dws, GradInto into) {
  const trace::Scope trace_scope("linears", trace::Category::backward);
  TORCH_CHECK(!ws.empty() && dys.size() == ws.size() && dws.size() == ws.size(),
              "[linears] needs one output gradient and one gradient accumulator per weight");
  const int64_t in = saved.x.size(-1);
  const at::Tensor x2 = saved.x.reshape({-1, in});
  std::vector<at::Tensor> dy2;
  for (size_t i = 0; i < ws.size(); ++i) {
    dy2.push_back(dys[i].reshape({-1, ws[i].size(0)}));
    accumulate_weight_grad(*dws[i], dy2[i], x2, into);
  }
  // One [rows, in] result: the first product written, every other added by its GEMM.
  at::Tensor dx = at::mm(dy2[0], ws[0]);
  for (size_t i = 1; i < ws.size(); ++i) dx.addmm_(dy2[i], ws[i]);
  return dx.view(saved.x.sizes());
}

int64_t linear_saved_bytes(int64_t rows, int64_t in, at::ScalarType dtype) { return nbytes(rows * in, dtype); }

double linear_flops(int64_t rows, int64_t in, int64_t out, bool bias) {
  return 2.0 * rows * in * out + (bias ? 1.0 * rows * out : 0.0);
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::bytes_of;
using detail::flags;
using detail::rows;

// The copy of a strided x into contiguous rows for the GEMMs (-1: x already is rows).
int64_t row_copy(Events& e, const TensorInfo& x) {
  return x.reshape_is_view({rows(x), x.sizes.back()}) ? -1 : e.temp(x.bytes());
}

// A weight gradient of `numel` elements from an x of `dtype`: straight into the float32
// accumulator where the dtypes agree; a narrower one is computed, cast and added.
void weight_grad_events(Events& e, at::ScalarType dtype, int64_t numel) {
  const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  if (acc == dtype) return;
  const int64_t mm = e.temp(bytes_of(numel, dtype)), cast = e.temp(bytes_of(numel, acc));
  e.release(cast);
  e.release(mm);
}

// Inputs {x}, parameters {weight} or {weight, bias}; outputs {y}.
class LinearDef final : public OpDef {
 public:
  const char* kind() const override { return "linear"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == 1 && !in[0].sizes.empty() && (p.size() == 1 || p.size() == 2) && p[0].sizes.size() == 2 &&
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
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext& ctx) const override {
    return {
        ops::linear_backward(dy[0], ops::LinearSaved{in[0]}, p[0], *g[0], g.size() == 2 ? g[1] : nullptr, ctx.grads)};
  }
  // A strided x is copied into contiguous rows for the GEMM.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    const int64_t copy = row_copy(e, in[0]);
    e.out(0);
    if (copy >= 0) e.release(copy);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>& out, const Attrs&) const override {
    const int64_t copy = row_copy(e, in[0]);
    weight_grad_events(e, in[0].dtype, p[0].numel());
    if (p.size() == 2) detail::bias_grad_events(e, out[0], p[1]);
    e.out(0);
    if (copy >= 0) e.release(copy);
  }
};

// Inputs {x}, parameters {w_1, ..., w_k} (no biases); outputs {y_1, ..., y_k}.
class LinearsDef final : public OpDef {
 public:
  const char* kind() const override { return "linears"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  bool outputs_named_by_params() const override { return true; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == 1 && !in[0].sizes.empty() && !p.empty(),
                "[linears] needs x [..., in] and at least one weight");
    std::vector<TensorInfo> out;
    for (const auto& w : p) {
      TORCH_CHECK(w.sizes.size() == 2 && w.sizes[1] == in[0].sizes.back(),
                  "[linears] needs x [..., in] and weights [out, in]");
      std::vector<int64_t> s(in[0].sizes.begin(), in[0].sizes.end() - 1);
      s.push_back(w.sizes[0]);
      out.push_back(in[0].with_sizes(s));
    }
    return out;
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p, const Attrs&) const override {
    double total = 0;
    for (const auto& w : p) total += ops::linear_flops(rows(in[0]), w.sizes[1], w.sizes[0], false);
    return total;
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0}); }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs&,
                                  const RunContext&) const override {
    return ops::linears_forward(in[0], p);
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>& p,
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext& ctx) const override {
    return {ops::linears_backward(dy, ops::LinearSaved{in[0]}, p, g, ctx.grads)};
  }
  // A strided x is copied into contiguous rows once, for every GEMM.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>& out, const Attrs&) const override {
    const int64_t copy = row_copy(e, in[0]);
    for (size_t i = 0; i < out.size(); ++i) e.out(static_cast<int64_t>(i));
    if (copy >= 0) e.release(copy);
  }
  // Each weight's gradient as linear's; then the one input gradient.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    const int64_t copy = row_copy(e, in[0]);
    for (const auto& w : p) weight_grad_events(e, in[0].dtype, w.numel());
    e.out(0);
    if (copy >= 0) e.release(copy);
  }
};

}  // namespace

const OpDef& op::linear() {
  static const LinearDef def;
  return def;
}

const OpDef& op::linears() {
  static const LinearsDef def;
  return def;
}

}  // namespace remat::graph
