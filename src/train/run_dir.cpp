#include "train/run_dir.h"

#include "util/gnuplot.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <numeric>
#include <stdexcept>

namespace fs = std::filesystem;

namespace remat {
using util::gnuplot_quote;

RunDir::RunDir(const std::string& out_dir, const std::string& name, const std::string& preset) {
  const std::string base = name.empty() ? fmt::format("{}-{}", timestamp(), preset) : name;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) {
    throw std::runtime_error(fmt::format("Cannot create the run output directory {}: {}.", out_dir, ec.message()));
  }
  path_ = out_dir + "/" + base;
  for (int i = 2; fs::exists(path_); ++i) path_ = fmt::format("{}/{}-{}", out_dir, base, i);
  fs::create_directories(path_);
  metrics_.open(file("metrics.jsonl"));
  if (!metrics_) throw std::runtime_error(fmt::format("Cannot write {}.", file("metrics.jsonl")));
}

RunDir::RunDir(const std::string& path) : path_(path) {
  metrics_.open(file("metrics.jsonl"), std::ios::app);
  if (!metrics_) throw std::runtime_error(fmt::format("Cannot append to {}.", file("metrics.jsonl")));
}

std::string RunDir::timestamp() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  return stamp;
}

void RunDir::log_metrics(const nlohmann::json& record) {
  metrics_ << record.dump() << '\n';
  metrics_.flush();
}

void RunDir::write_text(const std::string& name, const std::string& text) const {
  std::ofstream out(file(name));
  out << text;
  if (!out) throw std::runtime_error(fmt::format("Cannot write {}.", file(name)));
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
    script += fmt::format("set label {} {} at {},{} offset 1,{} font ',9'\n", rank + 1, gnuplot_quote(p.label), p.x, p.y,
                          rank % 2 == 0 ? "0.7" : "-0.7");
  }
  script += "$points << EOD\n";
  for (const auto& p : points) script += fmt::format("{} {}\n", p.x, p.y);
  script += "EOD\nplot $points using 1:2 with points pt 7 ps 1.5 lc rgb '#d04020'\n";
  return util::run_gnuplot(script, file(name), file("gnuplot.log"), why);
}

}  // namespace remat
