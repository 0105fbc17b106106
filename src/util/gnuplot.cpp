#include "util/gnuplot.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

namespace remat::util {
namespace {

// A single-quoted word for sh: ' becomes '\''.
std::string sh_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

std::string gnuplot_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      throw std::invalid_argument(
          fmt::format("The plot text '{}' holds a control character (byte {:#04x}); plot "
                      "titles and labels must be printable.",
                      s, static_cast<unsigned char>(c)));
    }
    out += c == '\'' ? std::string("''") : std::string(1, c);
  }
  return out + "'";
}

bool run_gnuplot(const std::string& script, const std::string& output, const std::string& log, std::string* why) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    *why = "gnuplot is not installed (apt-get install gnuplot-nox)";
    return false;
  }
  // `-c FILE ARGS` runs FILE with ARGS as ARG1..; the script arrives on stdin.
  const std::string command =
      fmt::format("gnuplot -c /dev/stdin {} 2>{}", sh_quote(std::filesystem::absolute(output).string()),
                  log.empty() ? "/dev/null" : sh_quote(log));
  std::FILE* pipe = popen(command.c_str(), "w");
  if (pipe == nullptr) {
    *why = "could not start gnuplot";
    return false;
  }
  std::fwrite(script.data(), 1, script.size(), pipe);
  const bool ok = pclose(pipe) == 0;
  std::error_code ec;
  if (ok && !log.empty()) std::filesystem::remove(log, ec);
  if (!ok) *why = log.empty() ? "gnuplot failed" : fmt::format("gnuplot failed (see {})", log);
  return ok;
}

}  // namespace remat::util
