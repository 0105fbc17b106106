#include "remat/ops/rmsnorm.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<RMSNormSaved> rmsnorm_forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  const trace::Scope trace_scope("rmsnorm", trace::Category::forward);
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1),
              "[rmsnorm] weight must be [C] for input [..., C], got x ", x.sizes(), " and w ",
              w.sizes());
  const int64_t C = x.size(-1);
  const at::ScalarType sd = stats_dtype(x.scalar_type());
  // The 2-norm reduction squares and sums in `sd` without an x-sized temporary.
  at::Tensor rstd = at::linalg_vector_norm(x, 2, {-1}, false, sd);
  rstd.square_().div_(C).add_(eps).rsqrt_();
  // As Llama does: normalise in `sd`, round to x's dtype, then scale by the weight.
  at::Tensor y = at::mul(x, rstd.unsqueeze(-1)).to(x.scalar_type()).mul_(w);
  return {y, RMSNormSaved{x, rstd}};
}

at::Tensor rmsnorm_backward(const at::Tensor& dy, const RMSNormSaved& saved, const at::Tensor& w,
                            at::Tensor& dw) {
  const trace::Scope trace_scope("rmsnorm", trace::Category::backward);
  const at::Tensor& x = saved.x;
  TORCH_CHECK(dy.sizes() == x.sizes(), "[rmsnorm] gradient must match the input shape ", x.sizes(),
              ", got ", dy.sizes());
  const int64_t C = x.size(-1);
  const at::ScalarType sd = saved.rstd.scalar_type();
  const at::Tensor r = saved.rstd.unsqueeze(-1);
  const at::Tensor dyf = dy.to(sd);
  at::Tensor xhat = at::mul(x.to(sd), r);
  accumulate(dw, at::mul(dyf, xhat).reshape({-1, C}).sum(0));
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
