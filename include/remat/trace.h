// A timeline of one training step, written as Chrome-trace JSON (opens in Perfetto,
// https://ui.perfetto.dev, or chrome://tracing).
//
// The recorder is process-wide and off by default; while it is off a Scope costs one
// relaxed atomic load. While it is on, each Scope becomes one complete slice ("ph":"X":
// name, category, begin and duration in microseconds of the steady clock, on the thread
// that ran it), and both of its ends sample the tensor bytes in use on the traced device
// (memory::stats().current) into a counter track named "memory". Slices nest: a block's
// slice holds its ops, an op may hold the ops it calls (attention holds its dropout).
//
// Categories say what a slice is: the op slices are `forward`, `backward` or
// `recompute` (forward ops the activation store re-executes inside a backward); `layer`
// marks the coarse per-layer slices ("layer 3 forward", "layer 3 recompute", "loss head
// backward") and `step` the trainer's (the whole step, zeroing and clipping the gradients,
// the optimizer, the weights' compute-dtype copies).
//
// On CUDA every slice boundary waits for the device while recording, so a slice measures
// its kernels rather than their launch; the traced step runs slower for it.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace remat::trace {

enum class Category { forward, backward, recompute, layer, step };

namespace detail {
extern std::atomic<bool> g_recording;
}  // namespace detail

/// Whether a recording is running.
inline bool recording() { return detail::g_recording.load(std::memory_order_relaxed); }

/// Starts a recording, forgetting any earlier one; memory is sampled on `device`.
void start(at::Device device);

/// Stops the recording and returns it as Chrome-trace JSON text:
/// {"traceEvents": [...], "displayTimeUnit": "ms"}, slices ordered by begin time (a parent
/// before its children). Timestamps count from start(), in microseconds.
std::string stop();

/// Throws std::invalid_argument, a sentence naming `path`, unless a new trace file can be
/// written there (its directory exists and is writable, and nothing is there yet: an
/// earlier trace is never replaced); run before training so a bad path costs nothing.
void check_writable(const std::string& path);

/// Records one slice from construction to destruction, when a recording is running at
/// construction. `name` must outlive the recording (a string literal). A `layer` >= 0
/// prefixes the name with "layer <layer + 1> " (layers count from 1, as in plans and
/// messages). Category::forward means a forward op: inside a Recompute guard on this
/// thread it is recorded as Category::recompute.
class Scope {
 public:
  Scope(const char* name, Category category, int64_t layer = -1) {
    if (recording()) begin(name, category, layer);
  }
  ~Scope() {
    if (active_) end();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  friend class Recompute;
  Scope() = default;  // inactive until begin()
  void begin(const char* name, Category category, int64_t layer);
  void end();

  bool active_ = false;
  const char* name_ = nullptr;
  Category category_ = Category::forward;
  int64_t layer_ = -1;
  int64_t begin_ns_ = 0;
};

/// Marks the forward ops this thread runs while it lives as recomputation of layer
/// `layer` (0-based), timed as one "layer N recompute" slice. A guard inside another adds
/// nothing, so a recursive recompute shows as one slice.
class Recompute {
 public:
  explicit Recompute(int64_t layer);
  ~Recompute();
  Recompute(const Recompute&) = delete;
  Recompute& operator=(const Recompute&) = delete;

 private:
  bool outermost_ = false;
  Scope slice_;
};

}  // namespace remat::trace
