// How much of the machine's CPU time other processes took while this one timed something:
// a time measured beside other work can be several times slow, and it tells those from
// times taken on an idle machine.
#pragma once

#include <optional>
#include <string>

namespace remat::util {

/// One reading of the clocks: the machine's busy CPU time, this process's CPU time and the
/// wall time, each in seconds since some fixed point. Two readings bound a window.
struct CpuTimes {
  /// Every CPU's time in any state but idle and iowait (/proc/stat's first line); unknown
  /// where /proc/stat cannot be read (not Linux, a sandbox), which is not zero load.
  std::optional<double> machine_busy_seconds;
  double own_seconds = 0;   ///< this process's user and system time, all its threads
  double wall_seconds = 0;  ///< a steady clock
};

/// The clocks now.
CpuTimes read_cpu_times();

/// The busy seconds of /proc/stat's `text` (user, nice, system, irq, softirq and steal of
/// its first line, in clock ticks of `ticks_per_second`; guest time is already in user),
/// or nothing where its first line is not the "cpu" line.
std::optional<double> proc_stat_busy_seconds(const std::string& text, double ticks_per_second);

/// The CPUs other processes used on average between `from` and `to`: the machine's busy
/// time less `job_seconds`, the CPU time of this job's own processes over the window
/// (this one's alone: to.own_seconds - from.own_seconds), per second of wall time; never
/// negative (the clocks count whole ticks). Unknown where either reading lacks the
/// machine's time.
std::optional<double> other_cpus(const CpuTimes& from, const CpuTimes& to, double job_seconds);

/// The most CPUs other processes may use beside a job running `job_threads` threads on a
/// machine of `machine_cpus` for `wall_seconds` before its times are suspect.
///
/// Other processes take no time from the job while they fit on the CPUs its threads leave
/// free. Beyond those, each runs on a CPU one of the job's threads needs, and every parallel
/// region waits for its slowest thread: with run.threads = 2 on 2 CPUs any busy process
/// stalls every region. Half a CPU beyond the free ones is tolerated: a desktop's background
/// (an editor, a browser, tenths of a CPU) costs a step little, while what makes a step
/// several times slow (a build, another training run) keeps a CPU or more busy. The window's
/// busy time is counted in whole clock ticks, up to one short in each of its six states:
/// that much more is tolerated, which matters only for windows of a fraction of a second.
double tolerated_other_cpus(int machine_cpus, int job_threads, double wall_seconds);

/// The CPUs of this machine, as /proc/stat counts them (the online ones).
int machine_cpus();

/// Why a run's measured step time (`measured`, seconds) missed its prediction (`predicted`)
/// by more than 10%, as far as load tells: how many CPUs other processes kept busy while it
/// trained (`run_other`) and while its time profile was measured (`profile_other`; unknown
/// where cached or not measured), against the `tolerated` beyond which they slow its
/// threads, and whether that explains the miss (a slower step measured under load, or a
/// prediction from a profile measured under load, the other idle). "" within 10%.
std::string load_explanation(double predicted, double measured, std::optional<double> run_other,
                             std::optional<double> profile_other, double tolerated, int machine_cpus);

}  // namespace remat::util
