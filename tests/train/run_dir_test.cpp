// Plot paths reach gnuplot as arguments: whatever a run directory's name holds, the
// plot lands in it and nothing in the name runs.
#include "train/run_dir.h"

#include "util/temp_dir.h"
#include "util/error_of.h"
#include "util/file_limit.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace remat {
namespace {

namespace fs = std::filesystem;

TEST(RunDirPlots, ADirectoryNameThatWouldBreakTheScriptIsOnlyAName) {
  testing::TempDir dir;
  const std::string marker = dir / "injected";
  // A quote ending gnuplot's string, a newline ending its line (config validation refuses
  // it before a RunDir exists; this holds even without that), a backquote substitution.
  for (const std::string& name :
       {"q' . system('touch " + marker + "') . '", "n\nsystem('touch " + marker + "')\n", "b`touch " + marker + "`"}) {
    const RunDir run(dir / name, "run", "tiny-gpt2");
    std::string why;
    const bool plotted = run.plot_loss({{1, 3.0}, {2, 2.5}}, {{2, 2.7}}, 2.0, &why);
    if (why.find("gnuplot is not installed") == std::string::npos) {
      EXPECT_TRUE(plotted) << why;
      EXPECT_TRUE(fs::exists(run.file("loss.png"))) << name;
    }
    EXPECT_FALSE(fs::exists(marker)) << name;
  }
}

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::runtime_error>(f); }

// One process at a time writes a run directory: a second owner (here a second lock in
// this process, as flock locks belong to open files) is refused with the first's pid.
TEST(RunDirOwnership, ASecondOwnerIsRefusedNamingTheFirst) {
  testing::TempDir dir;
  const RunDir run(dir / "runs", "x", "tiny-gpt2");
  EXPECT_EQ(error_of([&] { RunLock again(run.path()); }),
            run.path() + " is in use by another remat process (pid " + std::to_string(::getpid()) +
                "): one process at a time writes a run directory; wait for it to finish (or stop it) before resuming "
                "the run.");
  // Two runs given the same name get a directory each, never a shared one.
  const RunDir twin(dir / "runs", "x", "tiny-gpt2");
  EXPECT_EQ(twin.path(), dir / "runs/x-2");
  // A name taken by a file (another process's, made between a check and a mkdir) is skipped.
  std::ofstream(dir / "runs/x-3") << "not a directory";
  EXPECT_EQ(RunDir(dir / "runs", "x", "tiny-gpt2").path(), dir / "runs/x-4");
}

TEST(RunDirOwnership, TheLockEndsWithItsOwner) {
  testing::TempDir dir;
  std::string path;
  { path = RunDir(dir / "runs", "x", "tiny-gpt2").path(); }
  EXPECT_EQ(error_of([&] { RunLock again(path); }), "");
}

TEST(RunDirWrites, AFailedMetricsWriteStopsTheRunWithASentence) {
  testing::TempDir dir;
  RunDir run(dir / "runs", "x", "tiny-gpt2");
  const nlohmann::json record = {{"kind", "train"}, {"step", 2}, {"loss", 1.5}, {"pad", std::string(100, 'p')}};
  std::string error;
  {
    const testing::FileSizeLimit full(200);
    run.log_metrics(record);
    error = error_of([&] { run.log_metrics(record); });
  }
  // With no checkpoint yet, it once promised one to continue from.
  EXPECT_EQ(error, "Cannot write " + run.file("metrics.jsonl") +
                       ": File too large. The metrics of step 2 are lost, so the run stops here; it has no checkpoint "
                       "yet, so free space (or fix the file) and start it again with `remat train --config " +
                       run.path() + "/config.toml`.");
  fs::create_directories(run.file("checkpoints"));
  std::ofstream(run.file("checkpoints/step-00000200.safetensors")) << "x";
  {
    const testing::FileSizeLimit full(200);
    error = error_of([&] { run.log_metrics(record); });
  }
  EXPECT_EQ(error, "Cannot write " + run.file("metrics.jsonl") +
                       ": File too large. The metrics of step 2 are lost, so the run stops here; free space (or fix "
                       "the file) and continue it from its newest checkpoint, step-00000200.safetensors, with `remat "
                       "train --resume " +
                       run.path() + "`.");
}

TEST(RunDirWrites, AnOutputDirectoryThatCannotExistIsASentence) {
  testing::TempDir dir;
  std::ofstream(dir / "file") << "a file, not a directory";
  EXPECT_EQ(error_of([&] { RunDir(dir / "file/runs", "x", "tiny-gpt2"); }),
            "Cannot create the run output directory " + (dir / "file/runs").string() +
                ": Not a directory; set run.out_dir to a writable directory.");
  std::filesystem::create_symlink(dir / "loop", dir / "loop");
  EXPECT_EQ(error_of([&] {
              RunDir(dir / "loop", "x", "tiny-gpt2");
            }).find("Cannot create the run output directory " + (dir / "loop").string() + ": "),
            0u);
}

// A restarted job finds the run its first start made by the job's id, once that run holds
// a checkpoint; another job's run, or one with no checkpoint, is not it.
TEST(JobRuns, ARestartFindsTheRunOfItsJobThatHoldsACheckpoint) {
  testing::TempDir dir;
  const auto make = [&](const std::string& name, const std::string& id, bool checkpoint) {
    fs::create_directories(dir / name / "checkpoints");
    std::ofstream(dir / name / kJobIdFile) << id;
    if (checkpoint) std::ofstream(dir / name / "checkpoints" / "step-00000003.safetensors") << "x";
  };
  EXPECT_EQ(find_job_run(dir / "absent", "night"), "");
  make("early", "night\n", false);  // failed before its first checkpoint
  make("other", "day\n", true);
  make("prefix", "night-2\n", true);
  EXPECT_EQ(find_job_run(dir.path().string(), "night"), "");
  make("run", "night\n", true);
  EXPECT_EQ(find_job_run(dir.path().string(), "night"), (dir / "run").string());
  make("copy", "night\n", true);
  const std::string refusal = error_of([&] { find_job_run(dir.path().string(), "night"); });
  EXPECT_EQ(refusal, "Job night made several run directories that hold checkpoints (" + (dir / "copy").string() + ", " +
                         (dir / "run").string() +
                         "), so a restart cannot tell which to continue; continue one with `remat train --resume "
                         "DIR`.");
}

}  // namespace
}  // namespace remat
