#include "checkpoint/tensor_record.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace remat::detail {

uint64_t hash_bytes(const at::Tensor& t) {
  const at::Tensor flat = t.to(at::kCPU).contiguous();
  const auto* p = static_cast<const unsigned char*>(flat.data_ptr());
  uint64_t h = 14695981039346656037ULL;
  for (size_t i = 0; i < flat.nbytes(); ++i) {
    h = (h ^ p[i]) * 1099511628211ULL;
  }
  return h;
}

TensorRecord TensorRecord::of(const at::Tensor& t, bool with_hash) {
  TensorRecord r;
  if (!t.defined()) {
    return r;
  }
  r.defined = true;
  r.sizes = t.sizes().vec();
  r.dtype = t.scalar_type();
  r.device = t.device();
  if (with_hash && t.layout() == at::kStrided) {
    r.hash = hash_bytes(t);
  }
  return r;
}

bool TensorRecord::same_shape(const TensorRecord& o) const { return defined == o.defined && sizes == o.sizes; }

bool TensorRecord::same_meta(const TensorRecord& o) const {
  return same_shape(o) && dtype == o.dtype && device == o.device;
}

std::string TensorRecord::describe() const {
  if (!defined) {
    return "an undefined tensor";
  }
  return fmt::format("{} [{}] on {}", c10::toString(dtype), fmt::join(sizes, ", "), device.str());
}

}  // namespace remat::detail
