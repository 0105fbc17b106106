#include "remat/checkpoint.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cctype>

namespace remat {
namespace {

constexpr const char* kWhere = "remat::apply_checkpointing";

std::string valid_policies(size_t n) {
  return fmt::format("none, full, every:K (1 <= K <= {0}), uniform:N (1 <= N <= {0})", n);
}

// The count after "every:" or "uniform:", checked to be a whole number in 1..n.
size_t parse_count(const std::string& policy, const std::string& kind, const std::string& text, size_t n) {
  const char* letter = kind == "every" ? "K" : "N";
  const char* meaning = kind == "every" ? "every:K checkpoints modules K, 2K, 3K, ... counted from 1"
                                        : "uniform:N checkpoints chunks of N consecutive modules as one region";
  bool digits = !text.empty();
  for (const char c : text) {
    digits = digits && std::isdigit(static_cast<unsigned char>(c)) != 0;
  }
  TORCH_CHECK(digits, kWhere, ": policy '", policy, "': ", letter, " must be a whole number (", meaning, "), got '",
              text, "'. Valid policies: ", valid_policies(n), ".");
  // Saturate rather than overflow: anything above n is refused below anyway.
  size_t k = 0;
  for (const char c : text) {
    k = k > n ? k : k * 10 + static_cast<size_t>(c - '0');
  }
  TORCH_CHECK(k >= 1, kWhere, ": policy '", policy, "': ", letter, " must be at least 1 (", meaning,
              "); use 'none' to checkpoint nothing.");
  TORCH_CHECK(k <= n, kWhere, ": policy '", policy, "': ", letter, " = ", text, " is larger than the stack, which has ",
              n, " modules; use ", letter, " between 1 and ", n, ".");
  return k;
}

}  // namespace

std::vector<CheckpointSegment> plan_checkpoint_segments(const std::string& policy, size_t num_modules) {
  const size_t n = num_modules;
  std::vector<CheckpointSegment> segments;
  if (policy == "none") {
    if (n > 0) {
      segments.push_back({0, n, false});
    }
    return segments;
  }
  if (policy == "full") {
    for (size_t i = 0; i < n; ++i) {
      segments.push_back({i, i + 1, true});
    }
    return segments;
  }
  const size_t colon = policy.find(':');
  const std::string kind = policy.substr(0, colon);
  TORCH_CHECK(colon != std::string::npos && (kind == "every" || kind == "uniform"), kWhere,
              ": unknown checkpointing policy '", policy, "'. Valid policies: ", valid_policies(n), ".");
  const size_t k = parse_count(policy, kind, policy.substr(colon + 1), n);
  if (kind == "uniform") {
    for (size_t b = 0; b < n; b += k) {
      segments.push_back({b, std::min(b + k, n), true});
    }
    return segments;
  }
  // every:K: 1-based positions K, 2K, ... are 0-based indices K-1, 2K-1, ...; the modules
  // in between run plainly, as one segment per gap.
  size_t plain_begin = 0;
  for (size_t i = k - 1; i < n; i += k) {
    if (plain_begin < i) {
      segments.push_back({plain_begin, i, false});
    }
    segments.push_back({i, i + 1, true});
    plain_begin = i + 1;
  }
  if (plain_begin < n) {
    segments.push_back({plain_begin, n, false});
  }
  return segments;
}

CheckpointedStack::CheckpointedStack(std::shared_ptr<torch::nn::Module> container, size_t num_modules, Layer layer,
                                     std::vector<CheckpointSegment> segments, CheckpointOptions options)
    : container_(std::move(container)),
      num_modules_(num_modules),
      layer_(std::move(layer)),
      segments_(std::move(segments)),
      options_(std::move(options)) {}

at::Tensor CheckpointedStack::forward(const at::Tensor& x) const {
  const size_t now = container_->children().size();
  TORCH_CHECK(now == num_modules_, kWhere, ": the container has ", now, " modules now but had ", num_modules_,
              " when its checkpointing was planned; call apply_checkpointing again after "
              "changing it.");
  at::Tensor h = x;
  for (const CheckpointSegment& seg : segments_) {
    if (!seg.checkpointed) {
      for (size_t i = seg.begin; i < seg.end; ++i) {
        h = layer_(i, h);
      }
      continue;
    }
    CheckpointOptions o = options_;
    const std::string range = seg.end - seg.begin == 1 ? fmt::format("modules[{}]", seg.begin)
                                                       : fmt::format("modules[{}..{}]", seg.begin, seg.end - 1);
    o.name = options_.name.empty() ? range : options_.name + " " + range;
    // By value: a non-reentrant checkpoint keeps this function until backward.
    auto run = [layer = layer_, b = seg.begin, e = seg.end](const at::Tensor& in) {
      at::Tensor y = in;
      for (size_t i = b; i < e; ++i) {
        y = layer(i, y);
      }
      return y;
    };
    h = checkpoint(std::move(run), h, o);
  }
  return h;
}

CheckpointedStack apply_checkpointing(const torch::nn::Sequential& sequential, const std::string& policy,
                                      const CheckpointOptions& options) {
  std::shared_ptr<torch::nn::SequentialImpl> impl = sequential.ptr();
  auto layer = [impl](size_t i, const at::Tensor& x) { return impl->begin()[i].forward(x); };
  return CheckpointedStack(impl, impl->size(), std::move(layer), plan_checkpoint_segments(policy, impl->size()),
                           options);
}

CheckpointedStack apply_checkpointing(const torch::nn::ModuleList& list, const std::string& policy, ModuleCall call,
                                      const CheckpointOptions& options) {
  TORCH_CHECK(call, kWhere, ": the ModuleList needs a ModuleCall saying how to call a module.");
  std::shared_ptr<torch::nn::ModuleListImpl> impl = list.ptr();
  auto layer = [impl, call = std::move(call)](size_t i, const at::Tensor& x) { return call(*impl->ptr(i), x); };
  return CheckpointedStack(impl, impl->size(), std::move(layer), plan_checkpoint_segments(policy, impl->size()),
                           options);
}

}  // namespace remat
