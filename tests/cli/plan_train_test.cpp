// A run is resolved once: `remat plan` prints, line for line, the run `remat train` prints
// before its first step and keeps in plan.txt, for budgets, policies, both `auto`s, a
// pipeline, tensor parallelism and sharded data parallelism (times priced by FLOPs on both sides: ac.profile=false);
// and, given the prices a run recorded (--prices), the plan of a run that priced its host
// copies as it measured them.
#include "data/test_text.h"
#include "util/processes.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace {

namespace fs = std::filesystem;

using remat::testing::read_text;
using remat::testing::Result;
using remat::testing::run_remat;

class PlanAsTrained : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_ / "corpus.txt") << remat::testing::make_text(1500);
    common_ = " model.vocab_size=0 data.vocab_size=512 data.text=" + (dir_ / "corpus.txt").string() +
              " data.dir=" + (dir_ / "data").string() + " train.batch=4 train.seq=32 ac.profile=false";
    const Result prepared = run_remat("prepare" + common_);
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }

  // Trains `settings` one step (under `launch`, e.g. "launch --nproc 2 ") in a run
  // directory of its own, which it returns.
  fs::path train(const std::string& settings, const std::string& launch = "") {
    const std::string name = "run" + std::to_string(runs_++);
    const Result train = run_remat(launch + "train" + common_ + " " + settings +
                                   " train.steps=1 train.warmup=1 train.eval_batches=1 run.threads=1 "
                                   "run.progress=false run.sample_tokens=0 run.out_dir=" +
                                   (dir_ / "runs").string() + " run.name=" + name);
    EXPECT_EQ(train.exit_code, 0) << train.output;
    last_output_ = train.output;
    return dir_ / "runs" / name;
  }

  // Plans `settings` (with `plan_options`, e.g. "--prices DIR "), trains them one step
  // (under `launch`), and checks that the plan's run block is what the run printed and wrote.
  void expect_same(const std::string& settings, const std::string& launch = "") {
    const Result plan = run_remat("plan" + common_ + " " + settings);
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    const fs::path run = train(settings, launch);
    expect_block(run, plan.output, settings);
    EXPECT_NE(last_output_.find(block_of(run)), std::string::npos) << settings << "\ntrain:\n" << last_output_;
  }

  // The run block of `run`'s plan.txt: what precedes the blank line before every layer
  // spelled out.
  static std::string block_of(const fs::path& run) {
    const std::string written = read_text(run / "plan.txt");
    const size_t blank = written.find("\n\n");
    EXPECT_NE(blank, std::string::npos) << written;
    return written.substr(0, blank + 1);
  }

  // Checks that `planned` (remat plan's output) begins with `run`'s run block.
  static void expect_block(const fs::path& run, const std::string& planned, const std::string& settings) {
    const std::string block = block_of(run);
    EXPECT_EQ(block.rfind("run: ", 0), 0u) << block;
    EXPECT_EQ(planned.rfind(block, 0), 0u) << settings << "\nplan.txt:\n" << block << "\nremat plan:\n" << planned;
  }

  remat::testing::TempDir dir_;
  std::string common_;
  std::string last_output_;
  int runs_ = 0;
};

TEST_F(PlanAsTrained, UnderABudget) { expect_same("model.preset=tiny-gpt2 ac.budget=0.85"); }

TEST_F(PlanAsTrained, UnderAPolicy) { expect_same("model.preset=tiny-llama ac.policy=every:2"); }

// An offload policy: the host bytes are in the plan's block, and the run held in host
// memory exactly the bytes it predicted.
TEST_F(PlanAsTrained, UnderAnOffloadPolicy) {
  expect_same("model.preset=tiny-gpt2 ac.policy=modules:[core_attn]+offload:[input,mlp]");
  const auto summary = nlohmann::json::parse(read_text(dir_ / "runs" / "run0" / "summary.json"));
  EXPECT_GT(summary["predicted_host_peak_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(summary["host_peak_bytes"], summary["predicted_host_peak_bytes"]);
}

TEST_F(PlanAsTrained, WithBothAutosUnderABudget) {
  expect_same("model.preset=tiny-llama model.attention=auto model.loss_head=auto ac.budget=0.7");
}

TEST_F(PlanAsTrained, OnPipelineStages) {
  expect_same("model.preset=tiny-llama model.n_layer=4 parallel.pp=2 train.grad_accum=2 ac.budget=0.8",
              "launch --nproc 2 ");
}

// Under tensor parallelism a budget plan weighs the collectives, which `remat plan` prices at
// parallel.link_rate and a run at its measured links: a policy's plan is the same either way.
TEST_F(PlanAsTrained, OverTensorParallelRanks) {
  expect_same("model.preset=tiny-gpt2 parallel.tp=2 parallel.sp=true ac.policy=full", "launch --nproc 2 ");
}

// Over data-parallel ranks that shard AdamW's state (ZeRO stage 2) the plan names each
// rank's own peak, and the run predicts each rank that peak.
TEST_F(PlanAsTrained, OverShardedDataParallelRanks) {
  const std::string settings = "model.preset=tiny-gpt2 parallel.dp=4 parallel.zero=2 ac.budget=0.9";
  expect_same(settings, "launch --nproc 4 ");
  const Result plan = run_remat("plan --json" + common_ + " " + settings);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto planned = nlohmann::json::parse(plan.output);
  const auto summary = nlohmann::json::parse(read_text(dir_ / "runs" / "run0" / "summary.json"));
  ASSERT_EQ(planned["dp_rank_peaks"].size(), 4u) << plan.output;
  for (size_t d = 0; d < 4; ++d) EXPECT_EQ(summary["predicted_rank_peak_bytes"][d], planned["dp_rank_peaks"][d][0]);
  EXPECT_NE(read_text(dir_ / "runs" / "run0" / "plan.txt").find("data-parallel ranks, each holding its own share"),
            std::string::npos);
}

// The prices a run measured (its host copies here) decide its budget plans: `remat plan`
// given them (--prices) prints the plan the run ran, for random models, budgets, host
// budgets, policies that offload, microbatches and `auto`s; without them, it prices the
// copies at ac.offload_rate and may plan otherwise.
TEST_F(PlanAsTrained, ARunsRecordedPricesGiveItsPlan) {
  std::mt19937 rng(20261128);
  const auto pick = [&](const std::vector<std::string>& from) { return from[rng() % from.size()]; };
  for (int trial = 0; trial < 10; ++trial) {
    std::string settings =
        "model.preset=" + pick({"tiny-gpt2", "tiny-llama"}) + " train.grad_accum=" + pick({"1", "2"});
    if (trial % 3 == 2) {
      // A host budget beside a policy bounds its offload: these hold each policy's slots.
      settings +=
          " ac.policy=" +
          pick({"modules:[core_attn]+offload:[input,mlp]", "full+offload:[input]", "every:2+offload:[input,attn]"}) +
          " ac.host_budget=" + pick({"1MiB", "4MiB"});
    } else {
      settings +=
          " ac.budget=" + pick({"0.75", "0.8", "0.85", "0.9"}) + " ac.host_budget=" + pick({"64KiB", "256KiB", "4MiB"});
    }
    if (trial % 4 == 1) settings += " model.attention=auto model.loss_head=auto";
    const fs::path run = train(settings);
    ASSERT_TRUE(fs::exists(run / "prices.json")) << settings;
    const Result plan = run_remat("plan --prices " + run.string() + common_ + " " + settings);
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    expect_block(run, plan.output, settings);
  }
  // A run's directory names its settings too: its config.toml, its autos resolved.
  const fs::path run = train("model.preset=tiny-gpt2 ac.budget=0.7 ac.host_budget=4MiB");
  const Result plan = run_remat("plan --prices " + run.string());
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  expect_block(run, plan.output, "the run's config.toml");
}

// Prices from a run that priced other settings are refused with a sentence naming them.
TEST_F(PlanAsTrained, PricesARunDidNotTakeAreRefused) {
  const fs::path run = train("model.preset=tiny-gpt2 ac.policy=full");
  const Result plan =
      run_remat("plan --prices " + run.string() + common_ + " model.preset=tiny-gpt2 model.attention=tiled");
  EXPECT_NE(plan.exit_code, 0);
  EXPECT_NE(plan.output.find("priced math attention with the fused head, not tiled attention with the fused head"),
            std::string::npos)
      << plan.output;
  const Result none = run_remat("plan --prices " + (dir_ / "nowhere").string() + common_);
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("cannot be read"), std::string::npos) << none.output;
}

}  // namespace
