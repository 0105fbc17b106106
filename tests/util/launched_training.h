// Tiny training runs over several ranks, launched by `remat launch`, by torchrun, or by
// hand: a corpus prepared once per test, the settings every run shares, and each run's
// metrics.
#pragma once

#include "data/test_text.h"
#include "util/paths.h"
#include "util/processes.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace remat::testing {

/// A fixture whose runs train tiny-gpt2 on a prepared 1000-line corpus, batch 4 x 16
/// tokens, one thread per rank, each run writing under run.name in its own directory.
class LaunchedTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path text = dir_ / "corpus.txt";
    std::ofstream(text, std::ios::binary) << make_text(1000);
    common_ =
        "model.preset=tiny-gpt2 model.vocab_size=0 model.dropout=0.1 train.batch=4 train.seq=16 "
        "train.warmup=1 train.eval_batches=1 data.vocab_size=512 run.threads=1 run.progress=false "
        "run.sample_tokens=0 data.text=" +
        text.string() + " data.dir=" + (dir_ / "data").string() + " run.out_dir=" + (dir_ / "runs").string();
    // Once, so that no rank races another building the corpus.
    const Result r = run_remat("prepare " + common_);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }

  /// The "kind":"train" lines of a run's metrics.
  std::vector<nlohmann::json> train_lines(const std::string& run) const {
    std::vector<nlohmann::json> lines;
    std::ifstream in(dir_ / "runs" / run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") lines.push_back(j);
    }
    return lines;
  }

  /// Starts `remat train` as rank `rank` of `world` on this host by the torchrun
  /// variables, output to dir_/log<rank>.
  pid_t start_rank(int rank, int world, int port, const std::string& settings) {
    const std::string r = std::to_string(rank), w = std::to_string(world);
    return start_shell(std::string("exec ") + remat::testing::kRematBinary + " train " + common_ + " " + settings,
                       dir_ / ("log" + r),
                       {"RANK=" + r, "LOCAL_RANK=" + r, "WORLD_SIZE=" + w, "LOCAL_WORLD_SIZE=" + w,
                        "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)});
  }

  TempDir dir_;         ///< this test's scratch directory
  std::string common_;  ///< the settings of every run: model, batch, corpus, output
};

}  // namespace remat::testing
