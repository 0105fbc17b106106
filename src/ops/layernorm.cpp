#include "remat/ops/layernorm.h"

#include "remat/trace.h"

namespace remat::ops {
namespace {

// CPU kernels keep half/bfloat16 statistics in the input dtype, but the contract keeps them
// in float32, so reduced precision on CPU is normalised in float32. Elsewhere the native
// kernels already accumulate in float32 and return float32 statistics.
at::ScalarType compute_dtype(const at::Tensor& x) {
  return x.is_cpu() ? stats_dtype(x.scalar_type()) : x.scalar_type();
}

}  // namespace

Fwd<LayerNormSaved> layernorm_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                      double eps) {
  const trace::Scope trace_scope("layernorm", trace::Category::forward);
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && b.dim() == 1 && w.size(0) == x.size(-1) &&
                  b.size(0) == x.size(-1),
              "[layernorm] weight and bias must be [C] for input [..., C], got x ", x.sizes(), ", w ",
              w.sizes(), " and b ", b.sizes());
  const int64_t C = x.size(-1);
  const at::ScalarType ct = compute_dtype(x);
  auto [y, mean, rstd] = at::native_layer_norm(x.to(ct), {C}, w.to(ct), b.to(ct), eps);
  TORCH_INTERNAL_ASSERT(mean.scalar_type() == stats_dtype(x.scalar_type()),
                        "layer norm statistics came back in ", mean.scalar_type());
  // The kernel's statistics are [..., 1]; the Saved fields are documented as [...].
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  return {y.to(x.scalar_type()), LayerNormSaved{x, mean.view(rows), rstd.view(rows)}};
}

at::Tensor layernorm_backward(const at::Tensor& dy, const LayerNormSaved& saved, const at::Tensor& w,
                              at::Tensor& dw, at::Tensor& db) {
  const trace::Scope trace_scope("layernorm", trace::Category::backward);
  const at::Tensor& x = saved.x;
  TORCH_CHECK(dy.sizes() == x.sizes(), "[layernorm] gradient must match the input shape ", x.sizes(),
              ", got ", dy.sizes());
  const at::ScalarType ct = compute_dtype(x);
  const at::Tensor wc = w.to(ct);
  // The bias values play no part in the gradients; the kernel only needs a [C] tensor to
  // shape db, so the weight stands in for it.
  auto [dx, dw_rows, db_rows] =
      at::native_layer_norm_backward(dy.to(ct), x.to(ct), {x.size(-1)}, saved.mean.unsqueeze(-1),
                                     saved.rstd.unsqueeze(-1), wc, wc, {true, true, true});
  accumulate(dw, dw_rows);
  accumulate(db, db_rows);
  return dx.to(x.scalar_type());
}

int64_t layernorm_saved_bytes(int64_t rows, int64_t C, at::ScalarType dtype) {
  return nbytes(rows * C, dtype) + 2 * nbytes(rows, stats_dtype(dtype));
}

double layernorm_flops(int64_t rows, int64_t C) { return 8.0 * rows * C; }

}  // namespace remat::ops
