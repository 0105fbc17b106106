// A run's directory: resolved config, metrics JSONL, weights, tokenizer, sample, plots.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
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

class RunDir {
 public:
  /// Creates `<out_dir>/<name>` (name empty: "<YYYYmmdd-HHMMSS>-<preset>"; an existing
  /// directory gets a numeric suffix rather than being overwritten).
  RunDir(const std::string& out_dir, const std::string& name, const std::string& preset);
  /// Opens the existing run directory `path` to continue it: metrics are appended.
  explicit RunDir(const std::string& path);

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

  /// Appends one JSON object as a line of metrics.jsonl (flushed: a crash keeps it).
  void log_metrics(const nlohmann::json& record);
  /// Writes a whole text file in the run directory.
  void write_text(const std::string& name, const std::string& text) const;

  /// Renders loss.png with gnuplot: train and validation loss per step, and a dashed
  /// reference line. Returns false, with `why` set, when gnuplot is missing or fails.
  bool plot_loss(const std::vector<std::pair<int64_t, double>>& train,
                 const std::vector<std::pair<int64_t, double>>& val, double reference_loss,
                 std::string* why) const;

  /// Renders `name` (a PNG) with gnuplot: one labelled point per entry of `points`, both
  /// axes from 0 so that distances read as ratios. Returns false, with `why` set, when
  /// gnuplot is missing or fails.
  bool plot_points(const std::string& name, const std::string& title, const std::string& xlabel,
                   const std::string& ylabel, const std::vector<PlotPoint>& points, std::string* why) const;

  /// The local time as "YYYYmmdd-HHMMSS", the stamp of default directory names.
  static std::string timestamp();

 private:
  std::string path_;
  std::ofstream metrics_;
};

}  // namespace remat
