// Linear layer: y = x w^T + b.
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

struct LinearSaved {
  at::Tensor x;  ///< the input, [..., in]
  std::vector<at::Tensor> tensors() const { return {x}; }
};

/// y[..., out] = x[..., in] . w[out, in]^T + b[out]. `b` may be undefined (no bias).
Fwd<LinearSaved> linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

/// Returns dx[..., in]; accumulates (or writes, `into`) dw[out, in] and, when defined, db[out].
at::Tensor linear_backward(const at::Tensor& dy, const LinearSaved& saved, const at::Tensor& w, at::Tensor& dw,
                           at::Tensor* db, GradInto into = GradInto::add);

/// One input through several weights, w_i [out_i, in], without biases (Llama's q/k/v and
/// gate/up projections): y_i = x . w_i^T, one GEMM each. They share one LinearSaved.
std::vector<at::Tensor> linears_forward(const at::Tensor& x, const std::vector<at::Tensor>& ws);

/// Returns dx = sum_i dy_i . w_i, each product after the first added by its GEMM into the
/// one result (no [rows, in] tensor per weight, no separate additions); accumulates (or
/// writes, `into`) each dw_i. The sum runs in the weights' order.
at::Tensor linears_backward(const std::vector<at::Tensor>& dys, const LinearSaved& saved,
                            const std::vector<at::Tensor>& ws, const std::vector<at::Tensor*>& dws,
                            GradInto into = GradInto::add);

/// Bytes LinearSaved holds for `rows` input rows of `in` features.
int64_t linear_saved_bytes(int64_t rows, int64_t in, at::ScalarType dtype);
/// Forward FLOPs: 2 * rows * in * out (+ rows * out with bias).
double linear_flops(int64_t rows, int64_t in, int64_t out, bool bias);

}  // namespace remat::ops
