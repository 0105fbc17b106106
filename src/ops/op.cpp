#include "remat/ops/op.h"

#include "remat/dist.h"

#include <ATen/TensorUtils.h>

namespace remat::graph {

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

int64_t TensorInfo::bytes() const { return numel() * static_cast<int64_t>(c10::elementSize(dtype)); }

bool TensorInfo::reshape_is_view(const std::vector<int64_t>& to) const {
  if (contiguous()) return true;
  return at::detail::computeStride(at::IntArrayRef(sizes), at::IntArrayRef(strides), at::IntArrayRef(to)).has_value();
}

int RunContext::tp_rank() const { return tp != nullptr ? tp->rank() : 0; }
int RunContext::tp_size() const { return tp != nullptr ? tp->size() : 1; }

ops::DropoutKey RunContext::key(ops::DropoutSite site) const {
  return {seed, step, microbatch, static_cast<uint64_t>(layer), site, first_row};
}

LinkTraffic LinkTraffic::gather(int64_t whole, int64_t ranks) {
  if (ranks <= 1) return {};
  return {static_cast<double>(whole) * static_cast<double>(ranks - 1) / static_cast<double>(ranks), ranks - 1};
}

LinkTraffic LinkTraffic::all_reduce(int64_t whole, int64_t ranks) {
  const LinkTraffic half = gather(whole, ranks);
  return {2 * half.bytes, 2 * half.messages};
}

}  // namespace remat::graph
