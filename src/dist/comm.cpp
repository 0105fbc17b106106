#include "remat/dist.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace remat::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often each rank proves it is alive, and how long a silent rank counts as lost: a
// few missed beats, so that a loaded machine's scheduling jitter does not name a rank.
constexpr milliseconds kBeat{500};
constexpr milliseconds kSilence{2500};
// Slices in which a collective is waited for; between them the store is asked whether
// another rank already saw the job fail.
constexpr milliseconds kSlice{200};
// How often a NCCL operation is asked whether it completed while a rank waits for it.
constexpr std::chrono::microseconds kPoll{20};

#if TORCH_VERSION_MAJOR >= 2
using ProcessGroup = c10d::Backend;  // what ProcessGroupGloo and ProcessGroupNCCL derive from
#else
using ProcessGroup = c10d::ProcessGroup;
#endif
using Work = c10::intrusive_ptr<c10d::Work>;

const std::string kAbortKey = "abort";
// How many ranks have read the failure posted under kAbortKey.
const std::string kReadAbortKey = "abort_read";
std::string beat_key(int rank) { return "beat/" + std::to_string(rank); }
std::string joined_key(int rank) { return "joined/" + std::to_string(rank); }
// Set by a rank that finished its run (Comm::finish), whose heartbeat then stops.
std::string finished_key(int rank) { return "finished/" + std::to_string(rank); }
// The GPU a rank holds (gpu_identity), empty for a CPU rank.
std::string gpu_key(int rank) { return "gpu/" + std::to_string(rank); }

int parse_int(const char* name, const char* text, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi) {
    throw std::invalid_argument(
        fmt::format("The environment variable {} is '{}', but it must be a whole number from "
                    "{} to {}; the launcher (remat launch, torchrun, mpirun, srun) sets it.",
                    name, text, lo, hi));
  }
  return static_cast<int>(v);
}

std::string to_string(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

// The address this host sends from to reach rank 0's store: that of the interface the
// route to MASTER_ADDR goes through, which the other ranks reach back (rank 0's own host
// gets MASTER_ADDR itself, a loopback MASTER_ADDR the loopback). Gloo's default, the
// address this host's name resolves to, may be on no such interface: it is 127.0.0.1 in
// containers and network namespaces, 127.0.1.1 on Debian.
std::string address_towards_master(const LaunchEnv& env) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(env.master_addr.c_str(), std::to_string(env.master_port).c_str(), &hints, &found);
  if (rc != 0) {
    throw std::runtime_error(fmt::format(
        "Rank {} cannot resolve MASTER_ADDR {} ({}); set it to rank 0's IP address as every host reaches it.", env.rank,
        env.master_addr, ::gai_strerror(rc)));
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(found, &::freeaddrinfo);
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    // Connecting a datagram socket sends nothing; the kernel only picks the route and source.
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    const bool routed = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    ::close(fd);
    char text[NI_MAXHOST];
    if (routed &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof text, nullptr, 0, NI_NUMERICHOST) == 0) {
      return text;
    }
  }
  throw std::runtime_error(fmt::format(
      "Rank {} has no route to MASTER_ADDR {}; set it to rank 0's address as this host reaches it, or name the "
      "network interface to use with GLOO_SOCKET_IFNAME.",
      env.rank, env.master_addr));
}

// Whether something listens at MASTER_ADDR:MASTER_PORT before `deadline`: false only when
// every try till then was refused. A store client that finds no listener tries again a
// second later, and the ranks of a job start together, so most would wait that second for
// rank 0's store; here they poll it finely. Any other outcome, an address that does not
// answer within 100 ms among them, is left to the store's own connect, which words it.
bool listening(const LaunchEnv& env, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(env.master_addr.c_str(), std::to_string(env.master_port).c_str(), &hints, &found) != 0) {
    return true;
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(found, &::freeaddrinfo);
  while (Clock::now() < deadline) {
    const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return true;
    int error = ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 ? 0 : errno;
    if (error == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      socklen_t len = sizeof error;
      if (::poll(&p, 1, 100) != 1 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = 0;
    }
    ::close(fd);
    if (error != ECONNREFUSED) return true;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return false;
}

// The Gloo device: the interface GLOO_SOCKET_IFNAME names (PyTorch's variable, for a host
// whose route to rank 0 is not the one its peers reach it by), else the route's address.
std::shared_ptr<::gloo::transport::Device> gloo_device(const LaunchEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDeviceForHostname(address_towards_master(env));
}

}  // namespace

std::optional<LaunchEnv> launch_env(const std::function<const char*(const char*)>& getenv) {
  const auto var = [&](const char* name) -> const char* {
    const char* v = getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  // The first launcher whose world size is set describes the job.
  struct Names {
    const char *rank, *size, *local, *local_size;
  };
  static const Names kLaunchers[] = {
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"}};
  for (const Names& n : kLaunchers) {
    if (var(n.size) == nullptr) continue;
    LaunchEnv env;
    env.world_size = parse_int(n.size, var(n.size), 1, 1 << 20);
    if (var(n.rank) == nullptr) {
      throw std::invalid_argument(
          fmt::format("{} = {} is set but {} is not; start every rank through one launcher "
                      "(remat launch, torchrun, mpirun or srun), which sets both.",
                      n.size, env.world_size, n.rank));
    }
    env.rank = parse_int(n.rank, var(n.rank), 0, env.world_size - 1);
    env.local_rank = var(n.local) != nullptr ? parse_int(n.local, var(n.local), 0, 1 << 20) : 0;
    env.local_world_size = var(n.local_size) != nullptr ? parse_int(n.local_size, var(n.local_size), 1, 1 << 20) : 1;
    if (var("MASTER_ADDR") != nullptr) env.master_addr = var("MASTER_ADDR");
    if (var("MASTER_PORT") != nullptr) env.master_port = parse_int("MASTER_PORT", var("MASTER_PORT"), 1, 65535);
    if (env.world_size > 1 && (var("MASTER_ADDR") == nullptr || var("MASTER_PORT") == nullptr)) {
      throw std::invalid_argument(fmt::format(
          "{} = {} asks for {} ranks, but MASTER_ADDR or MASTER_PORT is not set, so the ranks cannot find each "
          "other; set both to rank 0's address and a free port, or start the job with `remat launch --nproc N`.",
          n.size, env.world_size, env.world_size));
    }
    const char* agent = var("TORCHELASTIC_USE_AGENT_STORE");
    env.agent_store = agent != nullptr && std::string(agent) == "True";
    if (env.agent_store) {
      const char* restarts = var("TORCHELASTIC_RESTART_COUNT");
      env.store_prefix = fmt::format("/worker/attempt_{}", restarts != nullptr ? restarts : "0");
    }
    return env;
  }
  return std::nullopt;
}

std::optional<LaunchEnv> launch_env() {
  return launch_env([](const char* name) { return std::getenv(name); });
}

// A tensor the caller passed and the copy a backend moves in its place (C10dGroup::movable);
// once the operation is done, the copy's bytes go back into the caller's tensor.
struct Staged {
  at::Tensor caller, moved;
  void back() const {
    if (caller.defined() && !moved.is_same(caller)) caller.copy_(moved);
  }
};

// One process group over some of the job's ranks, Gloo's or NCCL's, its waits and
// failures those of the job.
class C10dGroup final : public Group {
 public:
  // `pg` null: a group of this rank alone, whose collectives change nothing.
  C10dGroup(Comm::State& job, c10::intrusive_ptr<ProcessGroup> pg, Backend backend, at::Device device, int rank,
            int size)
      : job_(job), pg_(std::move(pg)), backend_(backend), device_(device), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce(std::vector<at::Tensor>& tensors, Reduce op, const std::string& what) override;
  std::unique_ptr<Transfer> start_all_reduce(std::vector<at::Tensor> tensors, Reduce op,
                                             const std::string& what) override;
  at::Tensor all_gather(const at::Tensor& t, int64_t dim, const std::string& what) override;
  std::unique_ptr<Transfer> send(const at::Tensor& t, int peer, int tag, const std::string& what) override;
  std::unique_ptr<Transfer> recv(at::Tensor& t, int peer, int tag, const std::string& what) override;
  // After a failure: the group is leaked on purpose (see Comm::State::fail).
  void abandon() { (void)pg_.release(); }

  // Waits for a collective's `work` (a NCCL send's or receive's too). Gloo's is waited for
  // in slices of its own wait, then until Gloo's worker thread lets go of it: the worker
  // holds a finished work, and with it the tensors it reduced, a moment after marking it
  // done, so a tensor the engine frees right after the collective would otherwise outlive
  // it and lift the peak above the cost model's (by 1,024,000 bytes in a tensor-parallel
  // gpt2-demo step, measured). NCCL's is asked in slices whether it completed (its wait
  // with a timeout aborts the communicator when one runs out), then waited for, which
  // orders this rank's current stream after it.
  void settle(const Work& work, const std::string& what);

 private:
  // The tensor the backend moves for `t`: `t` itself where it can; on this rank's GPU for
  // NCCL, which moves no CPU tensor (a flag the ranks agree on); on the host for Gloo's
  // sends and receives (`p2p`), which move no CUDA tensor. `contents`: `t`'s values are
  // copied (what is sent or reduced), else only its shape (what is received).
  at::Tensor movable(const at::Tensor& t, bool p2p, bool contents) const;
  void check_peer(const char* op, int peer, int tag, const std::string& what) const;
  // Starts a send or receive. Gloo posts it on the peer's connection at once, so one its
  // peer closed throws here, before any wait: it fails the job as a failed wait would.
  Work start(const std::function<Work()>& post, const std::string& what);
  // A send or receive under way, as the backend waits for it.
  std::unique_ptr<Transfer> transfer(Work work, Staged staged, const std::string& what);

  Comm::State& job_;
  c10::intrusive_ptr<ProcessGroup> pg_;
  Backend backend_;
  at::Device device_;
  int rank_, size_;
};

struct Comm::State {
  c10::intrusive_ptr<c10d::Store> store;             // remat's keys, under their own prefix
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;  // the job's own exchanges (Comm's), on the CPU
  std::unique_ptr<C10dGroup> world, tensor, data, pipeline;
  at::Device device = at::kCPU;
  Backend backend = Backend::gloo;
  int device_sharers = 1;
  milliseconds timeout{};
  int rank = 0, size = 1;
  bool hosts_store = false;
  std::string endpoint;  // "host:port", for messages

  // Waits until every rank has joined (Comm::connect) and returns their GPUs' identities,
  // in rank order; throws a sentence naming the ranks missing after the timeout.
  std::vector<std::string> join(const LaunchEnv& env);
  // The Gloo group of the job's own exchanges, and the world, tensor-parallel,
  // data-parallel and pipeline groups on `backend`.
  void connect_groups(const LaunchEnv& env, int tp, int pp);

  std::thread heart;
  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;

  void beat_forever() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!stopping) {
      lock.unlock();
      try {
        store->add(beat_key(rank), 1);
      } catch (const std::exception&) {
        // The store is gone (rank 0 ended); a collective, if one is running, says so.
      }
      lock.lock();
      wake.wait_for(lock, kBeat, [&] { return stopping; });
    }
  }
  void stop_heart() {
    {
      const std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_all();
    if (heart.joinable()) heart.join();
  }

  // The ranks whose heartbeat did not move over kSilence; throws when the store is gone.
  std::vector<int> silent_ranks() {
    std::vector<int64_t> before(static_cast<size_t>(size));
    for (int r = 0; r < size; ++r) before[static_cast<size_t>(r)] = store->add(beat_key(r), 0);
    std::this_thread::sleep_for(kSilence);
    std::vector<int> silent;
    for (int r = 0; r < size; ++r) {
      if (r != rank && store->add(beat_key(r), 0) == before[static_cast<size_t>(r)]) silent.push_back(r);
    }
    return silent;
  }

  // Why `what` failed on this rank, as one sentence naming the lost ranks where the
  // heartbeats tell them.
  std::string diagnose(const std::string& what, const std::string& error) {
    try {
      const std::vector<int> silent = silent_ranks();
      if (silent.empty()) {
        return fmt::format(
            "{} failed on rank {} ({}), but every rank still answers: one rank is slower than "
            "parallel.timeout = {} s allows, or diverged from the others (different settings?); "
            "raise parallel.timeout or check that every rank runs the same command.",
            what, rank, error, timeout.count() / 1000.0);
      }
      // A rank that finished the run is silent too, but not lost: the ranks took other paths.
      std::vector<int> finished, lost;
      for (int r : silent) (store->check({finished_key(r)}) ? finished : lost).push_back(r);
      if (lost.empty()) {
        return fmt::format(
            "{} finished the run while rank {} still waited in {} ({}): the ranks took different "
            "paths; check that every rank runs the same command, settings and files.",
            rank_list(finished), rank, what, error);
      }
      return fmt::format(
          "{} stopped answering during {} (rank {} saw: {}); every rank stops. The output of {} "
          "tells why (killed, out of memory, crashed).",
          rank_list(lost), what, rank, error, rank_list(lost));
    } catch (const std::exception&) {
      return fmt::format(
          "rank 0, which hosts the rendezvous store at {}, is gone: {} failed on rank {} ({}); every "
          "rank stops. Look at rank 0's output for its cause.",
          endpoint, what, rank, error);
    }
  }

  // Ends this rank after a failure with one diagnosis shared by every rank: the first rank
  // to fail makes it (its heartbeats, like every live rank's, go on meanwhile, so that
  // only lost ranks fall silent) and posts it; a rank failing at the same moment waits for
  // it. The group is left alive on purpose: a Gloo group with an operation stuck on a
  // lost peer blocks its destructor until Gloo's own timeout, and the process is ending.
  [[noreturn]] void fail(const std::string& what, const std::string& error) {
    std::string message;
    try {
      if (store->add("diagnosing", 1) == 1) {
        message = diagnose(what, error);
        store->set(kAbortKey, to_bytes(message));
      } else {
        // The diagnosing rank needs kSilence; if it dies meanwhile, diagnose here.
        const auto deadline = Clock::now() + 3 * kSilence;
        while (!store->check({kAbortKey}) && Clock::now() < deadline) std::this_thread::sleep_for(kSlice);
        message = store->check({kAbortKey}) ? to_string(store->get(kAbortKey)) : diagnose(what, error);
      }
    } catch (const std::exception&) {
      message = diagnose(what, error);  // no store: the heartbeat check names rank 0
    }
    leave(message);
  }

  // Ends this rank with another rank's diagnosis (posted_failure).
  [[noreturn]] void leave(const std::string& message) {
    stop_heart();
    abandon_groups();
    read_failure();
    throw std::runtime_error(message);
  }

  // Counts this rank among those that read the failure. The rank hosting the store waits
  // for the others to have read it too, at most two silences (a lost rank never does):
  // its exit closes the store, and a rank that had not yet looked would blame rank 0.
  void read_failure() {
    try {
      store->add(kReadAbortKey, 1);
      const auto deadline = Clock::now() + 2 * kSilence;
      while (hosts_store && store->add(kReadAbortKey, 0) < size && Clock::now() < deadline) {
        std::this_thread::sleep_for(kSlice);
      }
    } catch (const std::exception&) {
      // No store: nobody is left to read it.
    }
  }

  // Leaks every group, see fail().
  void abandon_groups() {
    for (C10dGroup* g : {world.get(), tensor.get(), data.get(), pipeline.get()}) {
      if (g != nullptr) g->abandon();
    }
    (void)group.release();
  }

  // Another rank's diagnosis, if one was posted.
  std::optional<std::string> posted_failure() {
    try {
      if (store->check({kAbortKey})) return to_string(store->get(kAbortKey));
    } catch (const std::exception&) {
      // A missing store is found by the heartbeat check.
    }
    return std::nullopt;
  }

  // Waits for an operation `slice` at a time: `wait_slice` returns true once it is done,
  // false when a slice ran out, and throws when it failed.
  void wait(const std::function<bool(milliseconds slice)>& wait_slice, const std::string& what) {
    const auto start = Clock::now();
    while (true) {
      try {
        if (wait_slice(kSlice)) return;
      } catch (const std::exception& e) {
        fail(what, e.what());
      }
      if (auto posted = posted_failure()) leave(*posted);
      if (Clock::now() - start > timeout) {
        fail(what, fmt::format("not finished after parallel.timeout = {} s", timeout.count() / 1000.0));
      }
    }
  }

  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    wait(
        [&](milliseconds slice) {
          try {
            work->wait(slice);
            return true;
          } catch (const std::exception&) {
            // A slice that ran out throws too; the work is then still running, or it may
            // have finished since the slice ran out: a wait on a finished work returns or
            // throws the work's own failure, never the slice's.
            if (!work->isCompleted()) return false;
            work->wait();
            return true;
          }
        },
        what);
  }
};

namespace {

// A Gloo send or receive under way. Its work cannot be waited for in slices as a
// collective's can: its wait(timeout) waits on the transport's buffer, and one that runs
// out closes every connection of the group. So a helper thread waits for it while the
// caller waits for the helper in slices, and aborts the helper's wait if the job fails
// meanwhile. The helper's own limit is past the caller's (the timeout, then a diagnosis
// of a few heartbeats): it ends a helper only if the abort did not.
class GlooTransfer final : public Transfer {
 public:
  GlooTransfer(Comm::State& job, Work work, Staged staged, std::string what)
      : job_(job), work_(std::move(work)), staged_(std::move(staged)), what_(std::move(what)) {}

  void wait() override {
    TORCH_CHECK(work_, "[Transfer::wait] ", what_, " was already waited for; wait for a transfer once.");
    const milliseconds limit = job_.timeout + std::chrono::minutes(1);
    std::future<void> helper = std::async(std::launch::async, [work = work_.get(), limit] { work->wait(limit); });
    // Declared after `helper`, so it runs first when wait() leaves: the future's
    // destructor joins the helper, which must not still be blocked on the transport.
    struct AbortUnlessDone {
      c10d::Work& work;
      std::future<void>& helper;
      ~AbortUnlessDone() {
        if (helper.valid() && helper.wait_for(milliseconds(0)) != std::future_status::ready) work.abort();
      }
    } abort_unless_done{*work_, helper};
    job_.wait(
        [&](milliseconds slice) {
          if (helper.wait_for(slice) != std::future_status::ready) return false;
          helper.get();  // rethrows the transport's failure
          return true;
        },
        what_);
    work_.reset();  // lets go of the tensor
    staged_.back();
    staged_ = {};
  }

 private:
  Comm::State& job_;
  Work work_;  // holds the tensor while it travels
  Staged staged_;
  std::string what_;
};

// Collectives (or a NCCL send or receive) waited for through their group, one after
// another; then each staged copy goes back to the caller's tensor.
class Settled final : public Transfer {
 public:
  Settled(C10dGroup& group, std::vector<Work> works, std::vector<Staged> staged, std::string what)
      : group_(group), works_(std::move(works)), staged_(std::move(staged)), what_(std::move(what)) {}
  void wait() override {
    for (const Work& w : works_) group_.settle(w, what_);
    works_.clear();
    for (const Staged& s : staged_) s.back();
    staged_.clear();
  }

 private:
  C10dGroup& group_;
  std::vector<Work> works_;
  std::vector<Staged> staged_;
  std::string what_;
};

#ifdef USE_C10D_NCCL
// A NCCL group over `n` ranks on this rank's GPU. Its own timeout lies past remat's, so
// that the heartbeats name a lost rank before NCCL's watchdog ends the process.
c10::intrusive_ptr<ProcessGroup> nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int index, int n,
                                            milliseconds timeout, at::Device device) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout + std::chrono::minutes(1);
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, index, n, options);
  pg->setBoundDeviceId(device);
  return pg;
}
#endif

// What the other ranks learn of this rank's device: its GPU's gpu_identity, or nothing.
std::string identity_of(at::Device device) {
  if (!device.is_cuda()) return "";
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return gpu_identity(host, std::getenv("CUDA_VISIBLE_DEVICES"), device.index());
}

}  // namespace

NcclSupport nccl_support() {
  NcclSupport n;
#ifdef USE_C10D_NCCL
  std::sscanf(c10d::getNcclVersion().c_str(), "%d.%d", &n.major, &n.minor);
  const char* multi = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  n.multi_rank = (n.major > 2 || (n.major == 2 && n.minor >= 30)) && multi != nullptr && std::string(multi) == "1";
#endif
  return n;
}

std::vector<std::string> Comm::State::join(const LaunchEnv& env) {
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(joined_key(r));
  const auto deadline = Clock::now() + timeout;
  const auto all_joined = [&] {
    try {
      return store->check(keys);
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format(
          "Rank {} lost the rendezvous store at {} while the ranks were joining ({}): rank 0 hosts it and stopped; "
          "its output tells why (often a rank that did not join within parallel.timeout = {} s).",
          env.rank, endpoint, e.what(), timeout.count() / 1000.0));
    }
  };
  while (!all_joined()) {
    if (Clock::now() > deadline) {
      std::vector<int> missing;
      for (int r = 0; r < env.world_size; ++r) {
        if (!store->check({joined_key(r)})) missing.push_back(r);
      }
      throw std::runtime_error(fmt::format(
          "{} of {} did not join within parallel.timeout = {} s (rank {} waited at {}); start every rank with the "
          "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise parallel.timeout if they start slowly.",
          rank_list(missing), env.world_size, timeout.count() / 1000.0, env.rank, endpoint));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::vector<std::string> gpus;
  // A rank's GPU, posted before it joined, or none (a CPU rank).
  for (int r = 0; r < env.world_size; ++r) {
    gpus.push_back(store->check({gpu_key(r)}) ? to_string(store->get(gpu_key(r))) : std::string());
  }
  return gpus;
}

void Comm::State::connect_groups(const LaunchEnv& env, int tp, int pp) {
  auto gloo = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo->devices.push_back(gloo_device(env));
  group = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", store), env.rank,
                                                      env.world_size, gloo);
  // A process group on `backend` of `n` ranks, this one its `index`-th, under `name`.
  const auto make = [&](const std::string& name, int index, int n) -> c10::intrusive_ptr<ProcessGroup> {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
#ifdef USE_C10D_NCCL
    if (backend == Backend::nccl) return nccl_group(prefixed, index, n, timeout, device);
#endif
    TORCH_CHECK(backend == Backend::gloo, "[Comm::connect] NCCL was chosen in a build without it");
    return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, index, n, gloo);
  };
  // Gloo's world is the group of the job's own exchanges; NCCL's a group of its own.
  const c10::intrusive_ptr<ProcessGroup> all =
      backend == Backend::gloo ? c10::intrusive_ptr<ProcessGroup>(group) : make("nccl", env.rank, env.world_size);
  world = std::make_unique<C10dGroup>(*this, all, backend, device, env.rank, env.world_size);
  // A group of the ranks `first + i * stride`, i < n, this rank among them; one rank alone
  // needs no process group. Every rank creates only its own groups, under names all
  // members agree on.
  const auto subgroup = [&](const std::string& name, int first, int stride, int n) {
    const int index = (env.rank - first) / stride;
    if (n == 1) return std::make_unique<C10dGroup>(*this, c10::intrusive_ptr<ProcessGroup>(), backend, device, 0, 1);
    if (n == env.world_size) return std::make_unique<C10dGroup>(*this, all, backend, device, env.rank, n);
    const std::string prefix = fmt::format("{}/{}/{}", backend == Backend::gloo ? "gloo" : "nccl", name, first);
    return std::make_unique<C10dGroup>(*this, make(prefix, index, n), backend, device, index, n);
  };
  const int stage_size = env.world_size / pp;  // dp * tp ranks
  tensor = subgroup("tp", env.rank / tp * tp, 1, tp);
  data = subgroup("dp", env.rank / stage_size * stage_size + env.rank % tp, tp, stage_size / tp);
  pipeline = subgroup("pp", env.rank % stage_size, stage_size, pp);
}

Comm::Comm(std::unique_ptr<State> state, int rank, int size) : state_(std::move(state)), rank_(rank), size_(size) {}

Comm::~Comm() {
  if (state_) state_->stop_heart();
}

std::unique_ptr<Comm> Comm::connect(const LaunchEnv& env, milliseconds timeout, int tp, int pp,
                                    const RankDevice& device) {
  if (tp < 1 || env.world_size % tp != 0) {
    throw std::invalid_argument(fmt::format("parallel.tp = {} must divide the {} ranks started.", tp, env.world_size));
  }
  if (pp < 1 || env.world_size / tp % pp != 0) {
    throw std::invalid_argument(fmt::format(
        "pp = {} pipeline stages must divide the {} tensor-parallel groups of the {} ranks started (parallel.tp = "
        "{}): every stage holds as many of them.",
        pp, env.world_size / tp, env.world_size, tp));
  }
  auto s = std::make_unique<State>();
  s->timeout = timeout;
  s->rank = env.rank;
  s->size = env.world_size;
  s->endpoint = fmt::format("{}:{}", env.master_addr, env.master_port);

  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = env.rank == 0 && !env.agent_store;
  s->hosts_store = options.isServer;
  options.waitWorkers = false;  // the join below names who is missing
  options.timeout = timeout;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  // 2.4 made the libuv backend the default, which a LibTorch built without libuv
  // (Debian's) refuses; the classic backend, 1.13's, is in every build and serves a few ranks.
  options.useLibUV = false;
#endif
  c10::intrusive_ptr<c10d::Store> base;
  try {
    if (!options.isServer && !listening(env, Clock::now() + timeout)) {
      throw std::runtime_error("every connection was refused: nothing listens there");
    }
    base = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format(
        "Rank {} could not {} the rendezvous store at {} within parallel.timeout = {} s ({}); {}", env.rank,
        options.isServer ? "open" : "reach", s->endpoint, timeout.count() / 1000.0, e.what(),
        options.isServer ? "the port is taken: choose another MASTER_PORT (remat launch picks a free one)."
                         : "check that rank 0 runs and that MASTER_ADDR and MASTER_PORT are its address and port."));
  }
  if (!env.store_prefix.empty()) base = c10::make_intrusive<c10d::PrefixStore>(env.store_prefix, base);
  s->store = c10::make_intrusive<c10d::PrefixStore>("remat", base);

  // Everyone announces itself and its GPU, then waits for the others, so that a rank that
  // never starts is named instead of surfacing as Gloo's connection timeout.
  // A CPU rank posts no GPU: reading a value back costs a stalled round trip of the store's.
  if (const std::string gpu = identity_of(device.device); !gpu.empty()) s->store->set(gpu_key(env.rank), to_bytes(gpu));
  s->store->set(joined_key(env.rank), to_bytes("1"));
  const std::vector<std::string> gpus = s->join(env);
  try {
    s->backend = choose_backend(device.backend, gpus, nccl_support());
  } catch (const std::exception&) {
    s->read_failure();  // every rank refuses alike; the store's host waits till all have read
    throw;
  }
  s->device = device.device;
  if (s->device.is_cuda()) {
    s->device_sharers = static_cast<int>(std::count(gpus.begin(), gpus.end(), gpus[static_cast<size_t>(env.rank)]));
    c10::impl::getDeviceGuardImpl(at::kCUDA)->setDevice(s->device);
  }
  s->connect_groups(env, tp, pp);
  s->heart = std::thread([state = s.get()] { state->beat_forever(); });
  return std::unique_ptr<Comm>(new Comm(std::move(s), env.rank, env.world_size));
}

void from_owners(const std::vector<at::Tensor>& tensors, const std::vector<bool>& owned, const at::Tensor& whole,
                 Group& group, const std::string& what) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!owned[i]) tensors[i].fill_(-0.0);
  }
  std::vector<at::Tensor> reduced{whole};
  group.all_reduce(reduced, Reduce::sum, what);
}

void C10dGroup::all_reduce(std::vector<at::Tensor>& tensors, Reduce op, const std::string& what) {
  start_all_reduce(tensors, op, what)->wait();
}

std::unique_ptr<Transfer> C10dGroup::start_all_reduce(std::vector<at::Tensor> tensors, Reduce op,
                                                      const std::string& what) {
  // Each tensor its own collective: the backend reduces them one after another while the
  // caller goes on; waiting settles each.
  std::vector<Work> works;
  std::vector<Staged> staged;
  if (pg_) {
    c10d::AllreduceOptions options;
    options.reduceOp = op == Reduce::sum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    for (at::Tensor& t : tensors) {
      reduced_.bytes += static_cast<int64_t>(t.nbytes());
      ++reduced_.collectives;
      staged.push_back({t, movable(t, false, true)});
      std::vector<at::Tensor> one{staged.back().moved};
      works.push_back(pg_->allreduce(one, options));
    }
  }
  return std::make_unique<Settled>(*this, std::move(works), std::move(staged), what);
}

at::Tensor C10dGroup::all_gather(const at::Tensor& t, int64_t dim, const std::string& what) {
  if (!pg_) return t.clone();
  std::vector<at::Tensor> input{movable(t.contiguous(), false, true)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < size_; ++r) output[0].push_back(at::empty_like(input[0]));
  settle(pg_->allgather(output, input), what);
  return at::cat(output[0], dim).to(t.device());
}

at::Tensor C10dGroup::movable(const at::Tensor& t, bool p2p, bool contents) const {
  at::Device to = t.device();
  if (backend_ == Backend::nccl && !t.is_cuda()) to = device_;
  if (backend_ == Backend::gloo && p2p && t.is_cuda()) to = at::kCPU;
  if (to == t.device()) return t;
  return contents ? t.to(to) : at::empty_like(t, t.options().device(to));
}

void C10dGroup::check_peer(const char* op, int peer, int tag, const std::string& what) const {
  TORCH_CHECK(peer >= 0 && peer < size_ && peer != rank_, "[Group::", op, "] ", what, " names peer ", peer,
              ", but this rank is ", rank_, " of a group of ", size_, "; a peer is another rank of the group.");
  TORCH_CHECK(tag >= 0, "[Group::", op, "] ", what, " has tag ", tag, "; tags are from 0.");
}

std::unique_ptr<Transfer> C10dGroup::send(const at::Tensor& t, int peer, int tag, const std::string& what) {
  check_peer("send", peer, tag, what);
  std::vector<at::Tensor> one{movable(t.contiguous(), true, true)};
  return transfer(start([&] { return pg_->send(one, peer, tag); }, what), {}, what);
}

std::unique_ptr<Transfer> C10dGroup::recv(at::Tensor& t, int peer, int tag, const std::string& what) {
  check_peer("recv", peer, tag, what);
  TORCH_CHECK(t.is_contiguous(), "[Group::recv] ", what, " receives into a tensor that is not contiguous, strides ",
              t.strides(), "; the backend writes the bytes in a row.");
  Staged staged{t, movable(t, true, false)};
  std::vector<at::Tensor> one{staged.moved};
  return transfer(start([&] { return pg_->recv(one, peer, tag); }, what), std::move(staged), what);
}

std::unique_ptr<Transfer> C10dGroup::transfer(Work work, Staged staged, const std::string& what) {
  if (backend_ == Backend::gloo) return std::make_unique<GlooTransfer>(job_, std::move(work), std::move(staged), what);
  return std::make_unique<Settled>(*this, std::vector<Work>{std::move(work)}, std::vector<Staged>{std::move(staged)},
                                   what);
}

Work C10dGroup::start(const std::function<Work()>& post, const std::string& what) {
  try {
    return post();
  } catch (const std::exception& e) {
    job_.fail(what, e.what());
  }
}

void C10dGroup::settle(const Work& work, const std::string& what) {
  if (backend_ == Backend::nccl) {
    job_.wait(
        [&](milliseconds slice) {
          const auto until = Clock::now() + slice;
          while (!work->isCompleted()) {  // throws the work's failure
            if (Clock::now() > until) return false;
            std::this_thread::sleep_for(kPoll);
          }
          work->wait();
          return true;
        },
        what);
    return;
  }
  job_.wait(work, what);
  // Microseconds; bounded all the same, should another Gloo build keep its own reference.
  const auto until = Clock::now() + std::chrono::seconds(1);
  while (work.use_count() > 1 && Clock::now() < until) std::this_thread::yield();
}

at::Device Comm::device() const { return state_->device; }
Backend Comm::backend() const { return state_->backend; }
int Comm::device_sharers() const { return state_->device_sharers; }
Group& Comm::world() { return *state_->world; }
Group& Comm::tensor() { return *state_->tensor; }
Group& Comm::data() { return *state_->data; }
Group& Comm::pipeline() { return *state_->pipeline; }

std::vector<std::vector<int64_t>> Comm::all_gather(const std::vector<int64_t>& values, const std::string& what) {
  const auto n = static_cast<int64_t>(values.size());
  std::vector<at::Tensor> input{at::tensor(values, at::kLong)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < size_; ++r) output[0].push_back(at::empty({n}, at::kLong));
  state_->wait(state_->group->allgather(output, input), what);
  std::vector<std::vector<int64_t>> gathered;
  for (const at::Tensor& t : output[0]) gathered.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  return gathered;
}

void Comm::post(const std::string& key, const std::string& value) {
  state_->store->set("posted/" + key, to_bytes(value));
}

std::string Comm::await(const std::string& key, const std::string& what) {
  const std::string full = "posted/" + key;
  // A store that fails here is rank 0 gone: fail() names it, where the store's own error
  // would reach the user as a bare "Broken pipe".
  const auto store = [&](const auto& op) {
    try {
      return op();
    } catch (const std::exception& e) {
      state_->fail(what, e.what());
    }
  };
  auto last_check = Clock::now();
  std::vector<int64_t> beats;
  while (!store([&] { return state_->store->check({full}); })) {
    if (auto posted = state_->posted_failure()) state_->leave(*posted);
    // Every few beats, every rank must have beaten since the last look.
    if (Clock::now() - last_check > kSilence) {
      std::vector<int64_t> now;
      for (int r = 0; r < size_; ++r) now.push_back(store([&] { return state_->store->add(beat_key(r), 0); }));
      for (size_t r = 0; r < beats.size(); ++r) {
        if (now[r] == beats[r] && static_cast<int>(r) != rank_) state_->fail(what, "no heartbeat");
      }
      beats = now;
      last_check = Clock::now();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return to_string(store([&] { return state_->store->get(full); }));
}

void Comm::abort(const std::string& message) {
  try {
    // The first failure wins, as in fail(): a rank already diagnosing posts its own.
    if (state_->store->add("diagnosing", 1) == 1) state_->store->set(kAbortKey, to_bytes(message));
  } catch (const std::exception&) {
    // No store: the others find rank 0 gone by themselves.
  }
  state_->stop_heart();
  state_->abandon_groups();
  state_->read_failure();
}

void Comm::barrier(const std::string& what) { state_->wait(state_->group->barrier(), what); }

void Comm::finish() {
  try {
    state_->store->set(finished_key(rank_), to_bytes("1"));
  } catch (const std::exception&) {
    // No store: the barrier below says so.
  }
  state_->stop_heart();
  barrier("the barrier at the end of the run");
}

}  // namespace remat::dist
