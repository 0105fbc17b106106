// Shared vocabulary of the explicit ops.
//
// Every op is one forward/backward pair and one Saved struct:
//   Fwd<XSaved> x_forward(inputs..., params...)      -> outputs + what backward needs
//   x_backward(grad_out, const XSaved&, params..., param grads to accumulate into) -> input grads
// Parameter gradients are accumulated (+=) into caller-owned tensors of the parameter's
// shape, so microbatches accumulate without extra buffers; the step's first backward
// writes them instead (GradInto). Ops keep no hidden state.
// Each op also reports, from shapes alone and without allocating, the bytes its Saved
// holds and the FLOPs its forward costs; the planner sums these.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace remat::ops {

/// An op's forward result: its output and the tensors its backward needs.
template <class Saved>
struct Fwd {
  at::Tensor out;
  Saved saved;
};

/// Bytes of `numel` elements of `dtype`.
inline int64_t nbytes(int64_t numel, at::ScalarType dtype) {
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

/// Bytes the defined tensors of a Saved struct hold (numel x element size each).
inline int64_t tensors_bytes(const std::vector<at::Tensor>& ts) {
  int64_t total = 0;
  for (const auto& t : ts) {
    if (t.defined()) total += nbytes(t.numel(), t.scalar_type());
  }
  return total;
}

/// The dtype norms keep their statistics in: float32, or float64 for float64 inputs.
inline at::ScalarType stats_dtype(at::ScalarType x) { return x == at::kDouble ? at::kDouble : at::kFloat; }

/// How a backward puts a parameter's gradient into its accumulator: added to what the
/// earlier microbatches left there, or written over it by the step's first backward to
/// reach the parameter, so that no one zeroes the accumulator first.
enum class GradInto { add, write };

/// Adds (or writes) `g` into the gradient accumulator `acc` (same shape as the parameter).
inline void accumulate(at::Tensor& acc, const at::Tensor& g, GradInto into = GradInto::add) {
  TORCH_INTERNAL_ASSERT(acc.defined(), "gradient accumulator is undefined");
  // Writing casts as adding does, so one list of allocation events holds for both.
  const at::Tensor cast = g.to(acc.scalar_type());
  if (into == GradInto::write) {
    acc.copy_(cast);
  } else {
    acc.add_(cast);
  }
}

/// The multiprocessors of the CUDA device current when first asked (read once a process;
/// ATen's CUDA kernels size their grids by it); where this build or machine has none, those
/// of the GPU the CUDA figures were recorded on (docs/results.md), so that `remat plan
/// run.device=cuda` on a CPU machine prices that GPU.
int64_t cuda_multiprocessors();

}  // namespace remat::ops
