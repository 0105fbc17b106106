// AdamW, the optimizer of every run: one pass of ATen's fused kernel per group where
// LibTorch has it (util::kFusedAdamW), torch::optim::AdamW a parameter at a time where it
// does not (LibTorch 1.13). Both update with decoupled weight decay (Loshchilov and
// Hutter) and the bias-corrected moments.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace remat {

/// One tensor AdamW updates: its values, its gradient (read only), and whether weight
/// decay applies (matrices, not norms or biases: Param::decay).
struct AdamWParam {
  at::Tensor value;
  at::Tensor grad;
  bool decay = false;
};

/// The hyperparameters; eps as LibTorch's default.
struct AdamWSettings {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double weight_decay = 0.1;
  double eps = 1e-8;
};

/// AdamW over a fixed list of tensors, with the moments it keeps for each.
class AdamW {
 public:
  AdamW(std::vector<AdamWParam> params, const AdamWSettings& settings);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  /// One update of every tensor at learning rate `lr`; the first makes the moments, zeros
  /// of each value's shape.
  void step(double lr);
  /// Updates made so far (since the last restore()).
  int64_t updates() const;
  /// Tensor k's first and second moments, in the order the constructor took them;
  /// undefined before the first update.
  at::Tensor exp_avg(size_t k) const;
  at::Tensor exp_avg_sq(size_t k) const;
  /// Takes the state after `updates` updates: `exp_avg[k]` and `exp_avg_sq[k]` for tensor k,
  /// copied (none when `updates` is 0).
  void restore(int64_t updates, const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remat
