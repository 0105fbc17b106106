#include "remat/ops/linear.h"

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
