// A one-line progress bar for long loops (fmt only; no dependency ships one).
//
// On a terminal the line redraws in place; otherwise (logs, CI) a plain line is printed
// every `total / 20` steps so the log stays short but shows the curve.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace remat {

class ProgressBar {
 public:
  /// `enabled` false prints nothing but messages.
  ProgressBar(int64_t total, bool enabled, std::FILE* out = stderr);
  /// Shows `done` of `total` with a free-form status (e.g. "loss 3.21 | 5.1k tok/s").
  void update(int64_t done, const std::string& status);
  /// Prints a line above the bar (the bar is redrawn after it).
  void message(const std::string& line);
  /// Ends the bar's line.
  void finish();

 private:
  void draw(bool force);
  int64_t total_;
  bool enabled_;
  bool tty_;
  std::FILE* out_;
  int64_t done_ = 0;
  int64_t last_plain_ = -1;
  std::string status_;
  std::chrono::steady_clock::time_point start_;
  bool drawn_ = false;
};

/// "1:05" / "1:02:03" rendering of seconds.
std::string format_duration(double seconds);
/// "5.1k" / "2.3M" rendering of a count.
std::string format_count(double v);

}  // namespace remat
