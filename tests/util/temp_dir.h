// The one way tests make a scratch directory.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <string>

namespace remat::testing {

/// A fresh, empty directory, removed with this object: `remat-SUITE.TEST-PID-N` in the
/// system's temporary directory, named after the running test (or, made in a fixture's
/// SetUpTestSuite, its suite), the process and a count of the process's directories, so
/// that tests run side by side (ctest -j, other builds' suites) never meet.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> made{0};
    const auto* unit = ::testing::UnitTest::GetInstance();
    const auto* test = unit->current_test_info();
    std::string name = "no-test";
    if (test) {
      name = std::string(test->test_suite_name()) + "." + test->name();
    } else if (unit->current_test_suite()) {
      name = unit->current_test_suite()->name();  // a fixture's SetUpTestSuite
    }
    std::replace(name.begin(), name.end(), '/', '_');  // parameterised: "Models/Suite.Test/0"
    path_ = std::filesystem::temp_directory_path() /
            ("remat-" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(made++));
    std::filesystem::remove_all(path_);  // left by a crashed process of the same id
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

}  // namespace remat::testing
