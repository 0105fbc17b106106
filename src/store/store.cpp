#include "remat/store.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <deque>
#include <set>
#include <stdexcept>
#include <tuple>

#ifdef REMAT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace remat {
namespace {

// FNV-1a over the tensor's bytes: only for the `values` check, a debugging mode.
uint64_t hash_bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(at::kCPU);
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

std::string shape(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

}  // namespace

DeterminismCheck parse_determinism_check(const std::string& s) {
  if (s == "none") return DeterminismCheck::none;
  if (s == "meta") return DeterminismCheck::meta;
  if (s == "values") return DeterminismCheck::values;
  throw std::invalid_argument(fmt::format("ac.check must be none, meta or values, got '{}'.", s));
}

ActivationStore::ActivationStore(ActivationPlan plan, StoreOptions options, int64_t first, int64_t end)
    : plan_(std::move(plan)), options_(options) {
  const auto layers = static_cast<int64_t>(plan_.layers.size());
  if (end < 0) end = layers;
  TORCH_INTERNAL_ASSERT(0 <= first && first < end && end <= layers, "layers [", first, ", ", end, ") of a plan of ",
                        layers);
  for (int64_t l = end; l-- > first;) {
    if (!plan_.layers[static_cast<size_t>(l)].keeps_all()) lowest_recompute_ = l;
  }
}

void ActivationStore::drop(uint64_t mb, int64_t l, Slot slot, size_t index, const at::Tensor& t, bool view_of_dropped) {
  if (!t.defined()) return;
  if (!view_of_dropped) counters_.bytes_dropped += t.numel() * static_cast<int64_t>(t.element_size());
  if (options_.check == DeterminismCheck::none) return;
  Record& r = records_[{mb, l, slot}];
  if (r.sizes.size() <= index) {
    r.sizes.resize(index + 1);
    r.dtypes.resize(index + 1);
    r.hashes.resize(index + 1);
  }
  r.sizes[index] = t.sizes().vec();
  r.dtypes[index] = t.scalar_type();
  if (options_.check == DeterminismCheck::values) r.hashes[index] = hash_bytes(t);
}

void ActivationStore::refilled(uint64_t mb, int64_t l, Slot slot, const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> defined;
  for (const auto& t : tensors) {
    if (t.defined()) defined.push_back(t);
  }
  // A slot may hold a tensor and a view of all of it (tiled attention's output and its
  // merged heads): that memory counts once. Views of parts (q, k, v of one projection) count each.
  std::set<std::tuple<const c10::StorageImpl*, int64_t, int64_t>> seen;
  for (const auto& t : defined) {
    if (seen.emplace(t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.numel()).second) {
      counters_.bytes_recomputed += t.numel() * static_cast<int64_t>(t.element_size());
    }
  }
  if (options_.check == DeterminismCheck::none) return;
  auto it = records_.find({mb, l, slot});
  if (it == records_.end()) return;
  const Record& r = it->second;
  const std::string where = fmt::format("layer {} (counted from 1), slot {}", l + 1, slot_name(slot));
  if (defined.size() != r.sizes.size()) {
    throw std::runtime_error(fmt::format("Recompute of {} produced {} tensors, the forward saved {}.", where,
                                         defined.size(), r.sizes.size()));
  }
  for (size_t i = 0; i < defined.size(); ++i) {
    if (defined[i].sizes().vec() != r.sizes[i] || defined[i].scalar_type() != r.dtypes[i]) {
      throw std::runtime_error(
          fmt::format("Recompute of {} is not what the forward saved: tensor {} is {} {} on recompute but was {} {}.",
                      where, i, shape(defined[i].sizes().vec()), std::string(c10::toString(defined[i].scalar_type())),
                      shape(r.sizes[i]), std::string(c10::toString(r.dtypes[i]))));
    }
    if (options_.check == DeterminismCheck::values && hash_bytes(defined[i]) != r.hashes[i]) {
      throw std::runtime_error(fmt::format(
          "Recompute of {} is not what the forward saved: tensor {} ({}) has different values (hash {:016x}, "
          "forward {:016x}); the forward is not deterministic or its random keys changed.",
          where, i, shape(r.sizes[i]), hash_bytes(defined[i]), r.hashes[i]));
    }
  }
  records_.erase(it);
}

void ActivationStore::finished_backward(int64_t l) {
  if (options_.pool && l == lowest_recompute_) memory::release_pool();
}

void ActivationStore::count_op(const std::string& kind) {
  ++counters_.ops_recomputed;
  ++counters_.ops_by_kind[kind];
}

// A device synchronization around each node would add a launch latency to every node's
// time and drain the queue that the kernels of a step run from.
struct ActivationStore::NodeEvents {
#ifdef REMAT_WITH_CUDA
  struct Timed {
    std::string name;
    at::cuda::CUDAEvent start{cudaEventDefault}, end{cudaEventDefault};
  };
  std::deque<Timed> timed;
#endif
};

void ActivationStore::reset_counters() {
  counters_ = {};
  node_events_.reset();
}

void ActivationStore::settle_node_times() {
#ifdef REMAT_WITH_CUDA
  if (node_events_ == nullptr) return;
  for (auto& t : node_events_->timed) {
    t.end.synchronize();
    counters_.node_seconds[t.name] += 1e-3 * static_cast<double>(t.start.elapsed_time(t.end));
    ++counters_.node_runs[t.name];
  }
  node_events_.reset();
#endif
}

ActivationStore::NodeTimer::NodeTimer(ActivationStore& store, const char* name, at::Device device)
    : store_(store.options().time_nodes ? &store : nullptr), name_(name), device_(device) {
  if (store_ == nullptr) return;
#ifdef REMAT_WITH_CUDA
  if (device_.is_cuda()) {
    if (store_->node_events_ == nullptr) store_->node_events_ = std::make_shared<NodeEvents>();
    auto& timed = store_->node_events_->timed;
    event_ = timed.size();
    timed.push_back({name_});
    timed.back().start.record();
    return;
  }
#endif
  start_ = std::chrono::steady_clock::now();
}

ActivationStore::NodeTimer::~NodeTimer() {
  if (store_ == nullptr) return;
#ifdef REMAT_WITH_CUDA
  if (device_.is_cuda()) {
    store_->node_events_->timed[event_].end.record();
    return;
  }
#endif
  store_->counters_.node_seconds[name_] +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  ++store_->counters_.node_runs[name_];
}

}  // namespace remat
