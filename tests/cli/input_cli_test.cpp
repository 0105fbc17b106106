// The `remat` binary on inputs that crashed it, made it wait for ever or made it print
// megabytes: one sentence on stderr and exit status 1.
#include "util/processes.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

using remat::testing::Result;
using remat::testing::run_remat;

class InputCli : public ::testing::Test {
 protected:
  std::string file(const std::string& name, const std::string& content) {
    const std::string p = (dir_ / name).string();
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }
  // Exit status 1, and `expected` in the last line, which is the only "error:" line.
  static void expect_error(const Result& r, const std::string& expected) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_EQ(r.output.rfind("error: ", 0), 0u) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  }

  remat::testing::TempDir dir_;
};

// 100,000 dotted key parts ended `remat train` and `remat generate` with SIGSEGV (rc 139).
TEST_F(InputCli, AConfigOfDeeplyDottedKeysIsASentenceNotACrash) {
  std::string key = "a";
  for (int i = 1; i < 100000; ++i) key += ".a";
  const std::string config = file("k.toml", key + " = 1\n");
  expect_error(run_remat("train --config " + config), "has a key of more than 32 dotted parts");
  fs::create_directories(dir_ / "run");
  fs::copy_file(config, dir_ / "run" / "config.toml");
  file("run/model.safetensors", "");
  file("run/tokenizer.model", "");
  expect_error(run_remat("generate --run " + (dir_ / "run").string()), "has a key of more than 32 dotted parts");
}

// A FIFO as --config waited for a writer for ever.
TEST_F(InputCli, AFifoAsTheConfigIsRefusedAtOnce) {
  const std::string fifo = (dir_ / "config.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error(run_remat("plan --config " + fifo), "it is a FIFO (named pipe), not a regular file");
}

TEST_F(InputCli, AnEmptyResumeDirectoryIsRefused) {
  expect_error(run_remat("train --resume ''"), "--resume \"\" names no run directory");
}

TEST_F(InputCli, ANonFiniteTemperatureIsRefused) {
  const Result r = run_remat("generate --run " + (dir_ / "no-run").string() + " --temperature nan");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("multinomial"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("temperature"), std::string::npos) << r.output;
}

// An error about a value quotes a couple of hundred bytes of it, not the whole.
TEST_F(InputCli, AnErrorNeverRepeatsAHugeInput) {
  const std::string config = file("long.toml", "[train]\nlr = \"" + std::string(500000, '7') + "x\"\n");
  const Result r = run_remat("train --config " + config);
  expect_error(r, "train.lr must be a number, got '777");
  EXPECT_LT(r.output.size(), 600u);
}

TEST_F(InputCli, APlotThatCannotBeWrittenIsRefusedBeforeTheSweep) {
  const std::string plot = (dir_ / "missing" / "pareto.png").string();
  expect_error(run_remat("plan --pareto --plot " + plot + " model.preset=tiny-gpt2 data.dir=" + (dir_ / "d").string()),
               "--plot " + plot + " cannot be written: " + (dir_ / "missing").string() + " is not a directory");
}

}  // namespace
