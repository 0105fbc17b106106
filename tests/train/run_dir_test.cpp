// Plot paths reach gnuplot as arguments: whatever a run directory's name holds, the
// plot lands in it and nothing in the name runs.
#include "train/run_dir.h"

#include "data/temp_dir.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace remat {
namespace {

namespace fs = std::filesystem;

TEST(RunDirPlots, ADirectoryNameThatWouldBreakTheScriptIsOnlyAName) {
  testing::TempDir dir;
  const std::string marker = dir / "injected";
  // A quote ending gnuplot's string, a newline ending its line (config validation refuses
  // it before a RunDir exists; this holds even without that), a backquote substitution.
  for (const std::string& name : {"q' . system('touch " + marker + "') . '", "n\nsystem('touch " + marker + "')\n",
                                 "b`touch " + marker + "`"}) {
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

}  // namespace
}  // namespace remat
