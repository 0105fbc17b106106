#include "remat/memory.h"

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include <torch/version.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

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

// Charges and credits accounts; every call holds g_mutex.
struct AccountBook {
  static void charge(Account* a, int64_t bytes) {
    if (a == nullptr) return;
    a->current_ += bytes;
    a->peak_ = std::max(a->peak_, a->current_);
  }
  static void credit(Account* a, int64_t bytes) {
    if (a != nullptr) a->current_ -= bytes;
  }
};

namespace {

std::atomic<int64_t> g_current{0};  // live plus idle pooled bytes
std::atomic<int64_t> g_peak{0};

void raise_peak(int64_t now) {
  int64_t seen = g_peak.load(std::memory_order_relaxed);
  while (now > seen && !g_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

// Live allocations by data pointer: their size, the wrapped allocator's deleter and, for
// recompute allocations, the pool generation they return to. The DataPtr handed out must
// have context == data, because LibTorch's raw_allocate (used by oneDNN, e.g. for bfloat16
// matmuls) requires it; so the bookkeeping lives here instead.
struct Allocation {
  int64_t bytes;
  c10::DeleterFnPtr inner_deleter;
  uint64_t pool_generation;  // 0: not pooled
  Account* account;          // charged with it, or null
};
struct IdleBuffer {
  void* data;
  c10::DeleterFnPtr inner_deleter;
};

// Everything below is guarded by g_mutex; g_current and g_peak are also written under it
// so that the pool's cap sees a consistent picture.
std::mutex g_mutex;
std::unordered_map<void*, Allocation>& live() {
  static auto* m = new std::unordered_map<void*, Allocation>();  // leaked: see install
  return *m;
}
// Idle pooled buffers by exact byte size; ordered so eviction can pick the best fit.
std::map<int64_t, std::vector<IdleBuffer>>& idle() {
  static auto* m = new std::map<int64_t, std::vector<IdleBuffer>>();  // leaked: see install
  return *m;
}
std::atomic<int64_t> g_idle_bytes{0};
// release_pool() starts a new generation, so buffers in use then go to the system when freed.
uint64_t g_generation = 1;

thread_local PoolCounts* t_scope = nullptr;  // non-null inside a RecomputeScope
thread_local Account* t_account = nullptr;   // non-null while an Account of this thread lives

IdleBuffer take_idle(std::map<int64_t, std::vector<IdleBuffer>>::iterator it) {
  IdleBuffer b = it->second.back();
  g_idle_bytes -= it->first;
  it->second.pop_back();
  if (it->second.empty()) idle().erase(it);
  return b;
}

// Called with `bytes` of new memory about to be counted: returns idle buffers to the
// system until current + bytes fits under the peak that the live bytes alone would reach.
// With the pool empty at reset_peak(), the measured peak is then exactly what it would be
// without the pool. Each step takes the smallest buffer covering what is still over, else
// the largest, to keep as much as possible for the next recompute.
void make_room(int64_t bytes) {
  const int64_t live_after = g_current - g_idle_bytes + bytes;
  const int64_t limit = std::max<int64_t>(g_peak, live_after);
  while (g_idle_bytes > 0 && g_current + bytes > limit) {
    auto it = idle().lower_bound(g_current + bytes - limit);
    if (it == idle().end()) it = std::prev(idle().end());
    const int64_t n = it->first;
    IdleBuffer b = take_idle(it);
    g_current -= n;
    b.inner_deleter(b.data);
  }
}

void release(void* data) {
  if (data == nullptr) return;  // zero-byte raw allocations (oneDNN scratch) hand out nullptr
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = live().find(data);
    TORCH_INTERNAL_ASSERT(it != live().end(), "tracking allocator: freeing an unknown pointer");
    a = it->second;
    live().erase(it);
    AccountBook::credit(a.account, a.bytes);
    if (a.pool_generation == g_generation) {
      idle()[a.bytes].push_back(IdleBuffer{data, a.inner_deleter});
      g_idle_bytes += a.bytes;
      return;
    }
    g_current -= a.bytes;
  }
  a.inner_deleter(data);
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) REMAT_ALLOCATE_CONST override {
    const auto bytes = static_cast<int64_t>(n);
    PoolCounts* scope = t_scope;
    if (scope != nullptr && n > 0) {
      std::lock_guard<std::mutex> lock(g_mutex);
      auto it = idle().find(bytes);
      if (it != idle().end()) {
        const IdleBuffer b = take_idle(it);
        live()[b.data] = Allocation{bytes, b.inner_deleter, g_generation, t_account};
        AccountBook::charge(t_account, bytes);
        ++scope->hits;
        scope->bytes_served += bytes;
        return {b.data, b.data, &release, c10::Device(c10::DeviceType::CPU)};
      }
    }
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    if (data == nullptr) return p;  // empty tensors hold no bytes
    TORCH_INTERNAL_ASSERT(p.get_context() == data,
                          "tracking allocator: the wrapped CPU allocator must use its data pointer as context");
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (g_idle_bytes > 0) make_room(bytes);
      live()[data] = Allocation{bytes, p.get_deleter(), scope != nullptr ? g_generation : 0, t_account};
      AccountBook::charge(t_account, bytes);
      if (scope != nullptr) ++scope->misses;
      raise_peak(g_current += bytes);
    }
    p.release_context();  // ownership passes to `live`; release() frees it
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

void configure_cuda_allocator(bool expandable_segments) {
  const char* given = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  std::string conf = given != nullptr ? given : "";
  // The allocator reads the settings left to right; the last one of a key holds.
  conf += fmt::format("{}expandable_segments:{}", conf.empty() ? "" : ",", expandable_segments ? "True" : "False");
  setenv("PYTORCH_CUDA_ALLOC_CONF", conf.c_str(), 1);
}

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
  s.pool_idle = g_idle_bytes.load();
  return s;
}

void reset_peak(at::Device device) {
  if (device.is_cuda()) {
#ifdef REMAT_WITH_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : c10::cuda::current_device());
#endif
    return;
  }
  g_peak.store(g_current.load());
}

void release_cached(at::Device device) {
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

RecomputeScope::RecomputeScope(PoolCounts& counts) : outer_(t_scope) { t_scope = &counts; }

RecomputeScope::~RecomputeScope() { t_scope = outer_; }

Account::Account() : outer_(t_account) { t_account = this; }

Account::~Account() {
  t_account = outer_;
  // Allocations that outlive it are charged to nobody from now on.
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& [data, a] : live()) {
    if (a.account == this) a.account = nullptr;
  }
}

int64_t Account::current() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  return current_;
}

int64_t Account::peak() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  return peak_;
}

void Account::reset_peak() {
  std::lock_guard<std::mutex> lock(g_mutex);
  peak_ = current_;
}

void release_pool() {
  std::vector<IdleBuffer> freed;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    ++g_generation;
    for (auto& [bytes, buffers] : idle()) freed.insert(freed.end(), buffers.begin(), buffers.end());
    idle().clear();
    g_current -= g_idle_bytes;
    g_idle_bytes = 0;
  }
  for (const IdleBuffer& b : freed) b.inner_deleter(b.data);
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
