// Running the `remat` binary and other processes from tests, and their output.
#pragma once

#include "util/paths.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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
  // Appended in place: GCC 12 misreads an inlined operator+ on a temporary as out of bounds.
  std::string cmd = remat::testing::kRematBinary;
  cmd.append(" ").append(args);
  return run_shell(cmd, cwd);
}

/// Starts the shell command `cmd` as a child of this process, its stdout and stderr
/// written to `log`, with the "NAME=value" strings of `env` added to its environment;
/// returns its pid (-1 when fork fails). Prefix `cmd` with `exec ` for the pid to become
/// the command's own.
inline pid_t start_shell(const std::string& cmd, const std::filesystem::path& log,
                         const std::vector<std::string>& env = {}) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    for (const std::string& var : env) ::putenv(const_cast<char*>(var.c_str()));
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

/// How `pid` (a child of this process) ended, as a shell's exit code; -1, after a
/// SIGKILL, if it is still running after `limit`.
inline int wait_exit(pid_t pid, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
  const auto step = std::chrono::milliseconds(10);
  for (auto waited = std::chrono::milliseconds(0); waited < limit; waited += step) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(step);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

/// A file's bytes ("" when it cannot be read).
inline std::string read_text(const std::filesystem::path& path) {
  std::ostringstream s;
  s << std::ifstream(path, std::ios::binary).rdbuf();
  return s.str();
}

}  // namespace remat::testing
