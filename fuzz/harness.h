// What the harnesses in fuzz/ share: a temporary file for parsers that read a path, and
// the one way a harness reports a finding of its own (libFuzzer saves the input on abort).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

namespace remat::fuzz {

/// A path in the temporary directory named for this harness and process, so that parallel
/// runs, or another user's, never share one.
inline std::string temp_path(const char* harness) {
  return (std::filesystem::temp_directory_path() /
          ("remat-fuzz-" + std::string(harness) + "-" + std::to_string(::getpid())))
      .string();
}

/// The input written to `path` (temp_path's, or one in a TempDir), removed again when the
/// object goes.
class TempFile {
 public:
  TempFile(std::string path, const uint8_t* data, size_t size) : path_(std::move(path)) {
    std::FILE* f = std::fopen(path_.c_str(), "wb");
    if (f == nullptr || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) {
      std::perror(path_.c_str());
      std::abort();  // not a finding, but no input can be tested without the file
    }
  }
  ~TempFile() { std::remove(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// A directory at temp_path's, removed with its content when the object goes.
class TempDir {
 public:
  explicit TempDir(const char* harness) : path_(temp_path(harness)) { std::filesystem::create_directories(path_); }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Reports a broken property (not a crash the sanitizers see) and stops, so that libFuzzer
/// keeps the input as a crash artifact.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "remat fuzz finding: %s\n", what.c_str());
  std::abort();
}

}  // namespace remat::fuzz
