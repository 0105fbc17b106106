#include "cli/launch.h"

#include "train/run_dir.h"
#include "util/stop_signals.h"
#include "util/utf8.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace remat::cli {
namespace {

constexpr int kMaxRanks = 1024;
constexpr int kMaxNodes = 1024;
constexpr int kMaxRestarts = 1000;

// --max-restarts and --run-id.
void check_restart_args(const LaunchArgs& args) {
  if (args.max_restarts < 0 || args.max_restarts > kMaxRestarts) {
    throw std::invalid_argument(
        fmt::format("--max-restarts {} is out of range; a failed job starts again from 0 (the default) to {} times.",
                    args.max_restarts, kMaxRestarts));
  }
  // Each node's own id would send the restarted ranks of different nodes to different runs.
  if (args.nnodes > 1 && args.max_restarts > 0 && args.run_id.empty()) {
    throw std::invalid_argument(fmt::format(
        "--max-restarts {} over --nnodes {} needs --run-id, the same on every node (e.g. --run-id night-1), so that "
        "every rank of a restarted job continues the same run directory.",
        args.max_restarts, args.nnodes));
  }
  if (util::find_control(args.run_id) != std::string::npos || args.run_id.size() > 200) {
    throw std::invalid_argument(
        fmt::format("--run-id {} is not an id; give up to 200 printable characters, the same on every node.",
                    util::printable(args.run_id)));
  }
}

void check_args(const LaunchArgs& args) {
  const std::string valid = fmt::format("{}", fmt::join(launchable_subcommands(), ", "));
  const std::string example = "`remat launch --nproc 2 train --config configs/gpt2-demo.toml`";
  const std::string nodes_example =
      "`remat launch --nnodes 2 --node-rank 0 --nproc 2 --master-addr 10.0.0.1 --master-port 29500 train ...` on "
      "node 0 (whose address is 10.0.0.1) and the same with --node-rank 1 on the other";
  if (args.nproc < 1 || args.nproc > kMaxRanks) {
    throw std::invalid_argument(fmt::format("--nproc {} is out of range; remat launch starts from 1 to {} local ranks.",
                                            args.nproc, kMaxRanks));
  }
  if (args.nnodes < 1 || args.nnodes > kMaxNodes) {
    throw std::invalid_argument(
        fmt::format("--nnodes {} is out of range; a job spans from 1 to {} nodes, each running one remat launch.",
                    args.nnodes, kMaxNodes));
  }
  if (args.node_rank < 0 || args.node_rank >= args.nnodes) {
    throw std::invalid_argument(fmt::format(
        "--node-rank {} is out of range for --nnodes {}; number the nodes from 0 to {}, node 0 being the one at "
        "--master-addr.",
        args.node_rank, args.nnodes, args.nnodes - 1));
  }
  // One default address or port per node would not be the same on every node.
  if (args.nnodes > 1 && args.master_addr.empty()) {
    throw std::invalid_argument(fmt::format(
        "--nnodes {} needs --master-addr, node 0's address as every node reaches it (the default, 127.0.0.1, is "
        "each node's own loopback), e.g. {}.",
        args.nnodes, nodes_example));
  }
  if (args.nnodes > 1 && args.master_port == 0) {
    throw std::invalid_argument(fmt::format(
        "--nnodes {} needs --master-port, the same free port on every node (a free port picked on one node is "
        "unknown to the others), e.g. {}.",
        args.nnodes, nodes_example));
  }
  if (!args.master_addr.empty()) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(args.master_addr.c_str(), nullptr, &hints, &found);
    if (found != nullptr) ::freeaddrinfo(found);
    if (rc != 0) {
      throw std::invalid_argument(fmt::format(
          "--master-addr {} does not resolve to an address ({}); give node 0's IP address, or a name every node "
          "resolves.",
          args.master_addr, ::gai_strerror(rc)));
    }
  }
  if (args.master_port < 0 || args.master_port > 65535) {
    throw std::invalid_argument(fmt::format("--master-port {} is not a TCP port; give one from 1 to 65535{}.",
                                            args.master_port,
                                            args.nnodes == 1 ? ", or leave the option out for a free one" : ""));
  }
  check_restart_args(args);
  if (!std::isfinite(args.grace) || args.grace < 0) {
    throw std::invalid_argument(
        fmt::format("--grace {} is not a number of seconds; give 0 or more (default 30).", args.grace));
  }
  if (args.command.empty()) {
    throw std::invalid_argument(fmt::format(
        "remat launch needs the subcommand its ranks run, after its own options, e.g. {}; valid subcommands: {}.",
        example, valid));
  }
  const std::string& sub = args.command.front();
  if (sub == "launch") {
    throw std::invalid_argument(
        fmt::format("remat launch cannot run launch in its ranks; give it the subcommand itself, e.g. {}.", example));
  }
  if (sub.rfind('-', 0) == 0) {
    throw std::invalid_argument(
        fmt::format("remat launch takes only --nproc, --nnodes, --node-rank, --master-addr, --master-port, --grace, "
                    "--max-restarts and --run-id before the subcommand, but got {}; the subcommand's own options go "
                    "after its name, e.g. {}; valid subcommands: {}.",
                    sub, example, valid));
  }
  const auto& names = launchable_subcommands();
  if (std::find(names.begin(), names.end(), sub) == names.end()) {
    throw std::invalid_argument(
        fmt::format("'{}' is not a subcommand remat launch can run; valid subcommands: {}.", sub, valid));
  }
}

// How a rank ended, in words, and the exit code a shell gives it.
std::pair<std::string, int> describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return {fmt::format("was killed by signal {} ({})", sig, ::strsignal(sig)), 128 + sig};
  }
  return {fmt::format("exited with status {}", WEXITSTATUS(status)), WEXITSTATUS(status)};
}

std::string ranks(long n) { return fmt::format("{} rank{}", n, n == 1 ? "" : "s"); }

}  // namespace

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  if (!ok) {
    throw std::runtime_error(
        fmt::format("remat launch could not find a free TCP port on 127.0.0.1 ({}); give one with --master-port.",
                    std::strerror(err)));
  }
  return ntohs(addr.sin_port);
}

const std::vector<std::string>& launchable_subcommands() {
  static const std::vector<std::string> names = {"prepare", "train", "plan", "bench", "generate"};
  return names;
}

std::vector<std::string> rank_environment(const LaunchArgs& args, int local, int port, int restart,
                                          const char* const* base) {
  const std::pair<std::string, std::string> set[] = {
      {"RANK", std::to_string(args.node_rank * args.nproc + local)},
      {"LOCAL_RANK", std::to_string(local)},
      {"WORLD_SIZE", std::to_string(args.nnodes * args.nproc)},
      {"LOCAL_WORLD_SIZE", std::to_string(args.nproc)},
      {"GROUP_RANK", std::to_string(args.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(args.nnodes)},
      {"MASTER_ADDR", args.master_addr.empty() ? "127.0.0.1" : args.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(args.max_restarts)},
      {"TORCHELASTIC_RUN_ID", args.run_id}};
  std::vector<std::string> env;
  for (; base != nullptr && *base != nullptr; ++base) {
    const std::string_view entry = *base;
    const std::string_view name = entry.substr(0, entry.find('='));
    // No agent hosts a store here: rank 0 must host it, not wait for one as a client.
    const bool dropped = name == "TORCHELASTIC_USE_AGENT_STORE" ||
                         std::any_of(std::begin(set), std::end(set), [&](const auto& kv) { return kv.first == name; });
    if (!dropped) env.emplace_back(entry);
  }
  for (const auto& [name, value] : set) env.push_back(name + "=" + value);
  return env;
}

namespace {

// How one start of the job ended.
struct Start {
  int exit_code = 0;
  bool stopped = false;  ///< the launcher was asked to stop (SIGINT, SIGTERM): no restart
  std::string failure;   ///< the first failing rank and how it ended, e.g. "rank 1 was killed by ..."
};

// Starts the local ranks of start `restart`, each lifting `old_mask` once its death signal
// is armed; their pids, in rank order. A fork that fails is said in `result`.
std::vector<pid_t> start_ranks(const LaunchArgs& args, int port, int restart, const sigset_t& old_mask, Start& result) {
  // Built before the first fork: between fork and exec only async-signal-safe calls are allowed.
  std::vector<std::string> argv_text{"remat"};
  argv_text.insert(argv_text.end(), args.command.begin(), args.command.end());
  std::vector<char*> argv;
  for (auto& a : argv_text) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::vector<std::string>> env_text(args.nproc);
  std::vector<std::vector<char*>> envp(args.nproc);
  for (int rank = 0; rank < args.nproc; ++rank) {
    env_text[rank] = rank_environment(args, rank, port, restart, environ);
    for (auto& e : env_text[rank]) envp[rank].push_back(e.data());
    envp[rank].push_back(nullptr);
  }

  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < args.nproc; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      // A launcher dead before prctl would leave this rank to run with nobody to stop it.
      if (::getppid() != launcher) ::_exit(128 + SIGTERM);
      ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
      ::execve("/proc/self/exe", argv.data(), envp[rank].data());
      static const char failed[] = "error: remat launch could not execute /proc/self/exe in a rank.\n";
      [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, failed, sizeof failed - 1);
      ::_exit(127);
    }
    if (pid < 0) {
      result.failure =
          fmt::format("rank {} could not start ({})", args.node_rank * args.nproc + rank, std::strerror(errno));
      fmt::print(stderr, "remat launch: {}; stopping the ranks already started.\n", result.failure);
      result.exit_code = 1;
      break;
    }
    pids.push_back(pid);
  }
  return pids;
}

// Starts the ranks of start `restart` and waits for all of them, stopping the others when
// one fails. `wanted` (SIGCHLD, SIGINT, SIGTERM) is blocked in the launcher, `old_mask` is
// what the ranks get back.
Start run_ranks(const LaunchArgs& args, int port, int restart, const sigset_t& wanted, const sigset_t& old_mask) {
  const int first_rank = args.node_rank * args.nproc;  // this node's ranks in the job, for messages
  Start result;
  std::vector<pid_t> pids = start_ranks(args, port, restart, old_mask, result);  // 0 once waited for

  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> deadline;  // set once the ranks have been asked to stop
  int stop_signal = SIGTERM;
  bool killed = false;
  const auto running = [&] { return std::count_if(pids.begin(), pids.end(), [](pid_t p) { return p > 0; }); };
  const auto send = [&](int sig) {
    for (const pid_t p : pids) {
      if (p > 0) ::kill(p, sig);
    }
  };
  const auto stop = [&](int sig) {
    send(sig);
    stop_signal = sig;
    deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(args.grace));
  };
  if (result.exit_code != 0) stop(SIGTERM);

  while (running() > 0) {
    int status = 0;
    pid_t pid = 0;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      const auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      *it = 0;
      const auto [how, code] = describe_exit(status);
      if (code == 0 || result.exit_code != 0) continue;
      result.exit_code = code;
      if (deadline) continue;  // a rank ending while the ranks are being stopped is no news
      result.failure = fmt::format("rank {} (pid {}) {}", first_rank + (it - pids.begin()), pid, how);
      const long others = running();
      const std::string here = args.nnodes > 1 ? " on this node" : "";
      fmt::print(stderr, "remat launch: {}{}.\n", result.failure,
                 others == 0 ? "" : fmt::format("; stopping the other {}{}", ranks(others), here));
      stop(SIGTERM);
    }
    if (running() == 0) break;

    int sig = 0;
    if (deadline && !killed) {
      const auto left = std::max(Clock::duration::zero(), *deadline - Clock::now());
      const auto secs = std::chrono::duration_cast<std::chrono::seconds>(left);
      const timespec ts{static_cast<time_t>(secs.count()),
                        static_cast<long>(std::chrono::nanoseconds(left - secs).count())};
      sig = ::sigtimedwait(&wanted, nullptr, &ts);
    } else {
      sig = ::sigwaitinfo(&wanted, nullptr);
    }
    if (sig == SIGINT || sig == SIGTERM) {
      fmt::print(stderr, "remat launch: got SIG{}; passing it to the {} still running.\n", ::sigabbrev_np(sig),
                 ranks(running()));
      result.stopped = true;
      if (deadline) {
        send(sig);  // the clock already runs: a second signal must not extend it
      } else {
        stop(sig);
      }
    } else if (sig < 0 && errno == EAGAIN) {
      fmt::print(stderr, "remat launch: {} still running {} s after SIG{}; killing them (--grace sets the wait).\n",
                 ranks(running()), args.grace, ::sigabbrev_np(stop_signal));
      send(SIGKILL);
      killed = true;
    }
  }
  return result;
}

// A SIGINT or SIGTERM that came while no rank ran (between two starts), said in a line.
bool stop_pending(const sigset_t& wanted) {
  const timespec now{0, 0};
  for (int sig = 0; (sig = ::sigtimedwait(&wanted, nullptr, &now)) > 0;) {
    if (sig == SIGINT || sig == SIGTERM) {
      fmt::print(stderr, "remat launch: got SIG{}; the job is not started again.\n", ::sigabbrev_np(sig));
      return true;
    }
  }
  return false;
}

}  // namespace

int cmd_launch(const LaunchArgs& given) {
  check_args(given);
  const util::Phase phase("running the job's ranks");
  LaunchArgs args = given;
  if (args.run_id.empty()) args.run_id = fmt::format("launch-{}-{}", ::getpid(), RunDir::timestamp());

  // The launcher takes these signals with sigtimedwait, so none can slip in between a check
  // and the wait. Children inherit the mask and lift it only once their death signal is
  // armed: a signal forwarded to a rank still on its way to exec stays pending, not lost.
  sigset_t wanted, old_mask;
  sigemptyset(&wanted);
  for (const int sig : {SIGCHLD, SIGINT, SIGTERM}) sigaddset(&wanted, sig);
  ::pthread_sigmask(SIG_BLOCK, &wanted, &old_mask);
  // An inherited SIG_IGN would have the kernel reap the ranks before waitpid could see how they ended.
  ::signal(SIGCHLD, SIG_DFL);

  Start start;
  for (int restart = 0;; ++restart) {
    // A fresh port each start unless one is given: the last store's may not be free yet.
    start = run_ranks(args, args.master_port > 0 ? args.master_port : free_port(), restart, wanted, old_mask);
    if (start.exit_code == 0 || start.stopped || stop_pending(wanted)) break;
    if (restart == args.max_restarts) {
      if (args.max_restarts > 0) {
        fmt::print(stderr, "remat launch: the job failed on its first start and on all {} restart{}; giving up.\n",
                   args.max_restarts, args.max_restarts == 1 ? "" : "s");
      }
      break;
    }
    fmt::print(stderr,
               "remat launch: starting the job again (restart {} of {}) because {}; a restarted train continues its "
               "run directory from the newest whole checkpoint.\n",
               restart + 1, args.max_restarts, start.failure);
  }
  ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  return start.exit_code;
}

}  // namespace remat::cli
