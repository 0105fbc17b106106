// Measured memory: the bytes tensors actually hold, current and peak.
//
// On CPU a tracking allocator wraps the c10 CPU allocator, so every tensor allocation
// is counted (the engine's and LibTorch's alike). On CUDA the caching allocator's own
// statistics are read (allocated and reserved bytes, current and peak).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace remat::memory {

struct Stats {
  int64_t current = 0;  ///< bytes held by live tensors now
  int64_t peak = 0;     ///< highest `current` since the last reset_peak()
  int64_t reserved = 0; ///< CUDA: bytes the caching allocator holds (0 on CPU)
  int64_t reserved_peak = 0;
};

/// Installs the tracking CPU allocator (idempotent; process-wide). Tensors allocated
/// before it is installed are not counted, so call it first thing in main() or a test.
void install_cpu_tracking();
/// Whether install_cpu_tracking() has run.
bool cpu_tracking_installed();

/// Current and peak bytes on `device`'s type (CPU: the tracking allocator; CUDA: the
/// caching allocator of that device).
Stats stats(at::Device device);
/// Starts a new peak window: peak := current.
void reset_peak(at::Device device);

/// "1.50 GiB"-style rendering of a byte count (binary units).
std::string format_bytes(int64_t bytes);

}  // namespace remat::memory
