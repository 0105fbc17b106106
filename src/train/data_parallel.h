// Data parallelism: every rank holds the whole model and trains on its share of each
// step's batch; the gradients are summed over the ranks before the optimizer step, so
// every rank applies the same update.
#pragma once

#include "remat/config.h"
#include "remat/cost.h"
#include "remat/dist.h"
#include "remat/model.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace remat {

/// Sums every parameter's gradient over the data-parallel ranks `group`, in place, in
/// buckets of a few MiB of the model's flat gradient buffer (counted from its end, where
/// the backward completes first), and the step's loss with them. Each rank's gradients
/// must be scaled by 1 / ranks (the mean over the global batch).
///
/// With `overlap`, the reduction starts during the next backward of `model` (give it the
/// step's last microbatch): each bucket as soon as every gradient in it is complete
/// (Model::set_gradients_ready), so that the transport works while the backward goes on,
/// as PyTorch's DistributedDataParallel does. The sums are the same to the bit either
/// way: the buckets are.
class GradientReduction {
 public:
  GradientReduction(Model& model, dist::Group& group, bool overlap, std::string what,
                    int64_t bucket_bytes = cost::kGradientBucketBytes);
  ~GradientReduction();
  GradientReduction(const GradientReduction&) = delete;
  GradientReduction& operator=(const GradientReduction&) = delete;
  /// Starts the buckets not yet started, with `loss`, and waits for all of them; `loss`
  /// then holds the sum over the ranks. Call once, after the backward.
  void finish(double& loss);
  /// Buckets started while some of the backward was still to run (0 without `overlap`),
  /// of bucket_count().
  int64_t started_early() const { return started_early_; }
  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }

 private:
  // Starts every bucket not yet started whose first element is at `from` or later.
  void start_from(int64_t from);
  Model& model_;
  dist::Group& group_;
  std::string what_;
  std::vector<at::Tensor> buckets_;  ///< last bucket of the buffer first
  std::vector<int64_t> begins_;      ///< each bucket's first element
  size_t started_ = 0;               ///< buckets_[0, started_) are under way
  int64_t started_early_ = 0;
  std::vector<std::unique_ptr<dist::Transfer>> running_;
};

/// While alive, this process's stderr goes nowhere (ranks other than 0 print neither the
/// progress bar nor the run's report, which rank 0 prints); restored on destruction, so an
/// error thrown through it is still printed by the rank that hit it.
class QuietStderr {
 public:
  explicit QuietStderr(bool quiet);
  ~QuietStderr();
  QuietStderr(const QuietStderr&) = delete;
  QuietStderr& operator=(const QuietStderr&) = delete;

 private:
  int saved_ = -1;
};

}  // namespace remat
