#include "remat/memory.h"

#ifdef REMAT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

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

// Page-locks `bytes` at `p` for a CUDA device's copies; false where this build has no CUDA
// or the system refuses (its locked-memory limit), and then the memory stays pageable.
bool lock_pages(void* p, int64_t bytes) {
#ifdef REMAT_WITH_CUDA
  if (cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterDefault) == cudaSuccess) return true;
  (void)cudaGetLastError();  // the refusal is not a sticky error: clear it for the next call
#else
  (void)p;
  (void)bytes;
#endif
  return false;
}

void unlock_pages(void* p) {
#ifdef REMAT_WITH_CUDA
  (void)cudaHostUnregister(p);
#else
  (void)p;
#endif
}

}  // namespace

struct HostPool::State {
  // A buffer's bytes and whether it was to be page-locked (for a CUDA tensor), and whether it is.
  using Key = std::pair<int64_t, bool>;
  struct Buffer {
    void* p;
    bool locked;
  };
  std::mutex mu;
  std::multimap<Key, Buffer> idle;
  Counts counts;
  ~State() {
    for (auto& [key, b] : idle) {
      if (b.locked) unlock_pages(b.p);
      std::free(b.p);
    }
  }
  Buffer take(int64_t bytes, bool for_cuda) {
    const std::lock_guard<std::mutex> lock(mu);
    Buffer b{nullptr, false};
    const auto it = idle.find({bytes, for_cuda});
    if (it != idle.end()) {
      b = it->second;
      idle.erase(it);
    } else {
      b.p = std::malloc(static_cast<size_t>(bytes));
      TORCH_CHECK(b.p != nullptr, "Offloading activations needs ", format_bytes(bytes),
                  " more host memory, which the system refused; offload fewer slots (ac.policy's offload:[...], or "
                  "a smaller ac.host_budget).");
      b.locked = for_cuda && lock_pages(b.p, bytes);
      counts.reserved += bytes;
      if (b.locked) counts.pinned += bytes;
    }
    counts.in_use += bytes;
    counts.peak_in_use = std::max(counts.peak_in_use, counts.in_use);
    counts.moved += bytes;
    return b;
  }
  void give_back(Buffer b, int64_t bytes, bool for_cuda) {
    const std::lock_guard<std::mutex> lock(mu);
    counts.in_use -= bytes;
    idle.emplace(Key{bytes, for_cuda}, b);
  }
};

HostPool::HostPool() : state_(std::make_shared<State>()) {}

std::vector<at::Tensor> HostPool::to_host(const std::vector<at::Tensor>& ts) {
  const std::shared_ptr<State> state = state_;
  const bool for_cuda = std::any_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.is_cuda(); });
  return relocate(
      ts,
      [state, for_cuda](int64_t n) {
        // An empty storage has no memory to move.
        if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
        const State::Buffer b = state->take(n, for_cuda);
        return at::from_blob(
            b.p, {n}, [state, b, n, for_cuda](void*) { state->give_back(b, n, for_cuda); },
            at::TensorOptions().dtype(at::kByte));
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
