#include "remat/ops/rmsnorm.h"

#include "ops/op_def.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<RMSNormSaved> rmsnorm_forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  const trace::Scope trace_scope("rmsnorm", trace::Category::forward);
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1),
              "[rmsnorm] weight must be [C] for input [..., C], got x ", x.sizes(), " and w ", w.sizes());
  const int64_t C = x.size(-1);
  const at::ScalarType sd = stats_dtype(x.scalar_type());
  // The 2-norm reduction squares and sums in `sd` without an x-sized temporary.
  at::Tensor rstd = at::linalg_vector_norm(x, 2, {-1}, false, sd);
  rstd.square_().div_(C).add_(eps).rsqrt_();
  // As Llama does: normalise in `sd`, round to x's dtype, then scale by the weight.
  at::Tensor y = at::mul(x, rstd.unsqueeze(-1)).to(x.scalar_type()).mul_(w);
  return {y, RMSNormSaved{x, rstd}};
}

at::Tensor rmsnorm_backward(const at::Tensor& dy, const RMSNormSaved& saved, const at::Tensor& w, at::Tensor& dw,
                            GradInto into) {
  const trace::Scope trace_scope("rmsnorm", trace::Category::backward);
  const at::Tensor& x = saved.x;
  TORCH_CHECK(dy.sizes() == x.sizes(), "[rmsnorm] gradient must match the input shape ", x.sizes(), ", got ",
              dy.sizes());
  const int64_t C = x.size(-1);
  const at::ScalarType sd = saved.rstd.scalar_type();
  const at::Tensor r = saved.rstd.unsqueeze(-1);
  const at::Tensor dyf = dy.to(sd);
  at::Tensor xhat = at::mul(x.to(sd), r);
  accumulate(dw, at::mul(dyf, xhat).reshape({-1, C}).sum(0), into);
  // With g = dy * w: dx = rstd * (g - xhat * mean(g * xhat)).
  const at::Tensor g = at::mul(dyf, w.to(sd));
  const at::Tensor dot = at::mul(g, xhat).mean(-1, true);
  return xhat.mul_(dot).neg_().add_(g).mul_(r).to(x.scalar_type());
}

int64_t rmsnorm_saved_bytes(int64_t rows, int64_t C, at::ScalarType dtype) {
  return nbytes(rows * C, dtype) + nbytes(rows, stats_dtype(dtype));
}

double rmsnorm_flops(int64_t rows, int64_t C) { return 5.0 * rows * C; }

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::bytes_of;
using detail::flags;
using detail::rows;
using detail::stats_of;

// Inputs {x}, parameters {weight}; outputs {y, rstd}.
class RMSNormDef final : public OpDef {
 public:
  const char* kind() const override { return "rmsnorm"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::position_wise; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == 1 && p.size() == 1 && p[0].sizes == std::vector<int64_t>{in[0].sizes.back()},
                "[rmsnorm] needs x [..., C] and weight [C]");
    std::vector<int64_t> r(in[0].sizes.begin(), in[0].sizes.end() - 1);
    return {in[0].with_sizes(in[0].sizes), TensorInfo{r, stats_of(in[0].dtype), {}}};
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    return ops::rmsnorm_flops(rows(in[0]), in[0].sizes.back());
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0}); }
  std::vector<bool> saves_outputs(const Attrs&, size_t n) const override { return flags(n, {1}); }
  const char* output_name(size_t i) const override { return i == 0 ? "out" : "rstd"; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs& a,
                                  const RunContext&) const override {
    auto r = ops::rmsnorm_forward(in[0], p[0], a.eps);
    return {r.out, r.saved.rstd};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& p,
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext& ctx) const override {
    return {ops::rmsnorm_backward(dy[0], ops::RMSNormSaved{in[0], out[1]}, p[0], *g[0], ctx.grads)};
  }
  // CPU: a product of a narrower x with the float32 statistics first casts x to float32
  // (TensorIterator promotes inputs by copies), then the result is cast back. CUDA kernels
  // cast as they read (TensorIteratorBase::compute_types copies for the CPU only): the
  // float32 product alone.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    const at::ScalarType sd = stats_of(in[0].dtype);
    e.out(1);
    if (sd == in[0].dtype) {
      e.out(0);
      return;
    }
    const int64_t n = in[0].numel();
    const int64_t x = e.device() == at::kCUDA ? -1 : e.temp(bytes_of(n, sd));
    const int64_t y = e.temp(bytes_of(n, sd));
    if (x >= 0) e.release(x);
    e.out(0);
    e.release(y);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    const at::ScalarType sd = stats_of(in[0].dtype);
    const int64_t n = in[0].numel(), C = in[0].sizes.back(), N = rows(in[0]);
    const bool cast = sd != in[0].dtype;
    const int64_t dyf = cast ? e.temp(bytes_of(n, sd)) : -1;
    int64_t xf = cast ? e.temp(bytes_of(n, sd)) : -1;
    // x-hat: the result itself in float32; a temporary turned into the result otherwise.
    int64_t xhat = -1;
    if (cast) {
      xhat = e.temp(bytes_of(n, sd));
      e.release(xf);
    } else {
      e.out(0);
    }
    int64_t prod = e.temp(bytes_of(n, sd)), sum = e.temp(bytes_of(C, sd));
    detail::cuda_column_sum_events(e, N, C, sd);  // the weight gradient's sum over the rows
    e.release(prod);
    e.release(sum);
    const int64_t wf = cast ? e.temp(bytes_of(C, sd)) : -1;
    const int64_t g = e.temp(bytes_of(n, sd));
    if (wf >= 0) e.release(wf);
    prod = e.temp(bytes_of(n, sd));
    const int64_t dot = e.temp(bytes_of(N, sd));
    if (e.device() != at::kCUDA) detail::scalar_operand(e, sd);  // the CPU mean's divisor
    e.release(prod);
    if (cast) {
      e.out(0);
      e.release(xhat);
    }
    e.release(dot);
    e.release(g);
    if (dyf >= 0) e.release(dyf);
  }
};

}  // namespace

const OpDef& op::rmsnorm() {
  static const RMSNormDef def;
  return def;
}

}  // namespace remat::graph
