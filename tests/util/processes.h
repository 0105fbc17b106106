// Running the `remat` binary and other processes from tests: their output, and a
// scratch directory per test.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace remat::testing {

struct Result {
  int exit_code;       ///< as a shell reports it: 128 + the signal for a killed process
  std::string output;  ///< stdout and stderr together
};

/// Runs the shell command `cmd` (in `cwd` when it is given) with stderr joined to stdout.
inline Result run_shell(const std::string& cmd, const std::filesystem::path& cwd = {}) {
  const std::string full = (cwd.empty() ? "" : "cd '" + cwd.string() + "' && ") + cmd + " 2>&1";
  std::FILE* pipe = popen(full.c_str(), "r");
  Result r{-1, ""};
  std::array<char, 4096> buf{};
  for (size_t n = 0; (n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0;) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

/// `remat ARGS`, the binary this build made.
inline Result run_remat(const std::string& args, const std::filesystem::path& cwd = {}) {
  return run_shell(std::string(REMAT_BINARY) + " " + args, cwd);
}

/// A fresh directory for the running test, named by `prefix`, the process and the test.
inline std::filesystem::path test_dir(const std::string& prefix) {
  const auto dir = std::filesystem::temp_directory_path() /
                   (prefix + std::to_string(::getpid()) + "-" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  return dir;
}

/// A file's bytes ("" when it cannot be read).
inline std::string read_text(const std::filesystem::path& path) {
  std::ostringstream s;
  s << std::ifstream(path, std::ios::binary).rdbuf();
  return s.str();
}

}  // namespace remat::testing
