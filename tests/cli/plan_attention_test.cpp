// `remat plan` under model.attention = auto and model.loss_head = auto: what was chosen and
// why, in the text and the JSON.
#include "util/processes.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>

namespace {

using remat::testing::Result;
using remat::testing::run_remat;

// gpt2-demo at 1024 positions: math's least plan needs about 165 MiB, tiled's under 100.
const std::string kLong = "model.preset=gpt2-demo model.max_seq=1024 train.batch=2 train.seq=1024 model.attention=auto";

TEST(PlanAttention, PrintsTheOpChosenAndWhy) {
  const Result r = run_remat("plan --budget 120MiB " + kLong);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\nattention: tiled (model.attention = auto): math's least-memory plan peaks at "),
            std::string::npos)
      << r.output;
  const Result j = run_remat("plan --json --budget 120MiB " + kLong);
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const auto out = nlohmann::json::parse(j.output);
  EXPECT_EQ(out["attention"], "tiled");
  EXPECT_EQ(out["attention_choice"].get<std::string>().rfind("attention: tiled (model.attention = auto)", 0), 0u);
  EXPECT_LE(out["breakdown"]["peak"].get<int64_t>(), 120 << 20);
  // Both fit: math, without measured times; a named op says nothing of a choice.
  EXPECT_EQ(nlohmann::json::parse(run_remat("plan --json --budget 1GiB " + kLong).output)["attention"], "math");
  const auto named = nlohmann::json::parse(run_remat("plan --json " + kLong + " model.attention=tiled").output);
  EXPECT_EQ(named["attention"], "tiled");
  EXPECT_EQ(named["attention_choice"], "");
}

TEST(PlanAttention, NeitherFittingSaysBothWereTried) {
  const Result r = run_remat("plan --budget 20MiB " + kLong);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: model.attention = auto tried both attention ops and no plan of either fits"),
            std::string::npos)
      << r.output;
}

// Two GPT-2 layers at 32 x 64 tokens: the fused head keeps the tied [50257, 768] weight's
// gradient, so only the recomputing head fits a budget between the two heads' minimums.
TEST(PlanLossHead, PrintsTheHeadChosenAndWhy) {
  const std::string wide =
      "model.preset=gpt2 model.n_layer=2 model.attention=tiled train.batch=32 train.seq=64 "
      "train.ce_chunk=1024 model.loss_head=";
  const auto least = [&](const std::string& head) {
    const Result r = run_remat("plan --json " + wide + head);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return nlohmann::json::parse(r.output)["min_feasible_budget"].get<int64_t>();
  };
  const int64_t fused = least("fused"), recompute = least("recompute");
  ASSERT_LT(recompute, fused);
  const std::string between = std::to_string((fused + recompute) / 2);
  const Result r = run_remat("plan --budget " + between + " " + wide + "auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\nloss head: recompute (model.loss_head = auto): the fused head's least-memory plan peaks "
                          "at "),
            std::string::npos)
      << r.output;
  const auto out = nlohmann::json::parse(run_remat("plan --json --budget " + between + " " + wide + "auto").output);
  EXPECT_EQ(out["loss_head"], "recompute");
  EXPECT_EQ(out["loss_head_choice"].get<std::string>().rfind("loss head: recompute (model.loss_head = auto)", 0), 0u);
  EXPECT_LE(out["breakdown"]["peak"].get<int64_t>(), std::stoll(between));
  const auto named = nlohmann::json::parse(run_remat("plan --json " + wide + "fused").output);
  EXPECT_EQ(named["loss_head"], "fused");
  EXPECT_EQ(named["loss_head_choice"], "");
}

}  // namespace
