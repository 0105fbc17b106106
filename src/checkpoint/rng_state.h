// The random generators' states around a checkpoint: captured before fn's forward run,
// replayed for its recompute, and the states of the moment restored afterwards.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace remat::detail {

struct RngStates {
  at::Tensor cpu;  // the default CPU generator's state
  /// The default generators' states of the CUDA devices the checkpointed inputs live on.
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;

  /// The CPU generator and the generators of the CUDA devices that `inputs` live on, as
  /// torch.utils.checkpoint takes them: a checkpoint of CPU tensors leaves the GPUs' alone.
  static RngStates capture(at::TensorList inputs);
  /// The CPU generator and those of `devices`.
  static RngStates capture_on(const std::vector<c10::DeviceIndex>& devices);
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
