#include "util/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>

namespace remat {

ProgressBar::ProgressBar(int64_t total, bool enabled, std::FILE* out)
    : total_(std::max<int64_t>(total, 1)),
      enabled_(enabled),
      tty_(isatty(fileno(out)) != 0),
      out_(out),
      start_(std::chrono::steady_clock::now()) {}

void ProgressBar::update(int64_t done, const std::string& status) {
  done_ = done;
  status_ = status;
  draw(false);
}

void ProgressBar::message(const std::string& line) {
  if (tty_ && drawn_) fmt::print(out_, "\r\033[2K");
  fmt::print(out_, "{}\n", line);
  if (tty_ && drawn_) draw(true);
  std::fflush(out_);
}

void ProgressBar::finish() {
  if (!enabled_) return;
  if (tty_) {
    draw(true);
    fmt::print(out_, "\n");
  } else if (last_plain_ != done_) {
    draw(true);
  }
  std::fflush(out_);
}

void ProgressBar::draw(bool force) {
  if (!enabled_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double frac = static_cast<double>(done_) / static_cast<double>(total_);
  const double eta = done_ > 0 ? elapsed * (1.0 - frac) / frac : 0.0;
  const std::string counter = fmt::format("{:>{}}/{}", done_, fmt::formatted_size("{}", total_), total_);
  if (tty_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(frac * kWidth + 0.5);
    std::string bar;
    for (int i = 0; i < kWidth; ++i) bar += i < filled ? "█" : "░";
    fmt::print(out_, "\r\033[2K{} {} | {} | {} < {}", counter, bar, status_, format_duration(elapsed),
               format_duration(eta));
    drawn_ = true;
    std::fflush(out_);
    return;
  }
  const int64_t every = std::max<int64_t>(1, total_ / 20);
  if (force || done_ == 1 || done_ % every == 0) {
    fmt::print(out_, "{} | {} | {} elapsed\n", counter, status_, format_duration(elapsed));
    last_plain_ = done_;
    std::fflush(out_);
  }
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string format_count(double v) {
  if (v >= 1e9) return fmt::format("{:.1f}G", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.1f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

}  // namespace remat
