// Rotary position embedding in the Llama (Hugging Face "rotate_half") layout: within each
// head, element i pairs with element i + D/2 and the pair is rotated by pos * theta^(-2i/D).
#pragma once

#include "remat/config.h"
#include "remat/ops/common.h"

namespace remat::ops {

/// Rotation tables for positions 0..T-1, each [T, D/2], in `dtype` on `device`, with the
/// frequencies of base `theta` scaled as `scaling` says. Computed in float64 then cast, so
/// they are the same wherever they are built.
struct RopeTables {
  at::Tensor cos;
  at::Tensor sin;
};
RopeTables rope_tables(int64_t seq_len, int64_t head_dim, double theta, const RopeScaling& scaling,
                       at::ScalarType dtype, at::Device device);
/// Bytes of the tables rope_tables() builds.
int64_t rope_tables_bytes(int64_t seq_len, int64_t head_dim, at::ScalarType dtype);

/// A rotation needs nothing from forward: backward rotates by the opposite angle.
struct RopeSaved {
  std::vector<at::Tensor> tensors() const { return {}; }
};

/// x [B, T, H, D] (D even) rotated per position; tables must cover T.
Fwd<RopeSaved> rope_forward(const at::Tensor& x, const RopeTables& tables);
at::Tensor rope_backward(const at::Tensor& dy, const RopeSaved& saved, const RopeTables& tables);
/// Forward FLOPs (3 per element).
double rope_flops(int64_t numel);

}  // namespace remat::ops
