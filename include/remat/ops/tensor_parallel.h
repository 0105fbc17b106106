// The two collectives of Megatron's tensor parallelism, each the other's backward (its
// paper's f and g). A column-parallel region (the linears whose output features are split
// over the ranks) starts with tp_copy: identity forward, and in the backward the sum over
// the ranks of their input-gradient parts. A row-parallel region (the linears whose input
// features are split) ends with tp_reduce: the sum over the ranks of their partial
// outputs, plus the bias once, and an identity backward.
#pragma once

#include "remat/dist.h"
#include "remat/ops/common.h"

#include <string>

namespace remat::ops {

struct TpSaved {
  std::vector<at::Tensor> tensors() const { return {}; }
};

/// Sums `t` over `group` in place (contiguous). Gloo reduces no bfloat16, so a narrower
/// tensor is reduced in a float32 copy and written back.
void all_reduce_in_place(at::Tensor& t, dist::Group& group, const std::string& what);

/// y = x itself.
Fwd<TpSaved> tp_copy_forward(const at::Tensor& x);
/// dx = the sum of dy over the ranks, reduced in dy's own memory (returned).
at::Tensor tp_copy_backward(at::Tensor dy, const TpSaved& saved, dist::Group& group, const std::string& what);

/// y = the sum of x over the ranks (+ bias), computed in x's own memory (returned): x is
/// a partial product no one else reads. `bias` may be undefined.
Fwd<TpSaved> tp_reduce_forward(at::Tensor x, const at::Tensor& bias, dist::Group& group, const std::string& what);
/// dx = dy; the bias gradient (when `db` is given and defined) accumulates dy's row sum.
at::Tensor tp_reduce_backward(const at::Tensor& dy, const TpSaved& saved, at::Tensor* db);

}  // namespace remat::ops
