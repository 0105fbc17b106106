// `remat launch`: the arguments reach every rank, a failing rank stops the job with a
// sentence, bad arguments start nothing, and signals reach the ranks. Ranks that must stay
// alive are the first node's of a two-node job whose second node never comes: they wait in
// the rendezvous for parallel.timeout (far longer than any test), which ends only by a
// signal here, so every timing here is a wait on an event, not a guess.
#include "cli/launch.h"
#include "remat/cost.h"
#include "remat/dist.h"
#include "remat/model.h"
#include "train/run_dir.h"
#include "util/error_of.h"
#include "util/launched_training.h"
#include "util/paths.h"
#include "util/processes.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

using remat::cli::free_port;
using remat::testing::read_text;
using remat::testing::Result;
using remat::testing::run_remat;
using remat::testing::wait_exit;

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The "NAME=value" or argv strings of a /proc file holding '\0'-separated ones.
std::vector<std::string> proc_strings(pid_t pid, const char* file) {
  std::vector<std::string> items;
  std::ifstream in("/proc/" + std::to_string(pid) + "/" + file, std::ios::binary);
  for (std::string item; std::getline(in, item, '\0');) items.push_back(item);
  return items;
}

// Children of `parent` that have executed `remat` (argv[0] is "remat" in a rank, the
// binary's full path in the launcher, and still the launcher's before exec).
std::vector<pid_t> ranks_of(pid_t parent) {
  std::vector<pid_t> ranks;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_text(entry.path() / "stat");
    std::istringstream fields(stat.substr(stat.rfind(')') + 1));
    char state = 0;
    pid_t ppid = 0;
    fields >> state >> ppid;
    const pid_t pid = std::stoi(name);
    const auto argv = proc_strings(pid, "cmdline");
    if (ppid == parent && !argv.empty() && argv[0] == "remat") ranks.push_back(pid);
  }
  return ranks;
}

class Launch : public ::testing::Test {
 protected:
  // Starts the first node of a two-node `remat launch --nproc 2 [extra] train`, output to
  // dir_/log, SIGTERM ignored from the start when `ignore_sigterm` (its ranks inherit that);
  // returns its pid once both ranks run `remat`, or -1.
  pid_t start_blocked_launch(const std::vector<std::string>& extra, bool ignore_sigterm) {
    std::string cmd = std::string(ignore_sigterm ? "trap '' TERM; " : "") + "exec " + remat::testing::kRematBinary;
    cmd += " launch --nproc 2 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port " +
           std::to_string(free_port());
    for (const std::string& a : extra) cmd += " " + a;
    const pid_t pid =
        remat::testing::start_shell(cmd +
                                        " train model.preset=tiny-gpt2 train.seq=16 parallel.timeout=3600 "
                                        "run.out_dir=" +
                                        (dir_ / "runs").string() + " data.dir=" + (dir_ / "data").string(),
                                    dir_ / "log");
    for (auto waited = 0ms; waited < 20s; waited += 10ms) {
      if (ranks_of(pid).size() == 2) return pid;
      std::this_thread::sleep_for(10ms);
    }
    ADD_FAILURE() << "the launcher did not start 2 ranks within 20 s: " << read_text(dir_ / "log");
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return -1;
  }

  remat::testing::TempDir dir_;
};

TEST(LaunchEnvironment, SetsTheTorchrunVariablesAndDropsTheAgentStore) {
  const char* base[] = {
      "PATH=/usr/bin", "RANK=7", "TORCHELASTIC_USE_AGENT_STORE=True", "TORCHELASTIC_RESTART_COUNT=9", "MASTER_PORT=1",
      "HOME=/root",    nullptr};
  remat::cli::LaunchArgs args;
  args.nproc = 3;
  args.max_restarts = 4;
  args.run_id = "night";
  const std::vector<std::string> env = remat::cli::rank_environment(args, 2, 29511, 1, base);
  const std::set<std::string> got(env.begin(), env.end());
  EXPECT_EQ(got.size(), env.size()) << "a variable appears twice";
  const std::set<std::string> expected = {"PATH=/usr/bin",
                                          "HOME=/root",
                                          "RANK=2",
                                          "LOCAL_RANK=2",
                                          "WORLD_SIZE=3",
                                          "LOCAL_WORLD_SIZE=3",
                                          "GROUP_RANK=0",
                                          "GROUP_WORLD_SIZE=1",
                                          "MASTER_ADDR=127.0.0.1",
                                          "MASTER_PORT=29511",
                                          "TORCHELASTIC_RESTART_COUNT=1",
                                          "TORCHELASTIC_MAX_RESTARTS=4",
                                          "TORCHELASTIC_RUN_ID=night"};
  EXPECT_EQ(got, expected);
  args.nproc = 1;
  EXPECT_EQ(remat::cli::rank_environment(args, 0, 5, 0, nullptr).size(), 11u);
}

// What a rank reads back of them: its start and the job's id, as torchrun also sets them.
TEST(LaunchEnvironment, ARankReadsItsStartAndItsJob) {
  remat::cli::LaunchArgs args;
  args.nproc = 2;
  args.max_restarts = 3;
  args.run_id = "night";
  std::vector<std::string> env = remat::cli::rank_environment(args, 1, 29500, 2, nullptr);
  const auto get = [&](const char* name) -> const char* {
    for (const std::string& e : env) {
      if (e.rfind(std::string(name) + "=", 0) == 0) return e.c_str() + std::strlen(name) + 1;
    }
    return nullptr;
  };
  EXPECT_EQ(remat::dist::launch_env(get).value().rank, 1);
  const remat::JobStart job = remat::job_start(get);
  EXPECT_EQ(job.restart, 2);
  EXPECT_EQ(job.max_restarts, 3);
  EXPECT_EQ(job.run_id, "night");
  for (std::string& e : env) {
    if (e.rfind("TORCHELASTIC_RESTART_COUNT=", 0) == 0) e = "TORCHELASTIC_RESTART_COUNT=-1";
  }
  const std::string refusal = remat::testing::error_of<std::invalid_argument>([&] { remat::job_start(get); });
  EXPECT_NE(refusal.find("TORCHELASTIC_RESTART_COUNT"), std::string::npos) << refusal;
}

// torchrun's numbering over nodes: node r's local rank l is rank r * nproc + l.
TEST(LaunchEnvironment, NumbersTheRanksOfEveryNode) {
  remat::cli::LaunchArgs args;
  args.nproc = 2;
  args.nnodes = 3;
  args.node_rank = 2;
  args.master_addr = "10.0.0.1";
  args.run_id = "job";
  const std::vector<std::string> env = remat::cli::rank_environment(args, 1, 29500, 0, nullptr);
  const std::set<std::string> expected = {"RANK=5",
                                          "LOCAL_RANK=1",
                                          "WORLD_SIZE=6",
                                          "LOCAL_WORLD_SIZE=2",
                                          "GROUP_RANK=2",
                                          "GROUP_WORLD_SIZE=3",
                                          "MASTER_ADDR=10.0.0.1",
                                          "MASTER_PORT=29500",
                                          "TORCHELASTIC_RESTART_COUNT=0",
                                          "TORCHELASTIC_MAX_RESTARTS=0",
                                          "TORCHELASTIC_RUN_ID=job"};
  EXPECT_EQ(std::set<std::string>(env.begin(), env.end()), expected);
}

TEST_F(Launch, EveryRankRunsTheSubcommandWithItsArguments) {
  // --budget would be refused by launch itself: it must reach the ranks untouched.
  const Result r = run_remat("launch --nproc 2 plan --budget 0.6 model.preset=gpt2-demo");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "run: gpt2-demo (gpt2)"), 2u) << r.output;
  EXPECT_EQ(count(r.output, "plan: the planner's for ac.budget = \"0.6\""), 2u) << r.output;
  EXPECT_EQ(count(r.output, "remat launch:"), 0u) << r.output;
}

TEST_F(Launch, PlanningUnderLaunchPlansARanksShareOfTheBatch) {
  const Result r = run_remat("launch --nproc 2 plan model.preset=gpt2-demo train.batch=16");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(
      count(r.output, "step: 16 x 128 tokens, 1 microbatch, float32, data parallel over 2 ranks of 8 sequences\n"), 2u)
      << r.output;
  const Result odd = run_remat("launch --nproc 2 plan model.preset=gpt2-demo train.batch=15");
  EXPECT_EQ(odd.exit_code, 1) << odd.output;
  EXPECT_GE(count(odd.output,
                  "error: train.batch = 15 sequences cannot be split evenly over 2 data-parallel ranks; "
                  "make train.batch a multiple of 2"),
            1u)
      << odd.output;
}

TEST_F(Launch, AFailingRankEndsTheLaunchWithItsStatus) {
  const Result r = run_remat("launch --nproc 2 plan model.preset=nonexistent");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  // The other rank may be stopped before it says the same.
  EXPECT_GE(count(r.output, "error: Unknown model preset 'nonexistent'"), 1u) << r.output;
  EXPECT_EQ(count(r.output, "remat launch:"), 1u) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(remat launch: rank [01] \(pid \d+\) exited with status 1)")))
      << r.output;
}

TEST_F(Launch, BadArgumentsAreRefusedBeforeAnyRankStarts) {
  const std::pair<std::string, std::string> cases[] = {
      {"--nproc 0 plan model.preset=gpt2-demo", "--nproc 0 is out of range; remat launch starts from 1 to 1024"},
      {"--nproc 1025 plan model.preset=gpt2-demo", "--nproc 1025 is out of range"},
      {"--nproc 2", "needs the subcommand its ranks run, after its own options, e.g. `remat launch --nproc 2 train"},
      {"--nproc 2 trian model.preset=gpt2-demo",
       "'trian' is not a subcommand remat launch can run; valid subcommands: prepare, train, plan, bench, generate."},
      {"--nproc 2 launch --nproc 2 plan model.preset=gpt2-demo", "remat launch cannot run launch in its ranks"},
      {"--nproc 2 --budget 0.6 plan model.preset=gpt2-demo",
       "takes only --nproc, --nnodes, --node-rank, --master-addr, --master-port, --grace, --max-restarts and "
       "--run-id before the subcommand, but got --budget"},
      {"--nproc 2 --nnodes 0 plan model.preset=gpt2-demo", "--nnodes 0 is out of range; a job spans from 1 to 1024"},
      {"--nproc 2 --nnodes 2 --node-rank 2 --master-addr 127.0.0.1 --master-port 29500 plan model.preset=gpt2-demo",
       "--node-rank 2 is out of range for --nnodes 2; number the nodes from 0 to 1"},
      {"--nproc 2 --nnodes 2 --node-rank 1 --master-port 29500 plan model.preset=gpt2-demo",
       "--nnodes 2 needs --master-addr, node 0's address as every node reaches it"},
      {"--nproc 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 plan model.preset=gpt2-demo",
       "--nnodes 2 needs --master-port, the same free port on every node"},
      {"--nproc 2 --master-addr no-such-host.invalid plan model.preset=gpt2-demo",
       "--master-addr no-such-host.invalid does not resolve to an address"},
      {"--nproc 2 --master-port 65536 plan model.preset=gpt2-demo", "--master-port 65536 is not a TCP port"},
      {"--nproc 2 --grace -1 plan model.preset=gpt2-demo", "--grace -1 is not a number of seconds"},
      {"--nproc 2 --max-restarts -1 plan model.preset=gpt2-demo",
       "--max-restarts -1 is out of range; a failed job starts again from 0 (the default) to 1000 times."},
      {"--nproc 2 --nnodes 2 --master-addr 127.0.0.1 --master-port 29500 --max-restarts 2 plan model.preset=gpt2-demo",
       "--max-restarts 2 over --nnodes 2 needs --run-id, the same on every node"},
      {"--nproc 2 --run-id \"$(printf 'a\\nb')\" plan model.preset=gpt2-demo", "--run-id a\\nb is not an id"},
  };
  for (const auto& [args, expected] : cases) {
    const Result r = run_remat("launch " + args);
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_EQ(r.output.rfind("error: ", 0), 0u) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1u) << "one sentence, and no rank's output: " << args << "\n" << r.output;
  }
}

TEST_F(Launch, SigtermReachesEveryRank) {
  const pid_t launcher = start_blocked_launch({}, false);
  ASSERT_GT(launcher, 0);
  const std::vector<pid_t> ranks = ranks_of(launcher);
  std::set<std::string> rank_vars, ports;
  for (const pid_t rank : ranks) {
    for (const auto& var : proc_strings(rank, "environ")) {
      if (var.rfind("RANK=", 0) == 0) rank_vars.insert(var);
      if (var.rfind("MASTER_PORT=", 0) == 0) ports.insert(var);
    }
  }
  EXPECT_EQ(rank_vars, (std::set<std::string>{"RANK=0", "RANK=1"}));
  EXPECT_EQ(ports.size(), 1u);

  ASSERT_EQ(::kill(launcher, SIGTERM), 0);
  EXPECT_EQ(wait_exit(launcher), 128 + SIGTERM);
  const std::string log = read_text(dir_ / "log");
  EXPECT_NE(log.find("remat launch: got SIGTERM; passing it to the 2 ranks still running."), std::string::npos) << log;
  EXPECT_EQ(count(log, "remat launch:"), 1u) << "ranks stopped by the signal are not failures: " << log;
  for (const pid_t rank : ranks) EXPECT_TRUE(::kill(rank, 0) == -1 && errno == ESRCH) << "rank " << rank << " lives";
}

TEST_F(Launch, RanksThatIgnoreSigtermAreKilledAfterTheGrace) {
  const pid_t launcher = start_blocked_launch({"--grace", "0.5"}, true);
  ASSERT_GT(launcher, 0);
  ASSERT_EQ(::kill(launcher, SIGTERM), 0);
  EXPECT_EQ(wait_exit(launcher), 128 + SIGKILL);
  const std::string log = read_text(dir_ / "log");
  EXPECT_NE(log.find("remat launch: 2 ranks still running 0.5 s after SIGTERM; killing them"), std::string::npos)
      << log;
}

TEST_F(Launch, RanksDieWithTheLauncher) {
  // The orphaned ranks come to this process, which can then see how they ended.
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  const pid_t launcher = start_blocked_launch({}, false);
  if (launcher > 0) {
    const std::vector<pid_t> ranks = ranks_of(launcher);
    ::kill(launcher, SIGKILL);
    EXPECT_EQ(wait_exit(launcher), 128 + SIGKILL);
    for (const pid_t rank : ranks) EXPECT_EQ(wait_exit(rank), 128 + SIGTERM) << "rank " << rank;
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
}

// Training on several ranks: the rows of every batch split over them, joined through a
// TCPStore and Gloo on the loopback, launched by `remat launch`, by torchrun, or by hand.
using remat::testing::LaunchedTraining;

// `remat launch` and torchrun run the same ranks, so their losses are bitwise alike; only
// rank 0 writes the run, and it reports every rank's peak. One process over the same rows
// draws the same dropout elements (each rank keys them by its rows' global position), so
// its first loss, the mean of the same N token losses summed in another order, is within
// 2 gamma_N of it (both means within gamma_N = N u / (1 - N u) of the exact one, u = 2^-24,
// the terms being positive; Higham 4.2); a rank drawing other elements is far outside.
TEST_F(LaunchedTraining, LaunchAndTorchrunTrainAlikeAndOneProcessAgrees) {
  const std::string steps = " train.steps=3 ";
  const Result launched = run_remat("launch --nproc 2 train " + common_ + steps + "run.name=launch");
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  EXPECT_NE(launched.output.find("memory peak per rank: rank 0 "), std::string::npos) << launched.output;
  const Result single = run_remat("train " + common_ + steps + "run.name=single");
  ASSERT_EQ(single.exit_code, 0) << single.output;

  const auto lines = train_lines("launch");
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& line : lines) EXPECT_EQ(line["rank_peak_bytes"].size(), 2u) << line;
  const double n = 4 * 16, gamma = n * 0x1p-24 / (1 - n * 0x1p-24);
  const double one = train_lines("single").at(0)["loss"];
  EXPECT_LE(std::abs(lines[0]["loss"].get<double>() - one), 2 * gamma * one);
  const auto summary = nlohmann::json::parse(read_text(dir_ / "runs" / "launch" / "summary.json"));
  EXPECT_EQ(summary["ranks"], 2);
  EXPECT_EQ(summary["rank_peak_bytes"].size(), 2u);

  // The all-reduce overlapped with the backward sums the same buckets: the same losses.
  const Result overlapped =
      run_remat("launch --nproc 2 train " + common_ + steps + "run.name=overlap parallel.overlap_grad_reduce=true");
  ASSERT_EQ(overlapped.exit_code, 0) << overlapped.output;
  const auto with_overlap = train_lines("overlap");
  ASSERT_EQ(with_overlap.size(), lines.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(with_overlap[i]["loss"], lines[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(with_overlap[i]["reduce_buckets"], lines[i]["reduce_buckets"]) << "step " << i + 1;
    EXPECT_GE(with_overlap[i]["reduce_buckets"].get<int64_t>(), 1);
  }

  if (!fs::exists("/usr/bin/torchrun")) GTEST_SKIP() << "no /usr/bin/torchrun (Debian's python3-torch)";
  const Result torchrun = remat::testing::run_shell(
      "/usr/bin/torchrun --no_python -r 1 -t 1 --nproc_per_node 2 --master_port " + std::to_string(free_port()) + " " +
      std::string(remat::testing::kRematBinary) + " train " + common_ + steps + "run.name=torchrun");
  // From PyTorch 2.4 on torchrun's rendezvous asks for the store's libuv backend, and
  // USE_LIBUV=0 does not reach it: a PyTorch built without libuv (Debian sid's 2.14) cannot
  // start torchrun at all, before any rank of remat's runs.
  if (torchrun.exit_code != 0 && torchrun.output.find("PyTorch was built without libuv support") != std::string::npos) {
    GTEST_SKIP() << "this PyTorch's torchrun cannot open its rendezvous store (built without libuv)";
  }
  ASSERT_EQ(torchrun.exit_code, 0) << torchrun.output;
  const auto by_torchrun = train_lines("torchrun");
  ASSERT_EQ(by_torchrun.size(), lines.size());
  for (size_t i = 0; i < lines.size(); ++i) EXPECT_EQ(by_torchrun[i]["loss"], lines[i]["loss"]) << "step " << i + 1;
}

// Tensor parallelism under `remat launch`: two ranks sharing every layer, and four as two
// data-parallel copies of such a pair, train the one-process model. Their first loss sums
// the same terms in other orders; the largest of those sums is the vocabulary's sum of
// exponentials (V = the tokenizer's 512 pieces here), whose reordering moves its log by at
// most 2 gamma_V (Higham 4.2), and the split products move the logits by less (they sum
// d_model or d_ff terms, fewer than V): so |loss - one process| <= 2 gamma_V (1 + loss)
// bounds it, while a rank holding the wrong share is off by far more.
TEST_F(LaunchedTraining, TensorParallelRanksTrainTheOneProcessModel) {
  const std::string steps = " train.steps=2 ";
  const Result single = run_remat("train " + common_ + steps + "run.name=single");
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const double one = train_lines("single").at(0)["loss"];
  for (const int ranks : {2, 4, -2}) {  // -2: two ranks with sequence parallelism
    const std::string name = "tp" + std::to_string(ranks);
    const Result r = run_remat("launch --nproc " + std::to_string(std::abs(ranks)) + " train " + common_ + steps +
                               "parallel.tp=2 run.name=" + name + (ranks < 0 ? " parallel.sp=true" : ""));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each layer split over 2 tensor-parallel ranks"), std::string::npos) << r.output;
    const auto lines = train_lines(name);
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_EQ(lines[0]["rank_peak_bytes"].size(), static_cast<size_t>(std::abs(ranks)));
    const double v = 512, gamma = v * 0x1p-24 / (1 - v * 0x1p-24);
    EXPECT_LE(std::abs(lines[0]["loss"].get<double>() - one), 2 * gamma * (1 + one)) << ranks << " ranks";
    const auto summary = nlohmann::json::parse(read_text(dir_ / "runs" / name / "summary.json"));
    EXPECT_EQ(summary["tp"], 2);
    EXPECT_EQ(summary["ranks"], std::abs(ranks) / 2);
    EXPECT_EQ(summary["sp"], ranks < 0);
    // The weights are written whole: one process samples from them.
    const Result sample = run_remat("generate --run " + (dir_ / "runs" / name).string() + " --tokens 4");
    EXPECT_EQ(sample.exit_code, 0) << sample.output;
  }
  // A layer that does not split evenly is refused before anything starts.
  const Result odd =
      run_remat("launch --nproc 2 train " + common_ + steps + "parallel.tp=2 model.n_head=1 model.n_kv_head=1");
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.output.find("parallel.tp = 2 gives each tensor-parallel rank an equal share of model.n_head = 1"),
            std::string::npos)
      << odd.output;
}

// A launched rank's step peak against its prediction: the shape's activations dwarf the
// slack (32 KiB, eight times the prediction's allowance for small tensors), and the peak is in
// the loss head, where Gloo's worker once held a reduced activation past its collective,
// about 1,000,000 bytes above the plan on one rank or the other (3 runs in 3).
const std::string kPeakShape =
    " model.preset=gpt2-demo model.vocab_size=2048 train.batch=16 train.seq=128 "
    "ac.profile=false ";
constexpr int64_t kPeakSlack = 32 * 1024;

// Every tensor-parallel rank peaks where the planner said, at that shape; the same with
// sequence parallelism, keeping or gathering again the column linears' inputs, and
// without it, keeping the inputs of uniform chunks as a share per rank.
TEST_F(LaunchedTraining, TensorParallelRanksPeakWhereThePlannerSaid) {
  const std::vector<std::string> policies{
      "ac.policy=none",
      "ac.policy=full",
      "ac.policy=none parallel.sp=true",
      "ac.policy=full parallel.sp=true",
      "ac.policy=none parallel.sp=true ac.tp_recompute_allgather=true",
      "ac.recompute_granularity=full ac.recompute_method=uniform ac.recompute_num_layers=2 "
      "ac.distribute_saved_activations=true"};
  for (size_t i = 0; i < policies.size(); ++i) {
    const std::string& policy = policies[i];
    const std::string name = "peak-" + std::to_string(i);
    const Result r = run_remat("launch --nproc 2 train " + common_ + kPeakShape + "train.steps=3 parallel.tp=2 " +
                               policy + " run.name=" + name);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto summary = nlohmann::json::parse(read_text(dir_ / "runs" / name / "summary.json"));
    const int64_t predicted = summary["predicted_peak_bytes"];
    for (const int64_t peak : summary["rank_peak_bytes"]) EXPECT_NEAR(peak, predicted, kPeakSlack) << policy;
  }
}

// ZeRO-1 to 3 over two data-parallel ranks, at the peak tests' shape: each rank keeps AdamW's
// moments of its share of the parameters (cost::zero_owners), at 2 their gradients, at 3
// their masters. What rank 0 holds after a step (its metrics' memory_bytes) drops by exactly
// the two float32 moments of the parameters it does not own, then by their gradients, then
// by their masters; the prediction by
// those of the busiest rank's complement; and every rank still peaks at the prediction
// within the tensor-parallel test's slack, with a plan the planner solved for a budget too,
// on two data-parallel copies of a sequence-parallel pair, on four data-parallel ranks
// whose shares differ, each at its own prediction, and on two copies of a two-stage
// pipeline; at stage 3 with a budget plan and with uniform chunks too, whose recompute
// gathers the weights again, and with every layer keeping its gathered weights to its
// backward (alone, and beside the MLP's recompute, by torchtitan's key). The weights of two
// data-parallel ranks are stage 0's, byte for byte.
TEST_F(LaunchedTraining, ZeroShardsTheStatesAndPeaksWhereThePlannerSaid) {
  const remat::ModelConfig demo = [] {
    remat::ModelConfig m = remat::model_preset("gpt2-demo");
    m.vocab_size = 2048;
    return m;
  }();
  std::vector<int64_t> numels;
  const auto model = remat::Model::create(demo, at::kCPU, at::kFloat, 1);  // held: the loop reads its parameters
  for (const remat::Param& p : model->params()) {
    numels.push_back(p.value.numel());
  }
  const std::vector<int> owner = remat::cost::zero_owners(numels, 2);
  int64_t all = 0, load[2] = {0, 0};
  for (size_t i = 0; i < numels.size(); ++i) {
    all += numels[i];
    load[owner[i]] += numels[i];
  }
  std::map<std::string, nlohmann::json> summary, last;
  const std::vector<std::pair<std::string, int>> runs{{"parallel.zero=0", 2},
                                                      {"parallel.zero=1", 2},
                                                      {"parallel.zero=2", 2},
                                                      {"parallel.zero=2 ac.budget=0.7", 2},
                                                      {"parallel.zero=2 parallel.tp=2 parallel.sp=true", 4},
                                                      {"parallel.zero=2 parallel.dp=4", 4},
                                                      {"parallel.zero=0 parallel.pp=2", 4},
                                                      {"parallel.zero=2 parallel.pp=2", 4},
                                                      {"parallel.zero=3", 2},
                                                      {"parallel.zero=3 ac.budget=0.7", 2},
                                                      {"parallel.zero=3 ac.policy=uniform:2", 2},
                                                      {"parallel.zero=3 parallel.tp=2 parallel.sp=true", 4},
                                                      {"parallel.zero=3 parallel.pp=2", 4},
                                                      {"parallel.zero=3 parallel.reshard_after_forward=never", 2},
                                                      {"parallel.zero=3 ac.policy='modules:[mlp]' "
                                                       "parallel.fsdp_reshard_after_forward=never",
                                                       2}};
  std::map<std::string, std::string> weights, names;
  for (const auto& [settings, ranks] : runs) {
    const std::string name = "run" + std::to_string(summary.size());
    names[settings] = name;
    const Result r = run_remat("launch --nproc " + std::to_string(ranks) + " train " + common_ + kPeakShape +
                               "train.steps=3 " + settings + " run.name=" + name);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    summary[settings] = nlohmann::json::parse(read_text(dir_ / "runs" / name / "summary.json"));
    weights[settings] = read_text(dir_ / "runs" / name / "model.safetensors");
    last[settings] = train_lines(name).back();
    const std::vector<int64_t> peaks = summary[settings]["rank_peak_bytes"];
    const std::vector<int64_t> predicted = summary[settings]["predicted_rank_peak_bytes"];
    ASSERT_EQ(peaks.size(), static_cast<size_t>(ranks)) << settings;
    ASSERT_EQ(predicted.size(), peaks.size()) << settings;
    for (size_t i = 0; i < peaks.size(); ++i) EXPECT_NEAR(peaks[i], predicted[i], kPeakSlack) << settings << " " << i;
    EXPECT_LE(*std::max_element(predicted.begin(), predicted.end()),
              summary[settings]["predicted_peak_bytes"].get<int64_t>())
        << settings;
  }
  // Four data-parallel ranks own unequal shares: each is predicted its own, not the busiest's.
  const std::vector<int64_t> four = summary["parallel.zero=2 parallel.dp=4"]["predicted_rank_peak_bytes"];
  EXPECT_LT(*std::min_element(four.begin(), four.end()), *std::max_element(four.begin(), four.end()));
  const auto plan_text = [&](const std::string& settings) {
    return std::regex_replace(read_text(dir_ / "runs" / names.at(settings) / "plan.txt"), std::regex("\\s+"), " ");
  };
  EXPECT_NE(plan_text("parallel.zero=1").find("optimizer"), std::string::npos);
  const auto held = [&](const std::string& settings) { return last[settings]["memory_bytes"].get<int64_t>(); };
  EXPECT_EQ(held("parallel.zero=0") - held("parallel.zero=1"), 2 * 4 * (all - load[0]));
  EXPECT_EQ(held("parallel.zero=1") - held("parallel.zero=2"), 4 * (all - load[0]));
  EXPECT_EQ(held("parallel.zero=2") - held("parallel.zero=3"), 4 * (all - load[0]));
  const auto predicted = [&](const std::string& s) { return summary[s]["predicted_peak_bytes"].get<int64_t>(); };
  EXPECT_EQ(predicted("parallel.zero=0") - predicted("parallel.zero=1"), 2 * 4 * (all - std::max(load[0], load[1])));
  EXPECT_LT(predicted("parallel.zero=2 ac.budget=0.7"), predicted("parallel.zero=2"));
  EXPECT_LT(predicted("parallel.zero=3 ac.budget=0.7"), predicted("parallel.zero=3"));
  EXPECT_LT(predicted("parallel.zero=3"), predicted("parallel.zero=2"));
  // The same weights: the runs' losses are the same numbers.
  EXPECT_EQ(summary["parallel.zero=0"]["final_val_loss"], summary["parallel.zero=1"]["final_val_loss"]);
  EXPECT_EQ(summary["parallel.zero=0"]["final_val_loss"], summary["parallel.zero=2"]["final_val_loss"]);
  EXPECT_EQ(summary["parallel.zero=0"]["final_val_loss"], summary["parallel.zero=3"]["final_val_loss"]);
  // Over pipeline stages the tied table's gradient is summed between the stages, then over
  // the ranks, as at stage 0: with two ranks every sum is the same, and so are the weights.
  EXPECT_TRUE(weights["parallel.zero=0 parallel.pp=2"] == weights["parallel.zero=2 parallel.pp=2"]);
  EXPECT_TRUE(weights["parallel.zero=0 parallel.pp=2"] == weights["parallel.zero=3 parallel.pp=2"]);
  EXPECT_TRUE(weights["parallel.zero=0"] == weights["parallel.zero=2"]);
  EXPECT_TRUE(weights["parallel.zero=0"] == weights["parallel.zero=3"]);
  // Weights kept from each layer's forward to its backward hold a layer's gather per layer
  // more, and train the same weights.
  EXPECT_GT(predicted("parallel.zero=3 parallel.reshard_after_forward=never"), predicted("parallel.zero=3"));
  EXPECT_TRUE(weights["parallel.zero=3"] == weights["parallel.zero=3 parallel.reshard_after_forward=never"]);
  // The plan text says so of every layer, its table's lines wrapped where they may, and
  // names the kept weights live at the peak.
  const std::string text =
      plan_text("parallel.zero=3 ac.policy='modules:[mlp]' parallel.fsdp_reshard_after_forward=never");
  EXPECT_NE(text.find("its gathered weights kept to its backward"), std::string::npos) << text;
  EXPECT_NE(text.find("that layers keep to their backward"), std::string::npos) << text;
}

// `remat bench` under `remat launch`, at the peak tests' shape: two data-parallel ranks, and
// a tensor-parallel pair (alone, with sequence parallelism, and gathering again) run every
// entry together. Rank 0 alone prints the table, with every rank's peak beside the
// prediction, and writes the files; each rank peaks within the slack of it, and a
// tensor-parallel rank keeps the saved activations predicted for its share.
TEST_F(LaunchedTraining, BenchGivesEveryRanksPeakBesideItsPrediction) {
  struct Case {
    std::string settings;
    int dp, tp;
    bool sp;
    std::string header;
  };
  const std::vector<Case> cases{
      {"", 2, 1, false, "steps of 16 x 128 tokens x 1 accum, data parallel over 2 ranks of 8 sequences;"},
      {"parallel.tp=2", 1, 2, false, "accum, each layer split over 2 tensor-parallel ranks;"},
      {"parallel.tp=2 parallel.sp=true", 1, 2, true, "tensor-parallel ranks, and the positions between them"},
      {"parallel.tp=2 parallel.sp=true ac.tp_recompute_allgather=true", 1, 2, true, "(parallel.sp);"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const fs::path out = dir_ / ("bench" + std::to_string(i));
    const Result r = run_remat("launch --nproc 2 bench --policies 'none;full' --warmup 1 --steps 2 --out " +
                               out.string() + " " + common_ + kPeakShape + c.settings);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count(r.output, "bench: 2 entries x (1 warm-up + 2 measured) "), 1u) << r.output;
    EXPECT_NE(r.output.find(c.header), std::string::npos) << r.output;
    for (const std::string entry : {"none", "full"}) {
      EXPECT_TRUE(std::regex_search(r.output, std::regex("\n" + entry + R"( peaks per rank: rank 0 [\d.]+ [KM]iB, )" +
                                                         R"(rank 1 [\d.]+ [KM]iB \(each predicted [\d.]+ [KM]iB\)\n)")))
          << entry << ": " << r.output;
      EXPECT_EQ(count(r.output, entry + " peaks per rank:"), 1u) << "rank 0 alone reports: " << r.output;
    }
    EXPECT_EQ(r.output.find("warning"), std::string::npos) << r.output;

    const auto json = nlohmann::json::parse(read_text(out / "bench.json"));
    EXPECT_EQ(json["ranks"]["dp"], c.dp);
    EXPECT_EQ(json["ranks"]["tp"], c.tp);
    EXPECT_EQ(json["ranks"]["sp"], c.sp);
    EXPECT_TRUE(json["losses_equal"].get<bool>()) << c.settings;
    ASSERT_EQ(json["rows"].size(), 2u);
    for (const auto& row : json["rows"]) {
      EXPECT_EQ(row["step_seconds"].size(), 2u);
      // A data-parallel rank's token ids are its own copy of its rows: the measure, which
      // counts the storage a saved tensor keeps alive, sees no other rank's.
      EXPECT_EQ(row["activation_bytes"], row["predicted_activation_bytes"]) << c.settings << " " << row["entry"];
      const int64_t predicted = row["predicted_peak_bytes"];
      ASSERT_EQ(row["rank_peak_bytes"].size(), 2u);
      for (const int64_t peak : row["rank_peak_bytes"]) {
        EXPECT_NEAR(peak, predicted, kPeakSlack) << c.settings << " " << row["entry"];
      }
      EXPECT_EQ(row["peak_bytes"],
                std::max(row["rank_peak_bytes"][0].get<int64_t>(), row["rank_peak_bytes"][1].get<int64_t>()));
    }
    // Every step of both entries, each with both ranks' peaks.
    std::ifstream metrics(out / "metrics.jsonl");
    size_t steps = 0;
    for (std::string line; std::getline(metrics, line); ++steps) {
      EXPECT_EQ(nlohmann::json::parse(line)["rank_peak_bytes"].size(), 2u) << line;
    }
    EXPECT_EQ(steps, 2u * 3u);
  }
}

// One of four ranks killed in the middle of training: the other three stop within
// parallel.timeout, each with the sentence naming it and the operation, instead of
// waiting for ever.
TEST_F(LaunchedTraining, ADeadRankStopsTheOthersWithASentence) {
  constexpr int kRanks = 4, kKilled = 2;
  const int port = free_port();
  const std::string settings = "train.steps=100000 parallel.timeout=60 run.name=dead";
  std::vector<pid_t> pids;
  for (int r = 0; r < kRanks; ++r) pids.push_back(start_rank(r, kRanks, port, settings));
  // Until rank 0 logs a step (or ends, which the expectations below then report).
  while (train_lines("dead").empty() && ::waitpid(pids[0], nullptr, WNOHANG) == 0) ::usleep(10000);
  ::kill(pids[kKilled], SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  EXPECT_EQ(wait_exit(pids[kKilled]), 128 + SIGKILL);
  for (int r = 0; r < kRanks; ++r) {
    if (r == kKilled) continue;
    const std::string log_name = "log" + std::to_string(r);
    EXPECT_EQ(wait_exit(pids[static_cast<size_t>(r)]), 1) << read_text(dir_ / log_name);
    const std::string log = read_text(dir_ / log_name);
    EXPECT_TRUE(std::regex_search(log, std::regex(R"(error: rank 2 stopped answering during [a-z -]+ of step \d+)")))
        << "rank " << r << ": " << log;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 20s);
}

// A job of two ranks whose rank is SIGKILLed twice, at seeded random moments once a
// checkpoint exists (one is written every step, so kills also land inside a write; the
// second in the restarted job's ranks, not in a rank of the first still stopping), is
// started again by `remat launch --max-restarts`, and each restart continues the run from
// its newest whole checkpoint: the weights and every logged loss are bitwise those of the
// job never killed, in data parallel and in pipeline parallel.
TEST_F(LaunchedTraining, ARestartedJobEndsBitwiseAsTheUninterruptedOne) {
  std::mt19937 rng(52);
  for (const std::string layout : {"", "parallel.pp=2 "}) {
    SCOPED_TRACE(layout);
    const std::string settings = " " + layout + "train.steps=40 train.checkpoint_every=1 train.eval_every=100 ";
    const std::string tag = layout.empty() ? "dp" : "pp";
    const Result whole = run_remat("launch --nproc 2 train " + common_ + settings + "run.name=whole-" + tag);
    ASSERT_EQ(whole.exit_code, 0) << whole.output;

    const fs::path log = dir_ / ("restart-" + tag + ".log"), run = dir_ / "runs" / ("cut-" + tag);
    const pid_t launcher = remat::testing::start_shell("exec " + std::string(remat::testing::kRematBinary) +
                                                           " launch --nproc 2 --max-restarts 3 train " + common_ +
                                                           settings + "run.name=cut-" + tag,
                                                       log);
    // The steps logged so far: whole lines only, since the run is appending to the file.
    const auto logged = [&] {
      std::ifstream in(run / "metrics.jsonl");
      int steps = 0;
      for (std::string line; std::getline(in, line) && !in.eof();) {
        if (line.find("\"kind\":\"train\"") != std::string::npos) ++steps;
      }
      return steps;
    };
    int after = 0;                  // the kill comes once the run has logged a step past this one
    std::vector<pid_t> killed_job;  // the ranks of the job killed last: the next kill waits for new ones
    const auto of_killed_job = [&](const std::vector<pid_t>& ranks) {
      return std::any_of(ranks.begin(), ranks.end(), [&](pid_t p) {
        return std::find(killed_job.begin(), killed_job.end(), p) != killed_job.end();
      });
    };
    for (int kill = 0; kill < 2; ++kill) {
      after = std::uniform_int_distribution<int>(after + 2, after + 12)(rng);
      std::vector<pid_t> ranks;
      while ((ranks.size() != 2 || of_killed_job(ranks) || logged() <= after || !fs::exists(run / "checkpoints")) &&
             ::waitpid(launcher, nullptr, WNOHANG) == 0) {
        ::usleep(1000);
        ranks = ranks_of(launcher);
      }
      ::usleep(std::uniform_int_distribution<useconds_t>(0, 50000)(rng));
      ASSERT_EQ(ranks.size(), 2u) << read_text(log);
      ::kill(ranks[std::uniform_int_distribution<size_t>(0, 1)(rng)], SIGKILL);
      killed_job = ranks;
    }
    ASSERT_EQ(wait_exit(launcher, 300s), 0) << read_text(log);
    const std::string output = read_text(log);
    EXPECT_EQ(count(output, "remat launch: starting the job again"), 2u) << output;
    for (const char* restart : {"1", "2"}) {
      const std::regex line(std::string(R"(remat launch: starting the job again \(restart )") + restart +
                            R"( of 3\) because rank [01] \(pid \d+\) was killed by signal 9)");
      EXPECT_TRUE(std::regex_search(output, line)) << output;
    }
    EXPECT_NE(output.find("continuing " + run.string() + " from its newest whole checkpoint"), std::string::npos)
        << output;
    const auto losses = [&](const std::string& name) {
      std::vector<double> out;
      for (const auto& line : train_lines(name)) out.push_back(line["loss"].get<double>());
      return out;
    };
    EXPECT_EQ(losses("cut-" + tag), losses("whole-" + tag));
    EXPECT_EQ(read_text(run / "model.safetensors"), read_text(dir_ / "runs" / ("whole-" + tag) / "model.safetensors"));
  }
}

// A rank that never comes: the one that did stops after parallel.timeout, naming it.
TEST_F(LaunchedTraining, ARankThatNeverJoinsIsNamedAfterTheTimeout) {
  const pid_t lead = start_rank(0, 2, free_port(), "train.steps=3 parallel.timeout=5 run.name=alone");
  EXPECT_EQ(wait_exit(lead), 1);
  const std::string log = read_text(dir_ / "log0");
  EXPECT_NE(log.find("rank 1 of 2 did not join within parallel.timeout = 5 s"), std::string::npos) << log;
}

}  // namespace
