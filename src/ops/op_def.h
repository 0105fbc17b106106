// Helpers shared by the op definitions (the graph's view of each op, remat/graph.h).
#pragma once

#include "remat/graph.h"

namespace remat::graph::detail {

/// n flags, true at the listed positions.
inline std::vector<bool> flags(size_t n, std::initializer_list<size_t> on) {
  std::vector<bool> f(n, false);
  for (size_t i : on) {
    if (i < n) f[i] = true;
  }
  return f;
}

/// Bytes of `numel` elements of `dtype`.
inline int64_t bytes_of(int64_t numel, at::ScalarType dtype) {
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

/// Rows of a [..., C] tensor.
inline int64_t rows(const TensorInfo& t) { return t.numel() / t.sizes.back(); }

/// A double scalar tensor multiplied into a tensor of `dtype`: 8 bytes and their cast copy
/// (TensorIterator casts a 0-dim CPU operand like any other input).
inline void scalar_operand(Events& e, at::ScalarType dtype) {
  const int64_t s = e.temp(8), c = e.temp(bytes_of(1, dtype));
  e.release(c);
  e.release(s);
}

/// The dtype norms and losses compute statistics in (float32, float64 for float64).
inline at::ScalarType stats_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace remat::graph::detail
