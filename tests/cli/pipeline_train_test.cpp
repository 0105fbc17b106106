// `remat train` with pipeline stages under `remat launch`: the stages train the one-process
// model (bitwise where no sum is reordered), checkpoints and the exported weights are the
// whole model's, a resumed run continues bitwise, each stage peaks where the planner said,
// and a lost stage stops the others with a sentence.
#include "cli/launch.h"
#include "remat/safetensors.h"
#include "util/launched_training.h"
#include "util/processes.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using namespace remat::testing;  // the launched-training fixture and the process helpers

// Llama has no tied weights, so no gradient is summed over two stages, and the gradient
// norm gathers every stage's squares into one process's sum: the stages compute every
// number, the clipping (train.grad_clip = 0.1 scales every step here) included, as one
// process.
const std::string kLlama = " model.preset=tiny-llama model.n_layer=4 train.grad_accum=4 train.grad_clip=0.1 ";

class PipelineTraining : public LaunchedTraining {
 protected:
  std::vector<double> losses(const std::string& run) const {
    std::vector<double> out;
    for (const auto& line : train_lines(run)) out.push_back(line["loss"]);
    return out;
  }
  nlohmann::json summary(const std::string& run) const {
    return nlohmann::json::parse(read_text(dir_ / "runs" / run / "summary.json"));
  }
  // The tensors of a run's file, by name.
  std::map<std::string, at::Tensor> tensors(const std::string& run, const std::string& file) const {
    std::map<std::string, at::Tensor> out;
    for (auto& [name, t] : remat::model::load_safetensors((dir_ / "runs" / run / file).string()).tensors) {
      // A checkpoint's checksum covers its metadata too, whose plan differs between layouts.
      if (name != remat::model::kChecksumTensor) out.emplace(name, t);
    }
    return out;
  }
  void expect_same_tensors(const std::string& a, const std::string& b, const std::string& file) const {
    const auto ta = tensors(a, file), tb = tensors(b, file);
    ASSERT_EQ(ta.size(), tb.size()) << a << " vs " << b << ": " << file;
    for (const auto& [name, t] : ta) {
      ASSERT_EQ(tb.count(name), 1u) << name;
      EXPECT_TRUE(t.equal(tb.at(name))) << a << " vs " << b << ": " << file << " " << name;
    }
  }
};

TEST_F(PipelineTraining, StagesTrainTheOneProcessModelBitwise) {
  const std::string steps = " train.steps=3 ";
  const Result one = run_remat("train " + common_ + kLlama + steps + "run.name=one");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  for (const auto& line : train_lines("one")) EXPECT_GT(line["grad_norm"].get<double>(), 0.1) << "clipped";
  for (const std::string schedule : {"1f1b", "gpipe"}) {
    const std::string name = "pp-" + schedule;
    const Result r = run_remat("launch --nproc 2 train " + common_ + kLlama + steps +
                               "parallel.pp=2 parallel.schedule=" + schedule + " run.name=" + name);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("the layers in 2 pipeline stages (" + schedule + " schedule)"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("stage 2: layers 3-4 (2)"), std::string::npos) << r.output;
    EXPECT_EQ(losses(name), losses("one")) << schedule;
    const auto s = summary(name);
    EXPECT_EQ(s["pp"], 2);
    EXPECT_EQ(s["stage_layers"], nlohmann::json({2, 2}));
    EXPECT_EQ(s["parameters"], summary("one")["parameters"]);
    EXPECT_EQ(s["initial_val_loss"], summary("one")["initial_val_loss"]);
    EXPECT_EQ(s["final_val_loss"], summary("one")["final_val_loss"]);
    // The stages' parts gathered into the one process's files.
    expect_same_tensors(name, "one", "checkpoints/step-00000003.safetensors");
    expect_same_tensors(name, "one", "model.safetensors");
  }
  // Four stages of one layer each.
  const Result four = run_remat("launch --nproc 4 train " + common_ + kLlama + steps + "parallel.pp=4 run.name=pp4");
  ASSERT_EQ(four.exit_code, 0) << four.output;
  EXPECT_EQ(losses("pp4"), losses("one"));
  EXPECT_EQ(summary("pp4")["stage_layers"], nlohmann::json({1, 1, 1, 1}));
  expect_same_tensors("pp4", "one", "model.safetensors");
  // Two data-parallel copies of the pipeline train as two data-parallel ranks do.
  const Result dp = run_remat("launch --nproc 2 train " + common_ + kLlama + steps + "run.name=dp");
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  const Result dp_pp = run_remat("launch --nproc 4 train " + common_ + kLlama + steps + "parallel.pp=2 run.name=dp-pp");
  ASSERT_EQ(dp_pp.exit_code, 0) << dp_pp.output;
  EXPECT_EQ(losses("dp-pp"), losses("dp"));
  EXPECT_EQ(summary("dp-pp")["rank_peak_bytes"].size(), 4u);
  expect_same_tensors("dp-pp", "dp", "model.safetensors");
}

// Every per-stage spelling of a policy recomputes on the stages without changing a bit:
// Megatron's block and ColossalAI's ratio and per-stage counts count each stage's layers.
TEST_F(PipelineTraining, EveryPerStagePolicyTrainsBitwiseAsWithoutRecompute) {
  const std::string base = "launch --nproc 2 train " + common_ + kLlama + " train.steps=2 parallel.pp=2 ";
  const Result none = run_remat(base + "run.name=none");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  const std::vector<std::string> policies{
      "ac.policy=full",
      "ac.recompute_granularity=full ac.recompute_method=block ac.recompute_num_layers=1",
      "ac.gradient_checkpointing_ratio=0.5",
      "ac.num_ckpt_layers_per_stage=2,1",
      "ac.num_layers_per_stage=3,1 ac.num_ckpt_layers_per_stage=2,0",
      "ac.policy=uniform:2",
      "ac.policy=layers:[full,modules:core_attn,none,full]"};
  for (size_t i = 0; i < policies.size(); ++i) {
    const std::string name = "policy-" + std::to_string(i);
    const Result r = run_remat(base + policies[i] + " run.name=" + name);
    ASSERT_EQ(r.exit_code, 0) << policies[i] << "\n" << r.output;
    EXPECT_GT(train_lines(name).at(0)["ops_recomputed"].get<int64_t>(), 0) << policies[i];
    EXPECT_EQ(losses(name), losses("none")) << policies[i];
  }
}

// GPT-2's embedding is read by the first stage and the tied head on the last: each stage
// holds a copy and their gradients are summed between them, in another order than one
// process accumulates them, so only the first loss is bitwise. After three AdamW steps of
// train.lr = 3e-3 the weights agree to rounding: a summed gradient off by rounding (a
// relative 1e-7) moves an update by about as much of it, 1e-9; a copy that missed the
// other stage's gradient moves it by a whole step's order, 1e-3.
TEST_F(PipelineTraining, TheTiedEmbeddingsTwoCopiesTrainAsOne) {
  const std::string steps = " train.steps=3 train.grad_accum=2 ";
  const Result one = run_remat("train " + common_ + steps + "run.name=one");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const Result pp = run_remat("launch --nproc 2 train " + common_ + steps + "parallel.pp=2 run.name=pp");
  ASSERT_EQ(pp.exit_code, 0) << pp.output;
  EXPECT_EQ(losses("pp").at(0), losses("one").at(0));
  const auto a = tensors("pp", "model.safetensors"), b = tensors("one", "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    EXPECT_LE((t - b.at(name)).abs().max().item<double>(), 1e-6) << name;
  }
  EXPECT_EQ(summary("pp")["parameters"], summary("one")["parameters"]);
  // The whole model samples from what the stages wrote.
  const Result sample = run_remat("generate --run " + (dir_ / "runs" / "pp").string() + " --tokens 4");
  EXPECT_EQ(sample.exit_code, 0) << sample.output;
}

// A pipeline run stopped after a checkpoint resumes from it and continues bitwise.
TEST_F(PipelineTraining, AResumedPipelineContinuesBitwise) {
  const std::string settings = kLlama + " train.steps=4 train.checkpoint_every=2 parallel.pp=2 ";
  const Result whole = run_remat("launch --nproc 2 train " + common_ + settings + "run.name=whole");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const Result cut = run_remat("launch --nproc 2 train " + common_ + settings + "run.name=cut");
  ASSERT_EQ(cut.exit_code, 0) << cut.output;
  // As if it had stopped after step 2: its last checkpoint and model gone.
  const fs::path run = dir_ / "runs" / "cut";
  // The stages' gathered checkpoint carries its checksum, as a single process's does.
  const std::string second = (run / "checkpoints" / "step-00000002.safetensors").string();
  EXPECT_EQ(remat::model::verify_safetensors_checksum(second), remat::model::Checksum::matches);
  fs::remove(run / "checkpoints" / "step-00000004.safetensors");
  fs::remove(run / "model.safetensors");
  const Result resumed = run_remat("launch --nproc 2 train --resume " + run.string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming " + run.string() + " after step 2"), std::string::npos) << resumed.output;
  EXPECT_EQ(losses("cut"), losses("whole"));
  expect_same_tensors("cut", "whole", "model.safetensors");
}

// The gpt2-demo shape of the launch tests' peak checks: activations dwarf the bound.
const std::string kPeakShape =
    " model.preset=gpt2-demo model.vocab_size=2048 train.batch=16 train.seq=128 "
    "ac.profile=false train.steps=2 train.grad_accum=3 parallel.pp=2 ";
constexpr int64_t kPeakSlack = 8 * 1024;

// Each stage peaks within 8 KiB of where the planner said for its layers and microbatches
// in flight, under either schedule, a policy or a budget, and split over a tensor-parallel
// pair with sequence parallelism; under the budget the planner chose the split. Without
// recompute under 1F1B the first stage, holding two microbatches, peaks above the last,
// holding one (with the loss head), by what the planner predicted. Below the least budget
// recompute alone fits, the planner offloads, and the first stage's host memory is its
// prediction to the byte.
TEST_F(PipelineTraining, EveryStagePeaksWhereThePlannerSaid) {
  const std::vector<std::string> cases{"ac.policy=none", "ac.policy=full parallel.schedule=gpipe", "ac.budget=0.6",
                                       "ac.policy=full parallel.tp=2 parallel.sp=true",
                                       "ac.budget=0.37 ac.host_budget=1GiB"};
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string name = "peak-" + std::to_string(i);
    const size_t ranks = cases[i].find("parallel.tp=2") != std::string::npos ? 4 : 2;
    const Result r = run_remat("launch --nproc " + std::to_string(ranks) + " train " + common_ + kPeakShape + cases[i] +
                               " run.name=" + name);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto s = summary(name);
    ASSERT_EQ(s["rank_peak_bytes"].size(), ranks);
    for (size_t rank = 0; rank < ranks; ++rank) {
      EXPECT_NEAR(s["rank_peak_bytes"][rank].get<int64_t>(), s["predicted_rank_peak_bytes"][rank].get<int64_t>(),
                  kPeakSlack)
          << cases[i] << ", rank " << rank;
    }
    EXPECT_NE(r.output.find("memory peak per rank: rank 0 "), std::string::npos) << r.output;
    if (i == 0) {
      const int64_t predicted =
          s["predicted_rank_peak_bytes"][0].get<int64_t>() - s["predicted_rank_peak_bytes"][1].get<int64_t>();
      EXPECT_GT(predicted, 0);
      EXPECT_NEAR(s["rank_peak_bytes"][0].get<int64_t>() - s["rank_peak_bytes"][1].get<int64_t>(), predicted,
                  2 * kPeakSlack);
    }
    if (s["budget_bytes"] > 0) {
      EXPECT_LE(s["predicted_peak_bytes"].get<int64_t>(), s["budget_bytes"].get<int64_t>());
      EXPECT_EQ(s["stage_layers"][0].get<int64_t>() + s["stage_layers"][1].get<int64_t>(), 4);
    }
    if (cases[i].find("ac.host_budget") != std::string::npos) {
      EXPECT_GT(s["predicted_host_peak_bytes"].get<int64_t>(), 0) << r.output;
      EXPECT_EQ(s["host_peak_bytes"], s["predicted_host_peak_bytes"]);
    }
  }
}

// `remat bench` under `remat launch` runs every entry through the stages, each on its own
// split (the budget entry's the planner's), with every rank's peak within the bound of its
// stage's prediction and the same losses whatever the plan and split.
TEST_F(PipelineTraining, BenchRunsEachEntryOnItsOwnSplit) {
  const fs::path out = dir_ / "bench";
  const Result r = run_remat("launch --nproc 2 bench --policies 'none;full' --budgets 0.6 --warmup 1 --steps 2 --out " +
                             out.string() + " " + common_ + kPeakShape);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the layers in 2 pipeline stages (1f1b schedule)"), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\nbudget=0.6 peaks per rank: rank 0 [\d.]+ MiB \(predicted )"
                                                     R"([\d.]+ MiB\), rank 1 [\d.]+ MiB \(predicted [\d.]+ MiB\)\n)")))
      << r.output;
  const auto json = nlohmann::json::parse(read_text(out / "bench.json"));
  EXPECT_EQ(json["ranks"]["pp"], 2);
  EXPECT_TRUE(json["losses_equal"].get<bool>());
  ASSERT_EQ(json["rows"].size(), 3u);
  for (const auto& row : json["rows"]) {
    EXPECT_EQ(row["stage_layers"][0].get<int64_t>() + row["stage_layers"][1].get<int64_t>(), 4) << row["entry"];
    ASSERT_EQ(row["rank_peak_bytes"].size(), 2u);
    for (size_t rank = 0; rank < 2; ++rank) {
      EXPECT_NEAR(row["rank_peak_bytes"][rank].get<int64_t>(), row["predicted_rank_peak_bytes"][rank].get<int64_t>(),
                  kPeakSlack)
          << row["entry"] << ", rank " << rank;
    }
    if (row["budget_bytes"] > 0) {
      EXPECT_LE(row["predicted_peak_bytes"], row["budget_bytes"]);
    }
  }
}

// Tensor parallelism inside the stages: two stages of a tensor-parallel pair (4 ranks),
// with and without sequence parallelism, train as the pair alone does, bitwise, without
// clipping (the norm adds the split parameters' sums over the stages, in another order).
TEST_F(PipelineTraining, TensorParallelStagesTrainAsTheTensorParallelPair) {
  const std::string base = common_ + kLlama + " train.steps=2 train.grad_clip=0 parallel.tp=2 ";
  for (const std::string sp : {"false", "true"}) {
    const Result pair = run_remat("launch --nproc 2 train " + base + "parallel.sp=" + sp + " run.name=tp-" + sp);
    ASSERT_EQ(pair.exit_code, 0) << pair.output;
    const Result staged =
        run_remat("launch --nproc 4 train " + base + "parallel.pp=2 parallel.sp=" + sp + " run.name=tp-pp-" + sp);
    ASSERT_EQ(staged.exit_code, 0) << staged.output;
    EXPECT_NE(staged.output.find("each layer split over 2 tensor-parallel ranks"), std::string::npos);
    EXPECT_EQ(losses("tp-pp-" + sp), losses("tp-" + sp)) << "sp " << sp;
    EXPECT_EQ(summary("tp-pp-" + sp)["final_val_loss"], summary("tp-" + sp)["final_val_loss"]);
    EXPECT_EQ(summary("tp-pp-" + sp)["parameters"], summary("tp-" + sp)["parameters"]);
    EXPECT_EQ(summary("tp-pp-" + sp)["rank_peak_bytes"].size(), 4u);
    expect_same_tensors("tp-pp-" + sp, "tp-" + sp, "checkpoints/step-00000002.safetensors");
    expect_same_tensors("tp-pp-" + sp, "tp-" + sp, "model.safetensors");
  }
}

// A stage killed in the middle of training: the other stops within parallel.timeout with
// the sentence naming it, instead of waiting for ever on its transfers.
TEST_F(PipelineTraining, ALostStageStopsTheOtherWithASentence) {
  const int port = remat::cli::free_port();
  const std::string settings = "train.steps=100000 parallel.pp=2 parallel.timeout=60 run.name=lost";
  const pid_t first = start_rank(0, 2, port, settings), second = start_rank(1, 2, port, settings);
  while (train_lines("lost").empty() && ::waitpid(first, nullptr, WNOHANG) == 0) ::usleep(10000);
  ::kill(second, SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  EXPECT_EQ(wait_exit(second), 128 + SIGKILL);
  EXPECT_EQ(wait_exit(first), 1);
  const std::string log = read_text(dir_ / "log0");
  EXPECT_TRUE(std::regex_search(log, std::regex(R"(error: rank 1 stopped answering during [^\n]*step \d+)"))) << log;
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 20s);
}

}  // namespace
