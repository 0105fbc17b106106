// The two collectives of Megatron's tensor parallelism, each the other's backward (its
// paper's f and g). A column-parallel region (the linears whose output features are split
// over the ranks) starts with tp_copy: identity forward, and in the backward the sum over
// the ranks of their input-gradient parts. A row-parallel region (the linears whose input
// features are split) ends with tp_reduce: the sum over the ranks of their partial
// outputs, plus the bias once, and an identity backward.
//
// With sequence parallelism (Korthikanti et al.'s g and g-bar) the values between the
// regions hold a rank's share of the sequence positions (dimension 1, rank r the r-th
// equal part): sp_gather enters a region (all-gather forward, reduce-scatter backward) and
// sp_scatter ends one (reduce-scatter forward, all-gather backward). Gloo has no
// reduce-scatter: it is an all-reduce in the partial's own memory, then the rank's part
// copied out, moving t times the bytes of a real one.
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
/// dx = dy; the bias gradient (when `db` is given and defined) accumulates (or is written,
/// `into`) dy's row sum.
at::Tensor tp_reduce_backward(const at::Tensor& dy, const TpSaved& saved, at::Tensor* db,
                              GradInto into = GradInto::add);

/// Every rank's `x` [B, n, ...] along dimension 1, in rank order: [B, n * ranks, ...], a
/// new tensor. Gathered as bytes, so any dtype travels exactly.
at::Tensor gather_positions(const at::Tensor& x, dist::Group& group, const std::string& what);
/// This rank's positions of the sum over the ranks of `x` [B, n * ranks, ...], a new
/// tensor; `x` (which no one else reads) holds the sum afterwards.
at::Tensor reduce_scatter_positions(at::Tensor x, dist::Group& group, const std::string& what);

/// This rank's share of a tensor every rank of `group` holds whole: the r-th of `size`
/// equal runs of its elements in memory order, a copy (Megatron's
/// distribute_saved_activations keeps a recomputed layer's input so).
at::Tensor share_of_elements(const at::Tensor& x, dist::Group& group);
/// The whole tensor of `sizes` from every rank's share_of_elements, a new tensor (bytes
/// gathered, as gather_positions).
at::Tensor gather_elements(const at::Tensor& share, at::IntArrayRef sizes, dist::Group& group, const std::string& what);

/// y = gather_positions(x).
Fwd<TpSaved> sp_gather_forward(const at::Tensor& x, dist::Group& group, const std::string& what);
/// dx = reduce_scatter_positions(dy).
at::Tensor sp_gather_backward(at::Tensor dy, const TpSaved& saved, dist::Group& group, const std::string& what);
/// y = reduce_scatter_positions(x) (+ bias). `bias` may be undefined.
Fwd<TpSaved> sp_scatter_forward(at::Tensor x, const at::Tensor& bias, dist::Group& group, const std::string& what);
/// dx = gather_positions(dy); the bias gradient (when `db` is given and defined)
/// accumulates (or is written, `into`) dy's row sum: this rank's positions' part of it
/// (Param::partial).
at::Tensor sp_scatter_backward(const at::Tensor& dy, const TpSaved& saved, at::Tensor* db, dist::Group& group,
                               const std::string& what, GradInto into = GradInto::add);

}  // namespace remat::ops
