// model.attention = auto: which op the planner takes and why, and what a run records.
#include "run/auto.h"
#include "run/run.h"

#include "data/test_text.h"
#include "remat/graph.h"
#include "remat/model.h"
#include "remat/trainer.h"
#include "run/choice_profiles.h"
#include "util/error_of.h"
#include "util/processes.h"
#include "util/temp_dir.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>

namespace remat {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

// tiny-gpt2 at 256 positions: math keeps a [2 x 2 x 256 x 256] probability tensor per layer
// (and dropout's two), tiled one log-sum-exp per row, so only tiled fits a budget between
// their least peaks.
Config long_tiny(const std::string& budget, bool profile = false) {
  Config c = load_config(
      "", {"model.preset=tiny-gpt2", "model.vocab_size=512", "model.max_seq=256", "train.batch=2", "train.seq=256",
           "model.attention=auto", "ac.profile=" + std::string(profile ? "true" : "false")});
  c.ac.budget = budget;
  return c;
}

using Profiles = testing::AttentionProfiles;

using testing::least_budget;

// A budget halfway between tiled's least peak and math's, in bytes.
std::string only_tiled_fits() {
  const Config c = long_tiny("");
  const int64_t math = least_budget(c, Attention::math), tiled = least_budget(c, Attention::tiled);
  EXPECT_LT(tiled + (1 << 20), math);  // at least a MiB apart: the corpus a run adds does not matter
  return std::to_string((math + tiled) / 2);
}

TEST(AttentionChoice, TakesTiledWhenOnlyItsPlansFitTheBudget) {
  const std::string budget = only_tiled_fits();
  Config cfg = long_tiny(budget), local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  EXPECT_EQ(cfg.model.attention, Attention::tiled);
  EXPECT_EQ(local.model.attention, Attention::tiled);
  EXPECT_EQ(plan_text(cfg, r).rfind("attention: tiled (model.attention = auto): math's least-memory plan peaks at ", 0),
            0u)
      << plan_text(cfg, r);
  EXPECT_NE(plan_text(cfg, r).find("over the "), std::string::npos);
  EXPECT_EQ(r.budget, std::stoll(budget));
  EXPECT_LE(r.predicted.peak, r.budget);
  EXPECT_EQ(profiles.calls[Attention::math], 1);
  EXPECT_EQ(profiles.calls[Attention::tiled], 1);
}

TEST(AttentionChoice, TakesMathWhereBothFitWithoutMeasuredTimes) {
  Config cfg = long_tiny("1GiB"), local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  EXPECT_EQ(cfg.model.attention, Attention::math);
  EXPECT_EQ(
      plan_text(cfg, r).rfind("attention: math (model.attention = auto): both fit the 1.00 GiB budget (peaks ", 0), 0u)
      << plan_text(cfg, r);
  EXPECT_NE(plan_text(cfg, r).find("without measured step times math"), std::string::npos) << plan_text(cfg, r);
}

TEST(AttentionChoice, WithoutBudgetOrProfileTakesMathWithoutPlanningTiled) {
  Config cfg = long_tiny(""), local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  EXPECT_EQ(cfg.model.attention, Attention::math);
  EXPECT_EQ(
      plan_text(cfg, r).rfind("attention: math (model.attention = auto): no ac.budget and no measured step times", 0),
      0u)
      << plan_text(cfg, r);
  EXPECT_EQ(profiles.calls[Attention::math], 1);
  EXPECT_EQ(profiles.calls.count(Attention::tiled), 0u);
}

TEST(AttentionChoice, MeasuredTimesTakeTheLowerPredictedStep) {
  for (const std::string budget : {"", "1GiB"}) {
    for (const bool tiled_faster : {false, true}) {
      Config cfg = long_tiny(budget, /*profile=*/true), local = cfg;
      Profiles profiles;
      profiles.base[Attention::math] = tiled_faster ? 0.3 : 0.2;
      profiles.base[Attention::tiled] = tiled_faster ? 0.2 : 0.3;
      const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
      const Attention faster = tiled_faster ? Attention::tiled : Attention::math;
      EXPECT_EQ(cfg.model.attention, faster) << budget;
      EXPECT_NE(
          plan_text(cfg, r).find(fmt::format("predicted step {:.1f} ms against {}'s {:.1f} ms", 1e3 * r.step_seconds,
                                             tiled_faster ? "math" : "tiled", 1e3 * r.step_seconds + 100)),
          std::string::npos)
          << plan_text(cfg, r);
    }
  }
}

// sdpa is a candidate where this build has it and the model drops no attention
// probabilities: measured fastest there, it is taken; with attention dropout (tiny-gpt2's
// 0.1) it is never planned.
TEST(AttentionChoice, TakesSdpaWhereItRunsAndIsMeasuredFastest) {
  for (const double dropout : {0.0, 0.1}) {
    Config cfg = long_tiny("1GiB", /*profile=*/true);
    cfg.model.dropout = dropout;
    Config local = cfg;
    Profiles profiles;
    profiles.base[Attention::math] = profiles.base[Attention::tiled] = 0.3;
    profiles.base[Attention::sdpa] = 0.2;
    const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
    const bool candidate = kSdpaBuilt && dropout == 0;
    EXPECT_EQ(cfg.model.attention, candidate ? Attention::sdpa : Attention::math) << plan_text(cfg, r);
    EXPECT_EQ(profiles.calls.count(Attention::sdpa), candidate ? 1u : 0u) << dropout;
  }
}

// With both ops measured, under a budget math alone meets only by recomputing, the plan
// runs some layers with math (faster: a tiled layer's pass is 0.1 ms slower here) and the
// others with tiled, whose log-sum-exp leaves room; faster than either op alone.
TEST(AttentionChoice, MeasuredTimesMixTheOpsPerLayerWhereThatIsFaster) {
  Config math_cfg = long_tiny("");
  math_cfg.model.n_layer = 4;
  math_cfg.model.attention = Attention::math;
  Prices flops;
  flops.times.flops_per_second = 1e9;
  const int64_t none = plan_run(math_cfg, at::kFloat, flops).none_peak;
  const int64_t least = least_budget(math_cfg, Attention::math);
  Config cfg = long_tiny(std::to_string((none + least) / 2), /*profile=*/true);
  cfg.model.n_layer = 4;
  Config local = cfg;
  Profiles profiles;
  profiles.base[Attention::math] = 0.2;
  profiles.base[Attention::tiled] = 0.2 + 4 * 1e-4;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  const Attention chosen = cfg.model.attention;
  ASSERT_NE(chosen, Attention::automatic);
  EXPECT_EQ(plan_text(cfg, r).rfind(
                fmt::format("attention: {} (model.attention = auto): per layer, ", attention_name(chosen)), 0),
            0u)
      << plan_text(cfg, r);
  const auto tiled = std::count_if(r.plan.layers.begin(), r.plan.layers.end(),
                                   [](const LayerPlan& l) { return l.attention == Attention::tiled; });
  EXPECT_GT(tiled, 0) << plan_text(cfg, r);
  EXPECT_LT(tiled, 4) << plan_text(cfg, r);
  EXPECT_LE(r.predicted.peak, r.budget);
  // The peak without recompute it is compared with is the model's op's in every layer.
  EXPECT_NE(
      plan_text(cfg, r).find(fmt::format("without recompute ({} attention in every layer) the step would peak at {}",
                                         attention_name(chosen), memory::format_bytes(r.none_peak))),
      std::string::npos)
      << plan_text(cfg, r);
  // The step: the model's op's pass, each layer of math 0.1 ms faster than tiled's.
  EXPECT_NEAR(r.step_seconds, 0.2 + static_cast<double>(tiled) * 1e-4 + r.predicted.recompute_seconds, 1e-12);
  // Faster than either op alone under the same budget (math alone recomputes to fit).
  for (const Attention a : {Attention::math, Attention::tiled}) {
    Config alone = local;
    alone.model.attention = a;
    Prices p = flops;
    p.base_seconds = profiles.base[a];
    const RunPlan one = plan_run(alone, at::kFloat, p, 0, none);
    EXPECT_LT(r.step_seconds, one.step_seconds) << attention_name(a);
  }
  // A resumed run plans the saved plan with both ops' times again.
  SavedPlan saved{r.plan, r.split};
  Config resumed = local;
  const RunPlan again = plan_run_auto(resumed, resumed, at::kFloat, profiles.of(), 0, &saved);
  EXPECT_EQ(again.predicted.peak, r.predicted.peak);
  EXPECT_DOUBLE_EQ(again.step_seconds, r.step_seconds);
}

TEST(AttentionChoice, NeitherFittingGivesTiledsSentenceSayingBothWereTried) {
  Config cfg = long_tiny("64KiB"), local = cfg;
  Profiles profiles;
  const std::string e = error_of<std::invalid_argument>([&] { plan_run_auto(cfg, local, at::kFloat, profiles.of()); });
  EXPECT_EQ(e.rfind("model.attention = auto tried both attention ops and no plan of either fits: math needs a budget "
                    "of at least ",
                    0),
            0u)
      << e;
  EXPECT_NE(e.find(". With tiled: The memory budget 64.00 KiB (64KiB) is below the minimum feasible"),
            std::string::npos)
      << e;
  EXPECT_EQ(cfg.model.attention, Attention::automatic);
}

TEST(AttentionChoice, ANamedOpIsPlannedAsItIs) {
  Config cfg = long_tiny("");
  cfg.model.attention = Attention::tiled;
  Config local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  EXPECT_EQ(cfg.model.attention, Attention::tiled);
  EXPECT_EQ(plan_text(cfg, r).find("attention:"), std::string::npos);
  EXPECT_TRUE(r.choices.empty());
  EXPECT_EQ(profiles.calls[Attention::tiled], 1);
}

// The choice is typed: what was taken and why, beside its sentence.
TEST(AttentionChoice, ChoicesSayWhatWasTakenAndWhy) {
  Config cfg = long_tiny(only_tiled_fits()), local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  ASSERT_EQ(r.choices.size(), 1u);
  EXPECT_EQ(r.choices[0].setting, "model.attention");
  EXPECT_EQ(r.choices[0].taken, "tiled");
  EXPECT_EQ(r.choices[0].reason, ChoiceReason::only_fit);
  Config unbounded = long_tiny(""), unbounded_local = unbounded;
  const RunPlan alone = plan_run_auto(unbounded, unbounded_local, at::kFloat, profiles.of());
  ASSERT_EQ(alone.choices.size(), 1u);
  EXPECT_EQ(alone.choices[0].reason, ChoiceReason::only_candidate);
  EXPECT_NE(alone.choices[0].why.find("no ac.budget"), std::string::npos);
  EXPECT_EQ(unbounded.model.attention, Attention::math);
}

TEST(AttentionChoice, NothingIsBuiltWithTheChoiceUnresolved) {
  const Config cfg = long_tiny("");
  const std::string e = error_of<c10::Error>([&] { Model::create(cfg.model, at::kCPU, at::kFloat, 1); });
  EXPECT_NE(e.find("model.attention = auto names no attention op"), std::string::npos) << e;
  EXPECT_NE(error_of<c10::Error>([] { graph::op::attention(Attention::automatic); }).find("resolves it"),
            std::string::npos);
}

// A training run under a budget only tiled fits: it trains with tiled within the budget,
// says so before training and in plan.txt, and its config.toml names tiled.
TEST(AttentionChoiceRun, TakesTiledUnderABudgetOnlyItFitsAndRecordsIt) {
  const testing::TempDir dir;
  std::ofstream(dir / "corpus.txt") << testing::make_text(600);
  Config cfg =
      load_config("", {"model.preset=tiny-gpt2", "model.vocab_size=0", "model.max_seq=256", "model.attention=auto",
                       "train.steps=2", "train.batch=2", "train.seq=256", "train.warmup=1", "train.eval_every=0",
                       "train.eval_batches=1", "data.vocab_size=512", "data.text=" + (dir / "corpus.txt").string(),
                       "data.dir=" + (dir / "data").string(), "run.out_dir=" + (dir / "runs").string(), "run.threads=1",
                       "run.sample_tokens=0", "run.progress=false", "ac.budget=" + only_tiled_fits()});
  const TrainSummary s = train(cfg);
  EXPECT_GT(s.peak_bytes, 0);
  EXPECT_LE(s.peak_bytes, s.budget_bytes);
  EXPECT_LE(s.predicted_peak_bytes, s.budget_bytes);
  EXPECT_EQ(load_config((fs::path(s.run_dir) / "config.toml").string(), {}).model.attention, Attention::tiled);
  EXPECT_NE(testing::read_text(fs::path(s.run_dir) / "plan.txt")
                .find("\nattention: tiled (model.attention = auto): math's least-memory plan peaks at "),
            std::string::npos);
}

}  // namespace
}  // namespace remat
