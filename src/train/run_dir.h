// A run's directory: resolved config, metrics JSONL, weights, tokenizer, sample, plots.
#pragma once

#include "util/atomic_file.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace remat {

/// One labelled point of a scatter plot.
struct PlotPoint {
  double x = 0;
  double y = 0;
  std::string label;
};

/// One process's ownership of a run directory: an exclusive flock on "<dir>/remat.lock",
/// which holds the owner's pid, kept until this object is destroyed (or the process ends,
/// however it ends: the kernel releases the lock). A second owner is refused with a
/// sentence naming the first one's pid.
class RunLock {
 public:
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

/// The settings a resumed run may change: run.sample_tokens, run.prompt and run.progress,
/// which change only what it writes after its last step and its display. A resumed run
/// whose config.toml changed other keys since its checkpoint was written says which.
const std::vector<std::string>& resume_settings();

/// Which start of a job this process is, as its launcher says (torchrun's variables, which
/// `remat launch` sets too): a restarted train continues the run its job's first start made.
struct JobStart {
  int restart = 0;       ///< TORCHELASTIC_RESTART_COUNT: 0 for the first start
  int max_restarts = 0;  ///< TORCHELASTIC_MAX_RESTARTS: the starts again the launcher allows
  std::string run_id;    ///< TORCHELASTIC_RUN_ID: the job's id, the same on every start
};
/// JobStart from `getenv` (unset variables: a first start of no job); throws a sentence
/// naming a variable that is not a whole number from 0.
JobStart job_start(const std::function<const char*(const char*)>& getenv);
/// job_start of this process's environment.
JobStart job_start();

/// The file of a run directory naming the job that made it (TORCHELASTIC_RUN_ID), written
/// when the job may restart (TORCHELASTIC_MAX_RESTARTS > 0).
inline constexpr const char* kJobIdFile = "job.id";

/// The run directory under `out_dir` that job `job_id` made (its kJobIdFile says so) and
/// that holds a checkpoint: where a restarted start of the job continues. Empty when there
/// is none (the job failed before its first checkpoint); throws a sentence naming them
/// when several do.
std::string find_job_run(const std::string& out_dir, const std::string& job_id);

class RunDir {
 public:
  /// Creates `<out_dir>/<name>` (name empty: "<YYYYmmdd-HHMMSS>-<preset>") and takes its
  /// lock. The directory is created by this call alone: an existing one, even one another
  /// process creates at the same moment, makes it try "<name>-2", "<name>-3", ...
  RunDir(const std::string& out_dir, const std::string& name, const std::string& preset);
  /// Continues the existing run directory `path`, whose lock the caller already holds
  /// (`lock`, taken before anything in it was read): metrics are appended.
  RunDir(const std::string& path, std::unique_ptr<RunLock> lock);

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

  /// Appends one JSON object as a line of metrics.jsonl (written through: a crash keeps
  /// it). A failed write (a full disk) throws a sentence naming the file and the reason.
  void log_metrics(const nlohmann::json& record);
  /// Writes a whole text file in the run directory, atomically; throws a sentence when it
  /// cannot be written whole.
  void write_text(const std::string& name, const std::string& text) const;

  /// Renders loss.png with gnuplot: train and validation loss per step, and a dashed
  /// reference line. Returns false, with `why` set, when gnuplot is missing or fails.
  bool plot_loss(const std::vector<std::pair<int64_t, double>>& train,
                 const std::vector<std::pair<int64_t, double>>& val, double reference_loss, std::string* why) const;

  /// Renders `name` (a PNG) with gnuplot: one labelled point per entry of `points`, both
  /// axes from 0 so that distances read as ratios. Returns false, with `why` set, when
  /// gnuplot is missing or fails.
  bool plot_points(const std::string& name, const std::string& title, const std::string& xlabel,
                   const std::string& ylabel, const std::vector<PlotPoint>& points, std::string* why) const;

  /// The local time as "YYYYmmdd-HHMMSS", the stamp of default directory names.
  static std::string timestamp();

 private:
  std::string path_;
  std::unique_ptr<RunLock> lock_;
  std::unique_ptr<util::AppendFile> metrics_;
};

}  // namespace remat
