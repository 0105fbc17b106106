#include "util/cpu_load.h"

#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

namespace remat::util {
namespace {

// The states /proc/stat's "cpu" line counts busy time in: user, nice, system, irq, softirq
// and steal (idle and iowait, its fourth and fifth, are not busy; guest is within user).
constexpr std::array<size_t, 6> kBusyStates = {0, 1, 2, 5, 6, 7};

double ticks_per_second() { return static_cast<double>(sysconf(_SC_CLK_TCK)); }

double seconds(const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; }

}  // namespace

std::optional<double> proc_stat_busy_seconds(const std::string& text, double ticks_per_second) {
  std::istringstream in(text);
  std::string label;
  in >> label;
  if (label != "cpu" || ticks_per_second <= 0) return std::nullopt;
  std::array<unsigned long long, 8> ticks{};
  for (auto& t : ticks) {
    if (!(in >> t)) return std::nullopt;
  }
  unsigned long long busy = 0;
  for (const size_t state : kBusyStates) busy += ticks[state];
  return static_cast<double>(busy) / ticks_per_second;
}

CpuTimes read_cpu_times() {
  CpuTimes now;
  std::ifstream stat("/proc/stat");
  std::string first;
  if (std::getline(stat, first)) now.machine_busy_seconds = proc_stat_busy_seconds(first, ticks_per_second());
  rusage own{};
  getrusage(RUSAGE_SELF, &own);
  now.own_seconds = seconds(own.ru_utime) + seconds(own.ru_stime);
  now.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return now;
}

std::optional<double> other_cpus(const CpuTimes& from, const CpuTimes& to, double job_seconds) {
  const double wall = to.wall_seconds - from.wall_seconds;
  if (!from.machine_busy_seconds || !to.machine_busy_seconds || wall <= 0) return std::nullopt;
  const double busy = *to.machine_busy_seconds - *from.machine_busy_seconds;
  return std::max(0.0, (busy - job_seconds) / wall);
}

double tolerated_other_cpus(int machine_cpus, int job_threads, double wall_seconds) {
  constexpr double kSlack = 0.5;
  const double free = std::max(0, machine_cpus - job_threads);
  const double ticks = static_cast<double>(kBusyStates.size()) / ticks_per_second();
  return free + kSlack + ticks / wall_seconds;
}

int machine_cpus() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

std::string load_explanation(double predicted, double measured, std::optional<double> run_other,
                             std::optional<double> profile_other, double tolerated, int machine_cpus) {
  const double miss = (measured - predicted) / predicted;
  if (predicted <= 0 || std::abs(miss) <= 0.10) return "";
  if (!run_other) {
    return "This machine's CPU time could not be read from /proc/stat, so whether other processes explain the miss "
           "is not known.";
  }
  const bool run_busy = *run_other > tolerated, profile_busy = profile_other && *profile_other > tolerated;
  const std::string loads = fmt::format(
      "Other processes kept {:.1f} of this machine's {} CPUs busy while the run trained{} (more than {:.1f} slows its "
      "threads)",
      *run_other, machine_cpus,
      profile_other ? fmt::format(" and {:.1f} while its time profile was measured", *profile_other) : "", tolerated);
  if ((miss > 0 && run_busy && !profile_busy) || (miss < 0 && profile_busy && !run_busy)) {
    return loads + fmt::format(
                       ": that load, not the plan, explains the {} steps; train on an idle machine to hold "
                       "the prediction to account.",
                       miss > 0 ? "slower" : "faster");
  }
  if (run_busy || profile_busy) {
    return loads +
           ": measured beside other work, the steps and the prediction say little of each other; train on "
           "an idle machine to hold the prediction to account.";
  }
  return loads + ": the load does not explain the miss.";
}

}  // namespace remat::util
