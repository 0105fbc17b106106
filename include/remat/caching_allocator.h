// A deterministic model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp,
// DeviceCachingAllocator): it replays allocation requests and frees and reports the bytes
// the allocator counts as allocated and as reserved after each, and their peaks.
//
// On CUDA what runs out is reserved memory (the segments the allocator holds from the
// driver), not the allocated bytes: a plan's memory has to be judged by the former, which
// depends on sizes, order, streams and the allocator's rules, so the rules are replayed.
//
// The rules followed (PyTorch's defaults, confirmed against its source):
// - A request is rounded up to a multiple of 512 B (at least 512 B); a request of 0 bytes
//   takes no block (PyTorch hands out a null pointer). `allocated` counts blocks, which
//   are the rounded size or, where a large block is not split, the whole block.
// - Requests up to 1 MiB use the small pool, larger ones the large pool. A request no
//   free block fits gets a new segment: 2 MiB for the small pool, 20 MiB for requests
//   under 10 MiB, else the request rounded up to 2 MiB.
// - Free blocks are found best-fit per pool and stream (smallest that fits, ties to the
//   lower address); a block freed on one stream is never reused by another.
// - A block is split when the rest is at least 512 B in the small pool (or in either pool
//   under expandable segments), and more than 1 MiB in the large pool; otherwise the
//   whole block is handed out and counted.
// - A freed block merges with free neighbours in its segment. Segments go back to the
//   driver only on empty_cache(), which releases every wholly free segment.
// - expandable_segments:True: one segment per stream and pool, grown at the end by
//   mapping pages (2 MiB in the small pool, 20 MiB in the large pool) when no free block
//   fits; a free block at the end of the mapped range grows into the new pages, and is
//   used only when no free block inside the segment fits. Reserved bytes are the bytes
//   mapped; empty_cache() unmaps every page no block uses, also inside a segment.
//
// Not modelled: the device's size (no request fails, so the allocator's out-of-memory
// retries, which free cached segments and try again, never happen), max_split_size,
// roundup_power2_divisions, garbage_collection_threshold, record_stream's deferred frees
// and CUDA graph pools. cudaMalloc's addresses are unknown: a new segment lies above all
// earlier ones, so best-fit ties go to the older segment.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace remat::memory {

/// The allocator settings the model follows (PYTORCH_CUDA_ALLOC_CONF).
struct AllocatorRules {
  /// expandable_segments:True: segments that grow by mapping pages instead of one
  /// cudaMalloc per segment; it trades reserved-but-unusable slivers for mapping calls.
  bool expandable_segments = false;
};

/// One request to the allocator.
struct AllocatorEvent {
  enum class Kind { malloc, free } kind = Kind::malloc;
  /// Names the allocation: unique among live allocations, reusable once freed.
  int64_t id = 0;
  /// Bytes requested (malloc); 0 for a free.
  int64_t bytes = 0;
  /// The stream allocated on (malloc). A free goes back to its allocation's stream
  /// whatever this says; traces record it for reading.
  int stream = 0;
  bool operator==(const AllocatorEvent&) const = default;
};

/// The allocator's two byte counts, as torch.cuda.memory_allocated() and
/// memory_reserved() report them.
struct AllocatorState {
  int64_t allocated = 0;  ///< bytes of the blocks handed out
  int64_t reserved = 0;   ///< bytes of the segments held (mapped, under expandable segments)
  bool operator==(const AllocatorState&) const = default;
};

/// The allocator's state for one device, replayed request by request.
class CachingAllocatorModel {
 public:
  explicit CachingAllocatorModel(AllocatorRules rules = {});

  /// Allocates `bytes` on `stream` under `id`, which must not be live. Throws c10::Error
  /// for a live id or negative bytes.
  void malloc(int64_t id, int64_t bytes, int stream = 0);
  /// Frees the live allocation `id`. Throws c10::Error for an id that is not live.
  void free(int64_t id);
  /// malloc() or free() as `e` says.
  void apply(const AllocatorEvent& e);
  /// torch.cuda.empty_cache(): gives the driver every segment (or, under expandable
  /// segments, every page) that no block uses.
  void empty_cache();

  /// Bytes of the blocks handed out now (torch.cuda.memory_allocated()).
  int64_t allocated() const { return allocated_; }
  /// Bytes of the segments held now (torch.cuda.memory_reserved()).
  int64_t reserved() const { return reserved_; }
  /// allocated() and reserved() together.
  AllocatorState state() const { return {allocated_, reserved_}; }
  /// The highest allocated() since construction or reset_peaks().
  int64_t peak_allocated() const { return peak_allocated_; }
  /// The highest reserved() since construction or reset_peaks(): what the device must hold.
  int64_t peak_reserved() const { return peak_reserved_; }
  /// Starts a new peak window: peaks := current values.
  void reset_peaks();
  /// The bytes `allocated` counts for the live allocation `id`: its rounded size, or the
  /// whole block where the rest was too small to split off (0 for a request of 0 bytes).
  int64_t block_bytes(int64_t id) const;

 private:
  enum class Pool { small, large };
  enum class State { free, allocated, unmapped };
  struct Block {
    int64_t size = 0;
    int64_t segment = 0;  // address of its segment's first byte
    int stream = 0;
    Pool pool = Pool::small;
    State state = State::free;
  };
  using Blocks = std::map<int64_t, Block>;

  std::optional<int64_t> best_fit(Pool pool, int stream, int64_t size) const;
  int64_t new_segment(Pool pool, int stream, int64_t size);
  int64_t grow_segment(Pool pool, int stream, int64_t size);
  int64_t expandable_start(Pool pool, int stream, int64_t size);
  int64_t map_pages(int64_t address, int64_t bytes);
  void hand_out(int64_t address, int64_t size);
  void release_if_whole(int64_t address);
  void unmap_free_pages(int64_t address);
  int64_t settle(int64_t address);
  int64_t growable_size(int64_t address) const;
  Blocks::const_iterator prev_in_segment(Blocks::const_iterator it) const;
  Blocks::const_iterator next_in_segment(Blocks::const_iterator it) const;
  void index(int64_t address, const Block& block);
  void unindex(int64_t address, const Block& block);
  void note_peaks();

  AllocatorRules rules_;
  // Every block of every segment by address; a segment's blocks tile it in order.
  Blocks blocks_;
  // Per pool (small, large): the free blocks by (stream, size, address), for best fit,
  // and the unmapped ranges of expandable segments by (stream, address).
  std::set<std::tuple<int, int64_t, int64_t>> free_[2];
  std::set<std::pair<int, int64_t>> unmapped_[2];
  // Live allocations: id -> block address (kNoBlock for a request of 0 bytes).
  std::unordered_map<int64_t, int64_t> live_;
  int64_t next_address_ = 0;
  int64_t allocated_ = 0;
  int64_t reserved_ = 0;
  int64_t peak_allocated_ = 0;
  int64_t peak_reserved_ = 0;
};

/// Replays `events` from an empty allocator: the state after each event.
std::vector<AllocatorState> replay(const std::vector<AllocatorEvent>& events, AllocatorRules rules = {});

/// The bytes of the cuBLAS workspace PyTorch allocates by default for each (handle,
/// stream) pair on a GPU of compute capability `sm_major`.`sm_minor` (CublasHandlePool.cpp,
/// parseChosenWorkspaceSize, with CUBLAS_WORKSPACE_CONFIG unset): 32 MiB on Hopper and
/// Blackwell (sm 9.x to 12.x), else 8 MiB + 128 KiB (":4096:2:16:8"). It comes from the
/// caching allocator, so the caller makes it a malloc like any other.
int64_t cublas_workspace_bytes(int sm_major, int sm_minor);

/// One line of an allocation trace: an event and the state the allocator reported after it.
struct AllocationTraceEntry {
  AllocatorEvent event;
  AllocatorState state;
  bool operator==(const AllocationTraceEntry&) const = default;
};

/// Writes `entries` as a plain-text trace, one event a line:
/// `malloc ID BYTES STREAM ALLOCATED RESERVED` or `free ID 0 STREAM ALLOCATED RESERVED`,
/// after `#` comment lines. A trace recorded on a GPU (the real allocator's counts after
/// each event) becomes a test of the model that needs no GPU.
void write_allocation_trace(std::ostream& out, const std::vector<AllocationTraceEntry>& entries);
/// Reads a trace as write_allocation_trace() writes it; blank lines and lines starting
/// with `#` are skipped. Throws c10::Error naming the line and what it expected.
std::vector<AllocationTraceEntry> read_allocation_trace(std::istream& in);

}  // namespace remat::memory
