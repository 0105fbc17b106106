// The random generators' states around a checkpoint: captured before fn's forward run,
// replayed for its recompute, and the states of the moment restored afterwards.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace remat::detail {

struct RngStates {
  at::Tensor cpu;                // the default CPU generator's state
  std::vector<at::Tensor> cuda;  // each CUDA device's default generator, by index

  /// The CPU generator and, when CUDA is available, every CUDA device's generator.
  static RngStates capture();
  void restore() const;
};

/// Replays `replay` for the lifetime of this object, then puts back the states that were
/// current when it was created, so a recompute does not shift the program's random stream.
class RngFork {
 public:
  explicit RngFork(const RngStates& replay);
  ~RngFork();
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates resume_;
};

}  // namespace remat::detail
