// A run is resolved once: `remat plan` prints, line for line, the run `remat train` prints
// before its first step and keeps in plan.txt, for budgets, policies, both `auto`s, a
// pipeline and tensor parallelism (times priced by FLOPs on both sides: ac.profile=false).
#include "data/test_text.h"
#include "util/processes.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

using remat::testing::read_text;
using remat::testing::Result;
using remat::testing::run_remat;

class PlanAsTrained : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = remat::testing::test_dir("remat-plan-train-");
    std::ofstream(dir_ / "corpus.txt") << remat::testing::make_text(1500);
    common_ = " model.vocab_size=0 data.vocab_size=512 data.text=" + (dir_ / "corpus.txt").string() +
              " data.dir=" + (dir_ / "data").string() + " train.batch=4 train.seq=32 ac.profile=false";
    const Result prepared = run_remat("prepare" + common_);
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Plans `settings`, trains them one step (under `launch`, e.g. "launch --nproc 2 "), and
  // checks that the plan's run block is what the run printed and wrote.
  void expect_same(const std::string& settings, const std::string& launch = "") {
    const Result plan = run_remat("plan" + common_ + " " + settings);
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    const std::string name = "run" + std::to_string(runs_++);
    const Result train = run_remat(launch + "train" + common_ + " " + settings +
                                   " train.steps=1 train.warmup=1 train.eval_batches=1 run.threads=1 "
                                   "run.progress=false run.sample_tokens=0 run.out_dir=" +
                                   (dir_ / "runs").string() + " run.name=" + name);
    ASSERT_EQ(train.exit_code, 0) << train.output;
    // plan.txt: the run block, a blank line, every layer spelled out.
    const std::string written = read_text(dir_ / "runs" / name / "plan.txt");
    const size_t blank = written.find("\n\n");
    ASSERT_NE(blank, std::string::npos) << written;
    const std::string block = written.substr(0, blank + 1);
    EXPECT_EQ(block.rfind("run: ", 0), 0u) << block;
    EXPECT_EQ(plan.output.rfind(block, 0), 0u) << settings << "\nplan.txt:\n"
                                               << block << "\nremat plan:\n"
                                               << plan.output;
    EXPECT_NE(train.output.find(block), std::string::npos) << settings << "\nplan.txt:\n"
                                                           << block << "\ntrain:\n"
                                                           << train.output;
  }

  fs::path dir_;
  std::string common_;
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

}  // namespace
