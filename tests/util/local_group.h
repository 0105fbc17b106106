// dist::Groups for tests. LocalGroup: threads of one process as ranks, without sockets:
// each collective meets at a barrier, and every rank combines the ranks' tensors in rank
// order, so the result is the same on every rank and from run to run. AbsentPeers: one
// rank alone, for measuring its memory.
#pragma once

#include "remat/dist.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace remat::testing {

/// The state the ranks of one LocalGroup share.
class LocalWorld {
 public:
  explicit LocalWorld(int size) : size_(size), slots_(static_cast<size_t>(size)) {}
  int size() const { return size_; }

  // Waits for every rank (a generation barrier: reusable). A rank that stopped early (a
  // failed assertion) leaves the others waiting: they give up after a minute, so a test
  // fails instead of hanging.
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != generation; })) {
      throw std::runtime_error("a rank waited a minute at a collective that another rank never reached");
    }
  }
  std::vector<std::vector<at::Tensor>>& slots() { return slots_; }

 private:
  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  std::vector<std::vector<at::Tensor>> slots_;
};

// The ops these groups stand in for (sharded layers) talk through collectives only;
// transfers between pipeline stages are tested on Gloo (on_gloo_ranks).
[[noreturn]] inline void no_transfers(const char* group, const std::string& what) {
  throw std::logic_error(std::string(group) + " has no point-to-point transfers (" + what + "); use on_gloo_ranks.");
}

/// A collective finished when it was started.
struct DoneTransfer final : dist::Transfer {
  void wait() override {}
};

class LocalGroup final : public dist::Group {
 public:
  LocalGroup(LocalWorld& world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }

  void all_reduce(std::vector<at::Tensor>& tensors, dist::Reduce op, const std::string&) override {
    world_.slots()[static_cast<size_t>(rank_)] = tensors;
    world_.barrier();
    std::vector<at::Tensor> combined;
    for (size_t i = 0; i < tensors.size(); ++i) {
      at::Tensor acc = world_.slots()[0][i].clone();
      for (int r = 1; r < size(); ++r) {
        const at::Tensor& t = world_.slots()[static_cast<size_t>(r)][i];
        acc = op == dist::Reduce::sum ? acc + t : at::maximum(acc, t);
      }
      combined.push_back(acc);
    }
    world_.barrier();  // every rank has read every input before any is overwritten
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(combined[i]);
    world_.barrier();
  }

  // Done at once: a local world has no transport to overlap.
  std::unique_ptr<dist::Transfer> start_all_reduce(std::vector<at::Tensor> tensors, dist::Reduce op,
                                                   const std::string& what) override {
    all_reduce(tensors, op, what);
    return std::make_unique<DoneTransfer>();
  }

  at::Tensor all_gather(const at::Tensor& t, int64_t dim, const std::string&) override {
    world_.slots()[static_cast<size_t>(rank_)] = {t};
    world_.barrier();
    std::vector<at::Tensor> parts;
    for (int r = 0; r < size(); ++r) parts.push_back(world_.slots()[static_cast<size_t>(r)][0]);
    at::Tensor out = at::cat(parts, dim);
    world_.barrier();
    return out;
  }
  std::unique_ptr<dist::Transfer> send(const at::Tensor&, int, int, const std::string& what) override {
    no_transfers("LocalGroup", what);
  }
  std::unique_ptr<dist::Transfer> recv(at::Tensor&, int, int, const std::string& what) override {
    no_transfers("LocalGroup", what);
  }

 private:
  LocalWorld& world_;
  int rank_;
};

/// One rank of a tensor-parallel group whose other ranks are away: every collective leaves
/// the tensors as they are, allocating what Gloo would (a gather repeats this rank's part). A
/// sharded op or model then allocates what it would beside real peers (the values differ,
/// the memory does not), on this thread alone, so the process-wide tracking allocator
/// counts its allocations only.
class AbsentPeers final : public dist::Group {
 public:
  AbsentPeers(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce(std::vector<at::Tensor>&, dist::Reduce, const std::string&) override {}
  std::unique_ptr<dist::Transfer> start_all_reduce(std::vector<at::Tensor>, dist::Reduce, const std::string&) override {
    return std::make_unique<DoneTransfer>();
  }
  // As Gloo allocates: the ranks' parts, its flat receive buffer while the collective
  // runs, then their concatenation.
  at::Tensor all_gather(const at::Tensor& t, int64_t dim, const std::string&) override {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < size_; ++r) parts.push_back(t.clone());
    at::empty({size_ * t.numel()}, t.options());
    return at::cat(parts, dim);
  }
  std::unique_ptr<dist::Transfer> send(const at::Tensor&, int, int, const std::string& what) override {
    no_transfers("AbsentPeers", what);
  }
  std::unique_ptr<dist::Transfer> recv(at::Tensor&, int, int, const std::string& what) override {
    no_transfers("AbsentPeers", what);
  }

 private:
  int rank_, size_;
};

/// Runs `body(group)` on `n` threads, one rank each; rethrows the first rank's error.
inline void on_local_ranks(int n, const std::function<void(dist::Group&)>& body) {
  LocalWorld world(n);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      LocalGroup group(world, r);
      try {
        body(group);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!errors[static_cast<size_t>(r)].empty()) {
      throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)]);
    }
  }
}

}  // namespace remat::testing
