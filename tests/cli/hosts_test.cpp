// `remat launch` over two hosts without a second machine: each node's launcher runs in its
// own network namespace, the two joined by a veth pair whose addresses exist only inside
// them, so the ranks can meet only the way ranks on two machines do, through node 0's
// address. Needs root and `ip` (iproute2), as CI has; without them the test fails, since
// a skip would hide that the multi-node path went untested.
#include "util/launched_training.h"
#include "util/paths.h"
#include "util/processes.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <array>
#include <chrono>
#include <string>
#include <vector>

namespace {

using namespace std::chrono_literals;
using remat::testing::read_text;
using remat::testing::Result;
using remat::testing::run_shell;

// Two network namespaces named after this process, joined by a veth pair: the first holds
// 10.231.0.1/24, the second 10.231.0.2/24, each with its loopback up. Whatever was made is
// removed on destruction (a veth end goes with its namespace), on every exit path.
class TwoHosts {
 public:
  static constexpr const char* kAddress[2] = {"10.231.0.1", "10.231.0.2"};

  TwoHosts() {
    const std::string id = std::to_string(::getpid());
    names_ = {"remat-a-" + id, "remat-b-" + id};
    const std::array<std::string, 2> veth = {"rma" + id, "rmb" + id};  // interface names: at most 15 characters
    std::vector<std::pair<std::string, std::string>> steps;            // a command and what undoes it
    for (int i = 0; i < 2; ++i) steps.emplace_back("ip netns add " + names_[i], "ip netns del " + names_[i]);
    steps.emplace_back("ip link add " + veth[0] + " type veth peer name " + veth[1], "ip link del " + veth[0]);
    for (int i = 0; i < 2; ++i) {
      const std::string in = "ip -n " + names_[i] + " ";
      steps.emplace_back("ip link set " + veth[i] + " netns " + names_[i], "");
      steps.emplace_back(in + "addr add " + kAddress[i] + "/24 dev " + veth[i], "");
      steps.emplace_back(in + "link set " + veth[i] + " up", "");
      steps.emplace_back(in + "link set lo up", "");
    }
    for (const auto& [command, undo] : steps) {
      const Result r = run_shell(command);
      if (r.exit_code != 0) {
        const std::string said = r.output.substr(0, r.output.find_last_not_of('\n') + 1);
        error_ = "`" + command + "` failed with exit code " + std::to_string(r.exit_code) + " (" + said +
                 "); this test needs root and iproute2's `ip netns`, as CI runs it.";
        return;
      }
      if (!undo.empty()) undo_.push_back(undo);
    }
  }
  ~TwoHosts() {
    // In reverse: the veth pair first, if it never reached the namespaces (once moved, it
    // is not in this one, the deletion fails harmlessly, and the namespace takes it along).
    for (auto it = undo_.rbegin(); it != undo_.rend(); ++it) run_shell(*it);
  }
  TwoHosts(const TwoHosts&) = delete;
  TwoHosts& operator=(const TwoHosts&) = delete;

  /// Why the namespaces could not be made; empty when they were.
  const std::string& error() const { return error_; }
  /// `cmd` run inside host `i`'s namespace.
  std::string in(int i, const std::string& cmd) const { return "ip netns exec " + names_[i] + " " + cmd; }

 private:
  std::array<std::string, 2> names_;
  std::vector<std::string> undo_;
  std::string error_;
};

class Hosts : public remat::testing::LaunchedTraining {};

// Data parallel, then tensor parallel, over two ranks: once on one host (`--nproc 2`), once
// as two nodes of one rank each. The same world, the same rows on the same ranks: the
// losses are the same numbers, bitwise, step by step and at the evaluation.
TEST_F(Hosts, TwoNodesInNetworkNamespacesTrainLikeOneHost) {
  const TwoHosts hosts;
  ASSERT_TRUE(hosts.error().empty()) << hosts.error();
  const std::string settings[] = {"", "parallel.tp=2"};
  for (size_t i = 0; i < std::size(settings); ++i) {
    const std::string run = common_ + " train.steps=2 parallel.timeout=30 " + settings[i];
    const std::string one = "one-host-" + std::to_string(i), two = "two-hosts-" + std::to_string(i);
    const Result single = remat::testing::run_remat("launch --nproc 2 train " + run + " run.name=" + one);
    ASSERT_EQ(single.exit_code, 0) << single.output;

    // A fixed port: nothing else listens in namespaces this test made.
    const std::string launch = std::string(remat::testing::kRematBinary) +
                               " launch --nnodes 2 --nproc 1 --master-addr " + TwoHosts::kAddress[0] +
                               " --master-port " + std::to_string(29500 + i);
    std::array<pid_t, 2> nodes{};
    for (int n = 0; n < 2; ++n) {
      // exec: the pid waited for is the launcher's (`ip netns exec` execs it too).
      const std::string cmd =
          "exec " + hosts.in(n, launch + " --node-rank " + std::to_string(n) + " train " + run + " run.name=" + two);
      nodes[n] = remat::testing::start_shell(cmd, dir_ / ("node" + std::to_string(n)));
    }
    // parallel.timeout bounds a rank that cannot reach the other; this bounds the rest.
    for (int n = 0; n < 2; ++n) {
      const std::string log = "node" + std::to_string(n);
      EXPECT_EQ(remat::testing::wait_exit(nodes[n], 90s), 0) << settings[i] << "\n" << read_text(dir_ / log);
    }
    const auto expected = train_lines(one), got = train_lines(two);
    ASSERT_EQ(expected.size(), 2u);
    ASSERT_EQ(got.size(), expected.size()) << settings[i];
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_EQ(got[s]["loss"], expected[s]["loss"]) << settings[i] << ", step " << s + 1;
      EXPECT_EQ(got[s]["rank_peak_bytes"].size(), 2u) << got[s];
    }
    const auto summary = [&](const std::string& name) {
      return nlohmann::json::parse(read_text(dir_ / "runs" / name / "summary.json"));
    };
    EXPECT_EQ(summary(two)["final_val_loss"], summary(one)["final_val_loss"]) << settings[i];
  }
}

}  // namespace
