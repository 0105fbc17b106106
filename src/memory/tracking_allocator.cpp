#include "remat/memory.h"

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include <torch/version.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>

#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
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

// Live allocations by data pointer: their size and the wrapped allocator's deleter. The
// DataPtr handed out must have context == data, because LibTorch's raw_allocate (used by
// oneDNN, e.g. for bfloat16 matmuls) requires it; so the bookkeeping lives here instead.
struct Allocation {
  int64_t bytes;
  c10::DeleterFnPtr inner_deleter;
};
std::mutex g_live_mutex;
std::unordered_map<void*, Allocation>& live() {
  static auto* m = new std::unordered_map<void*, Allocation>();  // leaked: see install
  return *m;
}

void release(void* data) {
  if (data == nullptr) return;  // zero-byte raw allocations (oneDNN scratch) hand out nullptr
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    auto it = live().find(data);
    TORCH_INTERNAL_ASSERT(it != live().end(), "tracking allocator: freeing an unknown pointer");
    a = it->second;
    live().erase(it);
  }
  g_current.fetch_sub(a.bytes, std::memory_order_relaxed);
  a.inner_deleter(data);
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) REMAT_ALLOCATE_CONST override {
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    if (data == nullptr) return p;  // empty tensors hold no bytes
    TORCH_INTERNAL_ASSERT(p.get_context() == data,
                          "tracking allocator: the wrapped CPU allocator must use its data pointer as context");
    const auto bytes = static_cast<int64_t>(n);
    {
      std::lock_guard<std::mutex> lock(g_live_mutex);
      live()[data] = Allocation{bytes, p.get_deleter()};
    }
    p.release_context();  // ownership passes to `live`; release() frees it
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
    auto d = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index()
                                                                                : c10::cuda::current_device());
    // AGGREGATE is the first StatType; the enum moved namespaces in LibTorch 2.5, its order did not.
    const size_t agg = 0;
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
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index()
                                                                       : c10::cuda::current_device());
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
