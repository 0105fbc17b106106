// The file primitives every run-directory write and read goes through: a failed write is
// an error naming the file, a FIFO is never waited on, and the temporary files remat's own
// writes leave are told apart from anyone else's.
#include "util/temp_dir.h"
#include "util/atomic_file.h"
#include "util/error_of.h"
#include "util/temp_files.h"
#include "util/file_limit.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace remat::util {
namespace {

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::runtime_error>(f); }

TEST(AtomicFile, TemporaryNamesAreTheWritersOwnAndNothingElse) {
  EXPECT_EQ(temp_path_of("/r/metrics.jsonl"), "/r/metrics.jsonl.tmp." + std::to_string(::getpid()));
  EXPECT_TRUE(is_temp_name_of("metrics.jsonl.tmp.12345", "metrics.jsonl"));
  for (const char* other : {"metrics.jsonl", "metrics.jsonl.tmp.", "metrics.jsonl.tmp.12a", "notes.tmp.12345",
                            "metrics.jsonl.tmp.12345.bak", "xmetrics.jsonl.tmp.1", "metrics.jsonl.tmp.12345678901"}) {
    EXPECT_FALSE(is_temp_name_of(other, "metrics.jsonl")) << other;
  }
}

TEST(AtomicFile, AFifoOrDeviceIsRefusedWithoutWaiting) {
  const remat::testing::TempDir dir;
  const std::string fifo = dir / "x.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string refusal =
      ": it is a FIFO (named pipe), not a regular file; remat reads only regular files (a FIFO "
      "or device could make it wait or read for ever): give the path of a file.";
  EXPECT_EQ(error_of([&] { read_file(fifo, "the metrics"); }), "Cannot read the metrics " + fifo + refusal);
  EXPECT_EQ(error_of([&] { check_regular_file(fifo, "the tokenizer"); }),
            "Cannot read the tokenizer " + fifo + refusal);
  EXPECT_EQ(error_of([&] { read_file("/dev/zero", "the text"); }),
            "Cannot read the text /dev/zero: it is a device, not a regular file; remat reads only regular files (a "
            "FIFO or device could make it wait or read for ever): give the path of a file.");
  EXPECT_EQ(error_of([&] { AppendFile(fifo, false); }), "Cannot write " + fifo +
                                                            ": it is a FIFO (named pipe), not a "
                                                            "regular file; remove it.");
}

TEST(AtomicFile, AFailedAppendIsAnErrorNamingTheFile) {
  const remat::testing::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  AppendFile file(path, true);
  const std::string record(60, 'r');
  std::string error;
  {
    const remat::testing::FileSizeLimit full(100);
    file.append(record);
    error = error_of([&] { file.append(record); });
  }
  EXPECT_EQ(error, "Cannot write " + path + ": File too large.");
  EXPECT_EQ(std::filesystem::file_size(path), 100u);  // the torn record a resume drops
}

TEST(AtomicFile, AFailedWholeFileWriteLeavesTheOldContentAndNoTemporaryFile) {
  const remat::testing::TempDir dir;
  const std::string path = dir / "summary.json";
  write_file_atomically(path, "old");
  std::string error;
  {
    const remat::testing::FileSizeLimit full(100);
    error = error_of([&] { write_file_atomically(path, std::string(1 << 20, 'n')); });
  }
  EXPECT_EQ(error.rfind("Cannot write " + temp_path_of(path) + ": File too large", 0), 0u) << error;
  EXPECT_EQ(read_file(path), "old");
  EXPECT_FALSE(std::filesystem::exists(temp_path_of(path)));
}

// What a signal handler removes on the way out: the temporary file of a write under way,
// not a committed file.
TEST(AtomicFile, AnOpenWritesTemporaryFileIsRemovedOnTheWayOut) {
  const remat::testing::TempDir dir;
  write_file_atomically(dir / "done.txt", "whole");
  AtomicFile open(dir / "train.bin");
  open.write("part");
  ASSERT_TRUE(std::filesystem::exists(temp_path_of(dir / "train.bin")));
  remove_open_temp_files();
  EXPECT_FALSE(std::filesystem::exists(temp_path_of(dir / "train.bin")));
  EXPECT_EQ(read_file(dir / "done.txt"), "whole");
}

// A killed writer's temporary file goes; a running process's (it may be writing now), and
// files that are not temporary ones, stay.
TEST(AtomicFile, StaleTemporaryFilesOfDeadWritersAreRemoved) {
  const remat::testing::TempDir dir;
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const std::string dead = "train.bin.tmp." + std::to_string(child);
  const std::string alive = "train.bin.tmp." + std::to_string(::getpid());
  for (const std::string& name : {dead, alive, std::string("val.bin"), std::string("notes.tmp.1")}) {
    std::ofstream(dir / name) << "x";
  }
  remove_stale_temp_files(dir.path().string(), {"train.bin", "val.bin"});
  EXPECT_FALSE(std::filesystem::exists(dir / dead));
  for (const char* kept : {"val.bin", "notes.tmp.1"}) EXPECT_TRUE(std::filesystem::exists(dir / kept)) << kept;
  EXPECT_TRUE(std::filesystem::exists(dir / alive));
}

}  // namespace
}  // namespace remat::util
