#include "remat/memory.h"

#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>

namespace remat::memory {
namespace {

// `ts` copied storage by storage into memory `bytes_on(n)` gives, each copy viewed as its
// source was (offset, sizes, strides) on `to`.
std::vector<at::Tensor> relocate(const std::vector<at::Tensor>& ts, const std::function<at::Tensor(int64_t)>& bytes_on,
                                 at::Device to) {
  std::map<const void*, at::Tensor> copies;  // by source storage
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) {
    const c10::Storage& s = t.storage();
    auto it = copies.find(s.unsafeGetStorageImpl());
    if (it == copies.end()) {
      const auto n = static_cast<int64_t>(s.nbytes());
      at::Tensor dst = bytes_on(n);
      const at::Tensor src =
          at::empty({0}, at::TensorOptions().dtype(at::kByte).device(t.device())).set_(s, 0, {n}, {1});
      dst.copy_(src);
      it = copies.emplace(s.unsafeGetStorageImpl(), std::move(dst)).first;
    }
    out.push_back(
        at::empty({0}, t.options().device(to)).set_(it->second.storage(), t.storage_offset(), t.sizes(), t.strides()));
  }
  return out;
}

}  // namespace

struct HostPool::State {
  std::mutex mu;
  std::multimap<int64_t, void*> idle;  // by bytes
  Counts counts;
  ~State() {
    for (auto& [bytes, p] : idle) std::free(p);
  }
  void* take(int64_t bytes) {
    const std::lock_guard<std::mutex> lock(mu);
    void* p = nullptr;
    const auto it = idle.find(bytes);
    if (it != idle.end()) {
      p = it->second;
      idle.erase(it);
    } else {
      p = std::malloc(static_cast<size_t>(bytes));
      TORCH_CHECK(p != nullptr, "Offloading activations needs ", format_bytes(bytes),
                  " more host memory, which the system refused; offload fewer slots (ac.policy's offload:[...]).");
      counts.reserved += bytes;
    }
    counts.in_use += bytes;
    counts.peak_in_use = std::max(counts.peak_in_use, counts.in_use);
    counts.moved += bytes;
    return p;
  }
  void give_back(void* p, int64_t bytes) {
    const std::lock_guard<std::mutex> lock(mu);
    counts.in_use -= bytes;
    idle.emplace(bytes, p);
  }
};

HostPool::HostPool() : state_(std::make_shared<State>()) {}

std::vector<at::Tensor> HostPool::to_host(const std::vector<at::Tensor>& ts) {
  const std::shared_ptr<State> state = state_;
  return relocate(
      ts,
      [state](int64_t n) {
        // An empty storage has no memory to move.
        if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
        void* p = state->take(n);
        return at::from_blob(
            p, {n}, [state, n](void* q) { state->give_back(q, n); }, at::TensorOptions().dtype(at::kByte));
      },
      at::kCPU);
}

std::vector<at::Tensor> HostPool::to_device(const std::vector<at::Tensor>& ts, at::Device device) {
  return relocate(
      ts, [device](int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device)); }, device);
}

HostPool::Counts HostPool::counts() const {
  const std::lock_guard<std::mutex> lock(state_->mu);
  return state_->counts;
}

}  // namespace remat::memory
