// How busy other processes kept the machine: /proc/stat's busy states, the job's own time
// taken off, per wall second; and how much of that a job's threads tolerate.
#include "util/cpu_load.h"

#include <gtest/gtest.h>

#include <csignal>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace remat::util {
namespace {

TEST(CpuLoad, CountsTheBusyStatesOfProcStatsFirstLine) {
  // user nice system idle iowait irq softirq steal guest guest_nice, at 100 ticks a second.
  const std::string stat = "cpu  100 20 30 400 50 6 7 8 9 10\ncpu0 50 10 15 200 25 3 3 4 4 5\n";
  EXPECT_DOUBLE_EQ(proc_stat_busy_seconds(stat, 100).value(), (100 + 20 + 30 + 6 + 7 + 8) / 100.0);
  EXPECT_DOUBLE_EQ(proc_stat_busy_seconds(stat, 250).value(), (100 + 20 + 30 + 6 + 7 + 8) / 250.0);
  // Not the machine's line, or cut short: no reading, rather than a wrong one.
  EXPECT_FALSE(proc_stat_busy_seconds("cpu0 50 10 15 200 25 3 3 4 4 5", 100));
  EXPECT_FALSE(proc_stat_busy_seconds("cpu  100 20 30 400 50 6", 100));
  EXPECT_FALSE(proc_stat_busy_seconds("", 100));
}

TEST(CpuLoad, OtherCpusAreTheMachinesBusyTimeLessTheJobsPerWallSecond) {
  const CpuTimes from{10.0, 1.0, 100.0};
  // Over 2 s the machine was busy 5 CPU seconds, 1.5 of them the job's.
  EXPECT_DOUBLE_EQ(other_cpus(from, {15.0, 2.5, 102.0}, 1.5).value(), (5.0 - 1.5) / 2.0);
  // A job of several processes counts all of theirs, not this one's alone.
  EXPECT_DOUBLE_EQ(other_cpus(from, {15.0, 2.5, 102.0}, 3.0).value(), (5.0 - 3.0) / 2.0);
  // The busy time is counted in whole ticks and may come out below the job's: none, not less.
  EXPECT_EQ(other_cpus(from, {10.5, 2.0, 101.0}, 1.0).value(), 0.0);
  // Without the machine's time the load is unknown, not zero.
  EXPECT_FALSE(other_cpus({std::nullopt, 1.0, 100.0}, {15.0, 2.0, 101.0}, 1.0));
  EXPECT_FALSE(other_cpus(from, {std::nullopt, 2.0, 101.0}, 1.0));
}

TEST(CpuLoad, ThreadsThatLeaveCpusFreeTolerateOthersOnThem) {
  const double tick = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  const double long_window = 1e6;  // the ticks' share vanishes
  // Threads on every CPU: any busy process stalls their parallel regions; half a CPU is slack.
  EXPECT_NEAR(tolerated_other_cpus(2, 2, long_window), 0.5, 1e-4);
  EXPECT_NEAR(tolerated_other_cpus(2, 4, long_window), 0.5, 1e-4);
  // One thread on two CPUs leaves one free; on sixteen, fifteen.
  EXPECT_NEAR(tolerated_other_cpus(2, 1, long_window), 1.5, 1e-4);
  EXPECT_NEAR(tolerated_other_cpus(16, 1, long_window), 15.5, 1e-4);
  // A short window adds the six busy states' lost ticks, per second of it.
  EXPECT_NEAR(tolerated_other_cpus(2, 2, 0.1) - tolerated_other_cpus(2, 2, 1.0), 6 * tick / 0.1 - 6 * tick, 1e-9);
}

// On the real machine, a child process spinning inside the window is other processes' time:
// at least its own CPU time is counted (less the ticks the reading may lose), however busy
// the machine is beside it, and never more CPUs than the machine has.
TEST(CpuLoad, ASpinningChildIsCountedAsOtherProcesses) {
  const CpuTimes from = read_cpu_times();
  if (!from.machine_busy_seconds) GTEST_SKIP() << "/proc/stat cannot be read here";
  rusage before{};
  getrusage(RUSAGE_CHILDREN, &before);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    volatile uint64_t spin = 0;
    for (;;) spin = spin + 1;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  kill(child, SIGKILL);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const CpuTimes to = read_cpu_times();
  rusage after{};
  getrusage(RUSAGE_CHILDREN, &after);
  const auto secs = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  };
  const double child_seconds =
      secs(after.ru_utime) + secs(after.ru_stime) - secs(before.ru_utime) - secs(before.ru_stime);
  const double wall = to.wall_seconds - from.wall_seconds;
  const double lost = 6.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  const double other = other_cpus(from, to, to.own_seconds - from.own_seconds).value();
  EXPECT_GE(other * wall, child_seconds - lost) << "the child ran " << child_seconds << " s of " << wall << " s";
  EXPECT_LE(other, machine_cpus() + lost / wall);
}

// A step 281% over its prediction on a busy machine said nothing more: the report now
// says what load there was and whether it explains the miss, each way.
TEST(CpuLoad, AMissedPredictionIsExplainedByTheLoadOrNot) {
  EXPECT_EQ(load_explanation(1.0, 1.09, 3.0, 0.0, 0.5, 2), "");
  EXPECT_EQ(load_explanation(1.0, 0.91, std::nullopt, std::nullopt, 0.5, 2), "");
  EXPECT_EQ(load_explanation(1.0, 3.81, 1.9, 0.1, 0.5, 2),
            "Other processes kept 1.9 of this machine's 2 CPUs busy while the run trained and 0.1 while its time "
            "profile was measured (more than 0.5 slows its threads): that load, not the plan, explains the slower "
            "steps; train on an idle machine to hold the prediction to account.");
  EXPECT_EQ(load_explanation(1.0, 0.5, 0.0, 1.5, 0.5, 2),
            "Other processes kept 0.0 of this machine's 2 CPUs busy while the run trained and 1.5 while its time "
            "profile was measured (more than 0.5 slows its threads): that load, not the plan, explains the faster "
            "steps; train on an idle machine to hold the prediction to account.");
  EXPECT_EQ(load_explanation(1.0, 1.5, 0.2, std::nullopt, 0.5, 2),
            "Other processes kept 0.2 of this machine's 2 CPUs busy while the run trained (more than 0.5 slows its "
            "threads): the load does not explain the miss.");
  // Load on both sides, or a faster step on a busy machine: the times say little.
  EXPECT_EQ(load_explanation(1.0, 0.5, 1.9, std::nullopt, 0.5, 2),
            "Other processes kept 1.9 of this machine's 2 CPUs busy while the run trained (more than 0.5 slows its "
            "threads): measured beside other work, the steps and the prediction say little of each other; train on "
            "an idle machine to hold the prediction to account.");
  EXPECT_NE(load_explanation(1.0, 1.5, 1.9, 1.9, 0.5, 2).find("measured beside other work"), std::string::npos);
  EXPECT_EQ(load_explanation(1.0, 1.5, std::nullopt, 0.1, 0.5, 2),
            "This machine's CPU time could not be read from /proc/stat, so whether other processes explain the miss "
            "is not known.");
}

}  // namespace
}  // namespace remat::util
