#include "remat/memory.h"

#include "remat/caching_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>

#include <mutex>
#include <unordered_map>

namespace remat::memory {

// LibTorch 2 reports the totals as size_t, 1.13 as int64_t.
#if TORCH_VERSION_MAJOR >= 2
using ReportedTotal = size_t;
#else
using ReportedTotal = int64_t;
#endif

// LibTorch's profiler hook: every allocator reports each allocation (a positive size)
// and free (negative) with its totals after it, to the thread's reporter.
struct AllocationRecorder::Reporter : c10::MemoryReportingInfoBase {
  explicit Reporter(at::DeviceType t) : type(t) {}

  void reportMemoryUsage(void* ptr, int64_t alloc_size, ReportedTotal total_allocated, ReportedTotal total_reserved,
                         c10::Device device) override {
    if (device.type() != type || alloc_size == 0) return;
    const std::lock_guard<std::mutex> lock(mutex);
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    AllocationTraceEntry e;
    e.state = {static_cast<int64_t>(total_allocated), static_cast<int64_t>(total_reserved)};
    if (alloc_size > 0) {
      e.event = {AllocatorEvent::Kind::malloc, next_id, alloc_size, 0};
      ids[address] = next_id++;
    } else {
      const auto it = ids.find(address);
      if (it == ids.end()) return;  // allocated before the recording began
      e.event = {AllocatorEvent::Kind::free, it->second, 0, 0};
      ids.erase(it);
    }
    entries.push_back(e);
  }
  bool memoryProfilingEnabled() const override { return true; }

  const at::DeviceType type;
  mutable std::mutex mutex;
  std::unordered_map<uintptr_t, int64_t> ids;  // live blocks by address
  int64_t next_id = 0;
  std::vector<AllocationTraceEntry> entries;
};

AllocationRecorder::AllocationRecorder(at::DeviceType type)
    : reporter_(std::make_shared<Reporter>(type)),
      guard_(std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, reporter_)) {}

AllocationRecorder::~AllocationRecorder() = default;

std::vector<AllocationTraceEntry> AllocationRecorder::entries() const {
  const std::lock_guard<std::mutex> lock(reporter_->mutex);
  return reporter_->entries;
}

}  // namespace remat::memory
