#include "train/run_dir.h"

#include "train/checkpoints.h"
#include "util/gnuplot.h"
#include "util/utf8.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <stdexcept>

namespace fs = std::filesystem;

namespace remat {
using util::gnuplot_quote;

RunLock::RunLock(const std::string& dir) {
  const std::string path = dir + "/remat.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) {
    throw std::runtime_error(
        fmt::format("Cannot open the lock file {}: {}; a run directory must be writable.", path, std::strerror(errno)));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    char text[32] = {};
    const ssize_t n = ::pread(fd_, text, sizeof text - 1, 0);
    const std::string pid = n > 0 ? std::string(text, static_cast<size_t>(n)) : "";
    ::close(fd_);
    if (error == EWOULDBLOCK) {
      throw std::runtime_error(fmt::format(
          "{} is in use by another remat process{}: one process at a time writes a run directory; wait for it to "
          "finish (or stop it) before resuming the run.",
          dir, pid.find_first_not_of("0123456789") == std::string::npos && !pid.empty() ? " (pid " + pid + ")" : ""));
    }
    throw std::runtime_error(fmt::format("Cannot lock {}: {}.", path, std::strerror(error)));
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const std::string error = std::strerror(errno);
    ::close(fd_);
    throw std::runtime_error(fmt::format("Cannot write the lock file {}: {}.", path, error));
  }
}

RunLock::~RunLock() { ::close(fd_); }

namespace {

// `what` failed on `path` with `ec`: a sentence, not the library's "filesystem error: ...".
[[noreturn]] void cannot(const std::string& what, const std::string& path, const std::error_code& ec,
                         const std::string& hint) {
  throw std::runtime_error(fmt::format("Cannot {} {}: {}; {}", what, path, ec.message(), hint));
}

}  // namespace

const std::vector<std::string>& resume_settings() {
  static const std::vector<std::string> keys = {"run.sample_tokens", "run.prompt", "run.progress"};
  return keys;
}

JobStart job_start(const std::function<const char*(const char*)>& getenv) {
  const auto count = [&](const char* name) {
    const char* text = getenv(name);
    if (text == nullptr || *text == '\0') return 0;
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(text, &end, 10);
    if (errno != 0 || *end != '\0' || v < 0 || v > (1 << 20)) {
      throw std::invalid_argument(fmt::format(
          "The environment variable {} is '{}', but it must be a whole number from 0 to {}; the launcher (remat "
          "launch, torchrun) sets it.",
          name, util::printable(text), 1 << 20));
    }
    return static_cast<int>(v);
  };
  JobStart job;
  job.restart = count("TORCHELASTIC_RESTART_COUNT");
  job.max_restarts = count("TORCHELASTIC_MAX_RESTARTS");
  if (const char* id = getenv("TORCHELASTIC_RUN_ID")) job.run_id = id;
  return job;
}

JobStart job_start() {
  return job_start([](const char* name) { return std::getenv(name); });
}

std::string find_job_run(const std::string& out_dir, const std::string& job_id) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    std::ifstream in(e.path() / kJobIdFile, std::ios::binary);
    // An id is at most a line of 200 characters: a larger file is not one.
    std::string id(256, '\0');
    in.read(id.data(), static_cast<std::streamsize>(id.size()));
    id.resize(static_cast<size_t>(in.gcount()));
    if (id == job_id + "\n" && !list_checkpoints(e.path().string()).empty()) found.push_back(e.path().string());
  }
  if (found.size() > 1) {
    std::sort(found.begin(), found.end());
    throw std::runtime_error(fmt::format(
        "Job {} made several run directories that hold checkpoints ({}), so a restart cannot tell which to continue; "
        "continue one with `remat train --resume DIR`.",
        util::printable(job_id), util::printable(fmt::format("{}", fmt::join(found, ", ")), 2000)));
  }
  return found.empty() ? std::string() : found.front();
}

RunDir::RunDir(const std::string& out_dir, const std::string& name, const std::string& preset) {
  const std::string base = name.empty() ? fmt::format("{}-{}", timestamp(), preset) : name;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) cannot("create the run output directory", out_dir, ec, "set run.out_dir to a writable directory.");
  path_ = out_dir + "/" + base;
  // mkdir fails on an existing directory: whichever process makes it owns it.
  for (int i = 2; ::mkdir(path_.c_str(), 0755) != 0; ++i) {
    if (errno != EEXIST || i > 10000) {
      cannot("create the run directory", path_, std::error_code(errno, std::generic_category()),
             "set run.out_dir to a writable directory.");
    }
    path_ = fmt::format("{}/{}-{}", out_dir, base, i);
  }
  lock_ = std::make_unique<RunLock>(path_);
  metrics_ = std::make_unique<util::AppendFile>(file("metrics.jsonl"), true);
}

RunDir::RunDir(const std::string& path, std::unique_ptr<RunLock> lock) : path_(path), lock_(std::move(lock)) {
  metrics_ = std::make_unique<util::AppendFile>(file("metrics.jsonl"), false);
}

std::string RunDir::timestamp() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  return stamp;
}

void RunDir::log_metrics(const nlohmann::json& record) {
  try {
    metrics_->append(record.dump() + "\n");
  } catch (const std::runtime_error& e) {
    const auto step = record.find("step");
    throw std::runtime_error(fmt::format("{} The metrics{} are lost, so the run stops here; {}.", e.what(),
                                         step != record.end() ? fmt::format(" of step {}", step->dump()) : "",
                                         how_to_continue(path_)));
  }
}

void RunDir::write_text(const std::string& name, const std::string& text) const {
  util::write_file_atomically(file(name), text);
}

bool RunDir::plot_loss(const std::vector<std::pair<int64_t, double>>& train,
                       const std::vector<std::pair<int64_t, double>>& val, double reference_loss,
                       std::string* why) const {
  // Inline data blocks keep the run directory free of scratch files.
  std::string script = fmt::format(
      "set terminal pngcairo size 900,540 noenhanced\nset output ARG1\n"
      "set title 'remat: training loss'\nset xlabel 'step'\nset ylabel 'loss (nats/token)'\nset grid\n"
      "$train << EOD\n");
  for (const auto& [s, l] : train) script += fmt::format("{} {}\n", s, l);
  script += "EOD\n$val << EOD\n";
  for (const auto& [s, l] : val) script += fmt::format("{} {}\n", s, l);
  script += fmt::format(
      "EOD\nplot $train using 1:2 with lines lw 1 lc rgb '#7f9fcf' title 'train', "
      "$val using 1:2 with linespoints lw 2 pt 7 lc rgb '#d04020' title 'validation', "
      "{} with lines dt 2 lc rgb '#404040' title 'unigram entropy of the corpus'\n",
      reference_loss);
  return util::run_gnuplot(script, file("loss.png"), file("gnuplot.log"), why);
}

bool RunDir::plot_points(const std::string& name, const std::string& title, const std::string& xlabel,
                         const std::string& ylabel, const std::vector<PlotPoint>& points, std::string* why) const {
  // Labels as gnuplot labels rather than data columns: policy names hold commas, brackets
  // and colons that a data block would split or misread. The offsets leave room for them.
  std::string script = fmt::format(
      "set terminal pngcairo size 900,540 noenhanced\nset output ARG1\nset title {}\nset xlabel {}\n"
      "set ylabel {}\nset grid\nset key off\nset xrange [0:*]\nset yrange [0:*]\n"
      "set offsets 0, graph 0.25, graph 0.1, 0\n",
      gnuplot_quote(title), gnuplot_quote(xlabel), gnuplot_quote(ylabel));
  // Neighbours along x get their labels on opposite sides, so close points stay readable.
  std::vector<size_t> order(points.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return points[a].x < points[b].x; });
  for (size_t rank = 0; rank < order.size(); ++rank) {
    const PlotPoint& p = points[order[rank]];
    script += fmt::format("set label {} {} at {},{} offset 1,{} font ',9'\n", rank + 1, gnuplot_quote(p.label), p.x,
                          p.y, rank % 2 == 0 ? "0.7" : "-0.7");
  }
  script += "$points << EOD\n";
  for (const auto& p : points) script += fmt::format("{} {}\n", p.x, p.y);
  script += "EOD\nplot $points using 1:2 with points pt 7 ps 1.5 lc rgb '#d04020'\n";
  return util::run_gnuplot(script, file(name), file("gnuplot.log"), why);
}

}  // namespace remat
