#include "train/data_parallel.h"

#include "remat/memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>

namespace remat {

GradientReduction::GradientReduction(Model& model, dist::Group& group, bool overlap, std::string what,
                                     int64_t bucket_bytes)
    : model_(model), group_(group), what_(std::move(what)) {
  const at::Tensor& grads = model.grad_buffer();
  const int64_t per_bucket = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(grads.element_size()));
  for (int64_t end = grads.numel(); end > 0; end -= per_bucket) {
    const int64_t begin = std::max<int64_t>(0, end - per_bucket);
    buckets_.push_back(grads.narrow(0, begin, end - begin));
    begins_.push_back(begin);
  }
  if (!overlap) return;
  model.set_gradients_ready([this](size_t first) {
    const auto& params = model_.params();
    const at::Tensor& buffer = model_.grad_buffer();
    const int64_t from =
        first < params.size()
            ? (static_cast<const char*>(params[first].grad.data_ptr()) - static_cast<const char*>(buffer.data_ptr())) /
                  static_cast<int64_t>(buffer.element_size())
            : buffer.numel();
    const size_t before = started_;
    start_from(from);
    if (first > 0) started_early_ += static_cast<int64_t>(started_ - before);  // 0: the backward's last part
  });
}

GradientReduction::~GradientReduction() { model_.set_gradients_ready(nullptr); }

void GradientReduction::start_from(int64_t from) {
  while (started_ < buckets_.size() && begins_[started_] >= from) {
    running_.push_back(group_.start_all_reduce({buckets_[started_]}, dist::Reduce::sum, what_));
    ++started_;
  }
}

void GradientReduction::finish(double& loss) {
  model_.set_gradients_ready(nullptr);
  start_from(0);
  // The loss rides in float64, a collective of its own after the buckets.
  std::vector<at::Tensor> total{at::full({1}, loss, at::kDouble)};
  running_.push_back(group_.start_all_reduce(total, dist::Reduce::sum, what_));
  for (auto& r : running_) r->wait();
  running_.clear();
  loss = total[0].item<double>();
}

QuietStderr::QuietStderr(bool quiet) {
  if (!quiet) return;
  std::fflush(stderr);
  const int null = ::open("/dev/null", O_WRONLY);
  if (null < 0) return;  // nothing to silence with: the rank stays audible
  saved_ = ::dup(STDERR_FILENO);
  if (saved_ >= 0) ::dup2(null, STDERR_FILENO);
  ::close(null);
}

QuietStderr::~QuietStderr() {
  if (saved_ < 0) return;
  std::fflush(stderr);
  ::dup2(saved_, STDERR_FILENO);
  ::close(saved_);
}

}  // namespace remat
