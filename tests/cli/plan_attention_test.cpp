// `remat plan` under model.attention = auto: the op chosen and why, in the text and the JSON.
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

}  // namespace
