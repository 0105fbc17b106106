// What a checkpoint remembers of a tensor to check its recompute against: metadata, and
// optionally a hash of its bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace remat::detail {

struct TensorRecord {
  bool defined = false;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  uint64_t hash = 0;  // FNV-1a of the bytes in row-major order; 0 when not hashed

  static TensorRecord of(const at::Tensor& t, bool with_hash);

  bool same_meta(const TensorRecord& other) const;
  bool same_shape(const TensorRecord& other) const;
  /// "Float [2, 3] on cpu"
  std::string describe() const;
};

/// FNV-1a over the tensor's elements' bytes in row-major order (copied to the CPU first
/// when needed): equal for bitwise-equal tensors whatever their strides.
uint64_t hash_bytes(const at::Tensor& t);

}  // namespace remat::detail
