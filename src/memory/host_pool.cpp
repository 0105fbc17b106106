#include "remat/memory.h"

#ifdef REMAT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

namespace remat::memory {
namespace {

// One storage's bytes to copy; both are held until the copy is done.
struct Copy {
  at::Tensor dst, src;
};

// `ts` copied storage by storage into memory `bytes_on(n)` gives, each copy viewed as its
// source was (offset, sizes, strides) on `to`; the copies to make go to `job` (none for an
// empty storage).
std::vector<at::Tensor> relocate(const std::vector<at::Tensor>& ts, const std::function<at::Tensor(int64_t)>& bytes_on,
                                 at::Device to, std::vector<Copy>& job) {
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
      if (n > 0) job.push_back({dst, src});
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

// Copies in the order they started, each ticket's after the ones before it: on a thread
// of the pool's own where they are between CPU buffers, else on a copy stream.
struct HostPool::Copier {
  using Job = std::vector<Copy>;  // held until awaited (CUDA) or done (CPU)
  std::mutex mu;
  std::condition_variable cv;
  uint64_t started = 0;
  // CPU: the copy thread's queue and the ticket it is copying (0: none).
  std::deque<std::pair<uint64_t, Job>> queue;
  uint64_t running = 0;
  bool stopping = false;
  std::thread thread;
#ifdef REMAT_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> stream;
  std::deque<std::tuple<uint64_t, at::cuda::CUDAEvent, Job>> in_flight;
#endif

  ~Copier() {
    if (!thread.joinable()) return;
    {
      const std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    thread.join();
  }

  void copy_thread() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;
      running = queue.front().first;
      Job job = std::move(queue.front().second);
      queue.pop_front();
      lock.unlock();
      for (const Copy& c : job) std::memcpy(c.dst.data_ptr(), c.src.data_ptr(), static_cast<size_t>(c.src.numel()));
      job.clear();  // the sources and results go before the copy counts as done
      lock.lock();
      running = 0;
      cv.notify_all();
    }
  }

  uint64_t start(Job job) {
    const std::lock_guard<std::mutex> lock(mu);
    const uint64_t ticket = ++started;
    if (job.empty()) return ticket;
    const auto on_cuda = [](const Copy& c) { return c.dst.is_cuda() || c.src.is_cuda(); };
    if (std::none_of(job.begin(), job.end(), on_cuda)) {
      queue.emplace_back(ticket, std::move(job));
      if (!thread.joinable()) thread = std::thread([this] { copy_thread(); });
      cv.notify_all();
      return ticket;
    }
#ifdef REMAT_WITH_CUDA
    const Copy& first = job.front();
    const c10::DeviceIndex device = (first.dst.is_cuda() ? first.dst : first.src).device().index();
    if (!stream) stream = c10::cuda::getStreamFromPool(false, device);
    // The copy stream starts after what the compute stream queued: the kernels that wrote
    // the sources, and those that last used the results' memory before it was freed.
    at::cuda::CUDAEvent queued;
    queued.record(c10::cuda::getCurrentCUDAStream(device));
    queued.block(*stream);
    {
      const c10::cuda::CUDAStreamGuard guard(*stream);
      for (const Copy& c : job) c.dst.copy_(c.src, /*non_blocking=*/true);
    }
    at::cuda::CUDAEvent copied;
    copied.record(*stream);
    in_flight.emplace_back(ticket, std::move(copied), std::move(job));
#else
    TORCH_INTERNAL_ASSERT(false, "a CUDA tensor's copy in a build without CUDA");
#endif
    return ticket;
  }

  void await(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mu);
#ifdef REMAT_WITH_CUDA
    // One stream runs them in order: the last one's event covers the ones before it.
    std::vector<Job> done;
    std::optional<at::cuda::CUDAEvent> last;
    while (!in_flight.empty() && std::get<0>(in_flight.front()) <= ticket) {
      last = std::move(std::get<1>(in_flight.front()));
      done.push_back(std::move(std::get<2>(in_flight.front())));
      in_flight.pop_front();
    }
    if (last) last->block(c10::cuda::getCurrentCUDAStream(last->device_index()));
#endif
    cv.wait(lock,
            [&] { return (queue.empty() || queue.front().first > ticket) && (running == 0 || running > ticket); });
  }
};

HostPool::HostPool() : state_(std::make_shared<State>()), copier_(std::make_shared<Copier>()) {}

HostPool::Moved HostPool::to_host(const std::vector<at::Tensor>& ts) {
  const std::shared_ptr<State> state = state_;
  const bool for_cuda = std::any_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.is_cuda(); });
  Copier::Job job;
  Moved m;
  m.tensors = relocate(
      ts,
      [state, for_cuda](int64_t n) {
        // An empty storage has no memory to move.
        if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
        const State::Buffer b = state->take(n, for_cuda);
        return at::from_blob(
            b.p, {n}, [state, b, n, for_cuda](void*) { state->give_back(b, n, for_cuda); },
            at::TensorOptions().dtype(at::kByte));
      },
      at::kCPU, job);
  m.ticket = copier_->start(std::move(job));
  return m;
}

HostPool::Moved HostPool::to_device(const std::vector<at::Tensor>& ts, at::Device device) {
  Copier::Job job;
  Moved m;
  m.tensors = relocate(
      ts, [device](int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device)); }, device,
      job);
  m.ticket = copier_->start(std::move(job));
  return m;
}

void HostPool::await(uint64_t ticket) { copier_->await(ticket); }

HostPool::Counts HostPool::counts() const {
  const std::lock_guard<std::mutex> lock(state_->mu);
  return state_->counts;
}

}  // namespace remat::memory
