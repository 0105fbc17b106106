// Dropout whose mask is a pure function of a counter-based key.
//
// The key (seed, step, microbatch, layer, site) fully determines the mask, so a
// recomputed forward regenerates bitwise the mask of the first one, with no generator
// state to save or restore.
#pragma once

#include "remat/ops/common.h"

namespace remat::ops {

/// Where in the model a dropout sits; part of its key.
enum class DropoutSite : uint64_t { embedding = 0, attn_probs = 1, attn_resid = 2, mlp_resid = 3 };

/// Identifies one dropout application. `layer` is the 0-based block index (embedding: 0).
struct DropoutKey {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t microbatch = 0;
  uint64_t layer = 0;
  DropoutSite site = DropoutSite::embedding;
  /// The global batch row of the masked tensor's first row (dimension 0): a data-parallel
  /// rank holding rows [first_row, first_row + B) of a step's batch draws, on the CPU, the
  /// very elements the single-process run draws for those rows. Not part of hash().
  int64_t first_row = 0;
  /// A window along dimension 1, as first_row is one along dimension 0: the mask of
  /// dimension-1 size n1 holds indices [first_in_dim1, first_in_dim1 + n1) of a global
  /// dimension 1 of dim1_global indices (0: n1, no window). A tensor-parallel rank holding
  /// a share of the heads of a [B, H, T, T] mask draws, on the CPU, the very elements the
  /// single-process run draws for those heads. Not part of hash().
  int64_t first_in_dim1 = 0;
  int64_t dim1_global = 0;
  /// A 64-bit generator seed mixing every field (splitmix64 chain).
  uint64_t hash() const;
};

/// The CPU draw of dropout_mask, one element at a time. A mask of local sizes [n0, n1, ...]
/// is a window of a global one of sizes [.., N1, ...] (N1 = key.dim1_global, or n1 when 0):
/// its element (i0, i1, r), r the flat index over the sizes after dimension 1 (of product
/// R), is the global flat element g = ((i0 + key.first_row) N1 + i1 + key.first_in_dim1) R
/// + r, and keep(g) says whether dropout_mask(sizes, p, key, kCPU) keeps it. A mask of one
/// dimension is [n0] with n1 = R = 1; one of none has no rows (first_row is ignored).
/// Within a row i0 the local and the global indices differ by a constant, offset(i0), so
/// element i (flat, row-major index into `sizes`) of row i0 is keep(offset(i0) + i). An op
/// that never makes the whole mask (tiled attention) draws any window of it element by
/// element and drops exactly what the whole mask would.
class DropoutDraw {
 public:
  /// `sizes`: the mask's local sizes. Refuses p outside [0, 1), and a dimension-1 window on
  /// a mask of fewer than 2 dimensions, starting below 0 or ending past dim1_global.
  DropoutDraw(const DropoutKey& key, double p, at::IntArrayRef sizes);
  /// What a flat local index in row i0 (dimension 0) adds to become the global index g.
  int64_t offset(int64_t i0) const { return offset_ + i0 * row_gap_; }
  /// Whether global element `g` is kept: the top 53 bits of splitmix64(hash + (g + 1)
  /// golden) fall below (1 - p) 2^53.
  bool keep(int64_t g) const {
    return (mix64(base_ + static_cast<uint64_t>(g + 1) * 0x9e3779b97f4a7c15ULL) >> 11) < threshold_;
  }
  /// splitmix64's finaliser: a bijection on 64 bits with good avalanche (also mixes the key).
  static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

 private:
  uint64_t base_;
  uint64_t threshold_;
  int64_t offset_;   // offset(0): (first_row N1 + first_in_dim1) R
  int64_t row_gap_;  // global elements of a row beyond the local ones: (N1 - n1) R
};

/// Keep-mask (bool, true = kept) of `sizes` with keep probability 1 - p, on `device`.
/// Bitwise the same for the same key, sizes and device type, whatever the thread count. On the
/// CPU each element is a counter-based draw (DropoutDraw: splitmix64 of key.hash() and the
/// element's global flat index, placed by key.first_row and the dimension-1 window), filled
/// in parallel, so a shard's mask is bitwise its slice of the whole mask. On other devices, a
/// private generator seeded with key.hash(), key.first_row and key.first_in_dim1: each shard
/// draws a mask of its own, not a slice of the one-process mask (that equality is a CPU
/// guarantee).
/// The global generator is neither read nor advanced, and concurrent calls are safe. Refuses
/// p outside [0, 1) and the windows DropoutDraw refuses.
at::Tensor dropout_mask(at::IntArrayRef sizes, double p, const DropoutKey& key, at::Device device);

struct DropoutSaved {
  at::Tensor mask;  ///< keep-mask, same shape as x, bool; undefined when p == 0
  double p = 0.0;   ///< drop probability
  std::vector<at::Tensor> tensors() const { return {mask}; }
};

/// y = x * mask / (1 - p), mask = dropout_mask(x.sizes(), p, key, x.device()). p == 0 is
/// the identity (y is x itself) and saves nothing. Requires 0 <= p < 1.
Fwd<DropoutSaved> dropout_forward(const at::Tensor& x, double p, const DropoutKey& key);
/// y = x * mask / (1 - p) with a mask made by dropout_mask (of x's shape). p == 0 is the
/// identity (y is x itself; the mask is ignored and may be undefined).
Fwd<DropoutSaved> dropout_apply(const at::Tensor& x, const at::Tensor& mask, double p);
/// dx = dy * mask / (1 - p).
at::Tensor dropout_backward(const at::Tensor& dy, const DropoutSaved& saved);

/// Bytes DropoutSaved holds for `numel` elements (a 1-byte mask, none when p == 0).
int64_t dropout_saved_bytes(int64_t numel, double p);
/// Forward FLOPs: one multiply per element when p > 0.
double dropout_flops(int64_t numel, double p);

}  // namespace remat::ops
