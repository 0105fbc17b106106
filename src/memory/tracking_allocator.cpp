#include "remat/memory.h"

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include <torch/version.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

// LibTorch 2.3 made Allocator::allocate non-const and added the pure virtual copy_data.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define REMAT_ALLOCATE_CONST
#define REMAT_COPY_DATA_OVERRIDE override
#else
#define REMAT_ALLOCATE_CONST const
#define REMAT_COPY_DATA_OVERRIDE
#endif

namespace remat::memory {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};

void raise_peak(int64_t now) {
  int64_t seen = g_peak.load(std::memory_order_relaxed);
  while (now > seen && !g_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

// What the wrapper's deleter needs: the wrapped allocation, to free it, and its size.
struct Allocation {
  c10::DataPtr inner;
  int64_t bytes;
};

// Live allocations by data pointer. The DataPtr's context must be the data pointer
// itself: Allocator::raw_allocate (used by oneDNN's scratch memory, e.g. in gelu) asserts
// it, and raw_deallocate hands the deleter only that pointer. Leaked on purpose, like
// the allocator: tensors freed during static destruction still look themselves up here.
std::mutex& live_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

std::unordered_map<void*, Allocation>& live() {
  static auto* map = new std::unordered_map<void*, Allocation>;
  return *map;
}

void release(void* data) {
  if (data == nullptr) {
    return;  // raw_deallocate(nullptr), as free(nullptr)
  }
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(live_mutex());
    auto it = live().find(data);
    TORCH_INTERNAL_ASSERT(it != live().end(), "freeing memory the tracking allocator never gave");
    a = std::move(it->second);
    live().erase(it);
  }
  g_current.fetch_sub(a.bytes, std::memory_order_relaxed);
  // `a.inner` frees the memory through its own deleter as it goes out of scope.
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) REMAT_ALLOCATE_CONST override {
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    if (data == nullptr) {
      return p;  // an empty allocation: nothing to count, nothing to look up later
    }
    const auto bytes = static_cast<int64_t>(n);
    {
      std::lock_guard<std::mutex> lock(live_mutex());
      live().emplace(data, Allocation{std::move(p), bytes});
    }
    raise_peak(g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const REMAT_COPY_DATA_OVERRIDE {
    std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
};

std::once_flag g_install_once;
std::atomic<bool> g_installed{false};

}  // namespace

void install_cpu_tracking() {
  std::call_once(g_install_once, [] {
    // Leaked on purpose: tensors freed during static destruction still call into it.
    static auto* tracker = new TrackingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(tracker, /*priority=*/100);
    g_installed = true;
  });
}

bool cpu_tracking_installed() { return g_installed; }

Stats stats(at::Device device) {
  Stats s;
  if (device.is_cuda()) {
#ifdef REMAT_WITH_CUDA
    auto d = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    const auto agg = static_cast<size_t>(c10::cuda::CUDACachingAllocator::StatType::AGGREGATE);
    s.current = d.allocated_bytes[agg].current;
    s.peak = d.allocated_bytes[agg].peak;
    s.reserved = d.reserved_bytes[agg].current;
    s.reserved_peak = d.reserved_bytes[agg].peak;
#else
    TORCH_CHECK(false, "this build of remat has no CUDA support");
#endif
    return s;
  }
  s.current = g_current.load();
  s.peak = g_peak.load();
  return s;
}

void reset_peak(at::Device device) {
  if (device.is_cuda()) {
#ifdef REMAT_WITH_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif
    return;
  }
  g_peak.store(g_current.load());
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::abs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", v, units[u]);
}

}  // namespace remat::memory
