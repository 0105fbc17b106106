// Measured memory: the bytes tensors actually hold, current and peak.
//
// On CPU a tracking allocator wraps the c10 CPU allocator, so every tensor allocation
// is counted (the engine's and LibTorch's alike). On CUDA the caching allocator's own
// statistics are read (allocated and reserved bytes, current and peak).
//
// The CPU allocator also keeps the recompute pool: memory of tensors a recompute
// allocated is recycled for the next recompute instead of going back to the system (as
// nanotron's recycled buffers and llm.c's scratch buffers do). On CUDA the caching
// allocator already recycles, so the pool is CPU-only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace c10 {
class DebugInfoGuard;
}  // namespace c10

namespace remat::memory {

struct AllocationTraceEntry;  // remat/caching_allocator.h

struct Stats {
  int64_t current = 0;   ///< bytes held now: live tensors and, on CPU, idle pooled buffers
  int64_t peak = 0;      ///< highest `current` since the last reset_peak()
  int64_t reserved = 0;  ///< CUDA: bytes the caching allocator holds (0 on CPU)
  int64_t reserved_peak = 0;
  int64_t pool_idle = 0;  ///< CPU: bytes idle in the recompute pool (part of `current`)
};

/// Installs the tracking CPU allocator (idempotent; process-wide). Tensors allocated
/// before it is installed are not counted, so call it first thing in main() or a test.
void install_cpu_tracking();
/// Whether install_cpu_tracking() has run.
bool cpu_tracking_installed();

/// Records every allocation and free the constructing thread makes on devices of one type
/// while it lives, each with the allocator's allocated and reserved bytes after it (as
/// LibTorch reports them to its profiler): on CUDA, a trace the model of the caching
/// allocator must reproduce (remat/caching_allocator.h). A request appears with its
/// block's size; frees of blocks allocated before the recorder are left out. Another
/// recorder or LibTorch's profiler must not run on the thread meanwhile.
class AllocationRecorder {
 public:
  explicit AllocationRecorder(at::DeviceType type);
  ~AllocationRecorder();
  AllocationRecorder(const AllocationRecorder&) = delete;
  AllocationRecorder& operator=(const AllocationRecorder&) = delete;
  /// The events recorded so far.
  std::vector<AllocationTraceEntry> entries() const;

 private:
  struct Reporter;
  std::shared_ptr<Reporter> reporter_;
  std::unique_ptr<c10::DebugInfoGuard> guard_;
};

/// CUDA: makes the caching allocator grow one segment per stream (PyTorch's
/// expandable_segments) or round each new segment up, as run.expandable_segments says,
/// by adding the setting to PYTORCH_CUDA_ALLOC_CONF (its other settings stay as the user
/// gave them). Takes effect only before the process's first CUDA allocation.
void configure_cuda_allocator(bool expandable_segments);

/// Current and peak bytes on `device`'s type (CPU: the tracking allocator; CUDA: the
/// caching allocator of that device).
Stats stats(at::Device device);
/// Starts a new peak window: peak := current.
void reset_peak(at::Device device);
/// CUDA: returns the caching allocator's unused segments, so that what the next run
/// reserves is its own (a process's reserved peak otherwise keeps an earlier run's
/// segments). The CPU's tracking allocator caches nothing.
void release_cached(at::Device device);

/// Allocations made inside RecomputeScopes, counted by the scope's owner.
struct PoolCounts {
  int64_t hits = 0;          ///< allocations served from an idle pooled buffer of that exact size
  int64_t misses = 0;        ///< allocations that took new memory from the system (it joins the pool)
  int64_t bytes_served = 0;  ///< bytes of the hits
};

/// While alive, the CPU allocations of this thread are recompute allocations: each is
/// served from an idle pooled buffer of exactly its byte size when there is one, else from
/// the system, and its memory goes back to the pool (idle) when the tensor is freed,
/// whenever and on whichever thread that happens, until release_pool(). Idle buffers stay
/// counted in Stats::current. They are kept only within the peak measured so far: an
/// allocation that takes new memory first returns idle buffers to the system until the
/// current bytes fit under max(peak, live bytes), so the pool never raises the measured
/// peak above what the same program reaches without it. Needs install_cpu_tracking();
/// without it allocations bypass the pool. Scopes nest (the innermost one counts).
class RecomputeScope {
 public:
  explicit RecomputeScope(PoolCounts& counts);
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  PoolCounts* outer_;
};

/// While alive, the CPU allocations of the thread that made it are charged to it, until
/// freed on whichever thread: the live bytes and their peak of one in-process rank (a
/// pipeline stage on a thread) among others sharing the tracking allocator. Pooled bytes
/// count while in use, not while idle. Needs install_cpu_tracking(). Accounts nest (the
/// innermost one is charged); one is destroyed on the thread that made it.
class Account {
 public:
  Account();
  ~Account();
  Account(const Account&) = delete;
  Account& operator=(const Account&) = delete;
  /// Bytes of the allocations charged to it that are still live, and their highest sum.
  int64_t current() const;
  int64_t peak() const;
  /// Starts a new peak window: peak := current.
  void reset_peak();

 private:
  friend struct AccountBook;
  int64_t current_ = 0;  // guarded by the allocator's lock
  int64_t peak_ = 0;
  Account* outer_;
};

/// Host memory for offloaded activations (LayerPlan::offloaded): one buffer of exactly the
/// bytes of each storage moved there (never rounded up), outside the tracking allocator,
/// kept idle when its tensors die for a later move of the same size (the next microbatch's
/// or step's), and freed with the pool. A buffer that holds a CUDA tensor's memory is
/// page-locked (cudaHostRegister on its own exact bytes), so that its copies go by DMA at
/// the link's rate rather than through the driver's staging buffers; where the system
/// refuses to lock it, it stays pageable.
///
/// Copies run beside the compute, in the order they were started: on CUDA on a copy
/// stream of their own, after what the current stream had queued when they started; on
/// the CPU on a copy thread. A copy's result may be read only after await(its ticket); the
/// pool holds each copy's source and result until then, so the caller may drop either.
class HostPool {
 public:
  HostPool();
  /// Started copies: one tensor per tensor given, and the ticket to await.
  struct Moved {
    std::vector<at::Tensor> tensors;
    uint64_t ticket = 0;
  };
  /// Starts copying `ts` into host memory, one buffer per distinct storage among them, and
  /// returns the copies, each at its tensor's offset, sizes and strides (views stay views).
  Moved to_host(const std::vector<at::Tensor>& ts);
  /// Starts copying host tensors (of to_host) into new memory on `device` the same way;
  /// the memory is allocated now, by the calling thread.
  Moved to_device(const std::vector<at::Tensor>& ts, at::Device device);
  /// Orders what the caller does next after the copy `ticket` and every copy started
  /// before it: the CPU waits for the copy thread; on CUDA the current stream waits for
  /// the copy stream (the host does not).
  void await(uint64_t ticket);

  struct Counts {
    int64_t in_use = 0;       ///< bytes of buffers some tensor holds now
    int64_t peak_in_use = 0;  ///< the highest in_use
    int64_t reserved = 0;     ///< bytes of every buffer the pool holds, idle or not
    int64_t moved = 0;        ///< bytes copied to host so far
    int64_t pinned = 0;       ///< of reserved: page-locked for copies from and to a CUDA device
  };
  Counts counts() const;

 private:
  struct State;
  struct Copier;
  std::shared_ptr<State> state_;
  std::shared_ptr<Copier> copier_;
};

/// Returns every idle pooled buffer to the system. Pooled buffers still in use leave the
/// pool: they go to the system when freed. Process-wide.
void release_pool();

/// "1.50 GiB"-style rendering of a byte count (binary units).
std::string format_bytes(int64_t bytes);

}  // namespace remat::memory
