// model.loss_head = auto: which head the planner takes and why.
#include "run/auto.h"
#include "run/run.h"

#include "remat/graph.h"
#include "remat/memory.h"
#include "run/choice_profiles.h"
#include "util/error_of.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <optional>
#include <set>

namespace remat {
namespace {

using testing::error_of;

// Two GPT-2 layers at 32 x 64 tokens: the fused head keeps the tied [50257, 768] weight's
// gradient from the forward, the recomputing one a log-sum-exp per token, so the latter fits
// lower budgets (the planner's own test, Planner.NamesTheRecomputingLossHeadWhereOnlyItFits).
Config wide_vocab(const std::string& budget, const std::string& head = "auto", bool profile = false) {
  Config c = load_config("", {"model.preset=gpt2", "model.n_layer=2", "model.dropout=0", "model.attention=tiled",
                              "model.loss_head=" + head, "train.batch=32", "train.seq=64", "train.ce_chunk=1024",
                              "ac.profile=" + std::string(profile ? "true" : "false")});
  c.ac.budget = budget;
  return c;
}

using Profiles = testing::HeadProfiles;

// `cfg` planned with a named head, as plan_run plans it; nullopt where the budget fits no plan.
std::optional<RunPlan> planned_with(Config cfg, LossHead head) {
  cfg.model.loss_head = head;
  Prices p;
  p.times.flops_per_second = 1e9;
  try {
    return plan_run(cfg, at::kFloat, p);
  } catch (const BudgetTooSmall&) {
    return std::nullopt;
  }
}

int64_t least_budget(LossHead head) {
  Config c = wide_vocab("1KiB", loss_head_name(head));
  Prices p;
  p.times.flops_per_second = 1e9;
  try {
    plan_run(c, at::kFloat, p);
  } catch (const BudgetTooSmall& e) {
    return e.min_budget;
  }
  ADD_FAILURE() << "1 KiB fits a plan";
  return 0;
}

TEST(LossHeadChoice, WithoutBudgetTakesTheFusedHeadAlone) {
  Config cfg = wide_vocab(""), local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  EXPECT_EQ(cfg.model.loss_head, LossHead::fused);
  EXPECT_EQ(local.model.loss_head, LossHead::fused);
  EXPECT_EQ(plan_text(cfg, r).rfind("loss head: fused (model.loss_head = auto): no ac.budget", 0), 0u)
      << plan_text(cfg, r);
  EXPECT_EQ(profiles.calls[LossHead::fused], 1);
  EXPECT_EQ(profiles.calls.count(LossHead::recompute), 0u);
}

TEST(LossHeadChoice, TakesTheRecomputingHeadWhereOnlyItFits) {
  const int64_t fused = least_budget(LossHead::fused), recompute = least_budget(LossHead::recompute);
  ASSERT_LT(recompute + (1 << 20), fused);
  const int64_t between = (fused + recompute) / 2;
  Config cfg = wide_vocab(std::to_string(between)), local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  EXPECT_EQ(cfg.model.loss_head, LossHead::recompute);
  EXPECT_EQ(local.model.loss_head, LossHead::recompute);
  EXPECT_EQ(
      plan_text(cfg, r).rfind("loss head: recompute (model.loss_head = auto): the fused head's least-memory plan peaks "
                              "at " +
                                  memory::format_bytes(fused) + ", over the ",
                              0),
      0u)
      << plan_text(cfg, r);
  EXPECT_EQ(r.budget, between);
  EXPECT_LE(r.predicted.peak, between);
}

// At every budget from the recomputing head's least to beyond both no-recompute peaks, the
// head taken is the one whose plan fits with the fewer FLOPs of recompute and head products
// (the recomputing head's logits once more: 2 x tokens x d_model x vocab), from plans of
// the named heads.
TEST(LossHeadChoice, WithoutMeasuredTimesTakesTheFewerFlopsAtEveryBudget) {
  const int64_t lo = least_budget(LossHead::recompute);
  const int64_t hi = planned_with(wide_vocab(""), LossHead::fused)->none_peak + (1 << 20);
  const double logits = 2.0 * 32 * 64 * 768 * 50257;
  std::set<LossHead> taken;
  for (int i = 0; i <= 12; ++i) {
    const std::string budget = std::to_string(lo + (hi - lo) * i / 12);
    const auto fused = planned_with(wide_vocab(budget), LossHead::fused);
    const auto recompute = planned_with(wide_vocab(budget), LossHead::recompute);
    ASSERT_TRUE(recompute.has_value()) << budget;
    const bool want_recompute =
        !fused || recompute->predicted.recompute_flops + logits < fused->predicted.recompute_flops;
    Config cfg = wide_vocab(budget), local = cfg;
    Profiles profiles;
    const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
    EXPECT_EQ(cfg.model.loss_head, want_recompute ? LossHead::recompute : LossHead::fused) << budget;
    const auto& want = (want_recompute ? recompute : fused)->plan.layers;
    ASSERT_EQ(r.plan.layers.size(), want.size());
    for (size_t l = 0; l < want.size(); ++l) EXPECT_EQ(r.plan.layers[l].dropped, want[l].dropped) << budget << " " << l;
    EXPECT_LE(r.predicted.peak, std::stoll(budget));
    taken.insert(cfg.model.loss_head);
    if (fused) {
      EXPECT_NE(plan_text(cfg, r).find("both fit the "), std::string::npos) << plan_text(cfg, r);
    }
  }
  EXPECT_EQ(taken.size(), 2u) << "the sweep should reach both heads";
}

TEST(LossHeadChoice, MeasuredTimesTakeTheLowerPredictedStep) {
  for (const bool recompute_faster : {false, true}) {
    Config cfg = wide_vocab("100GiB", "auto", /*profile=*/true), local = cfg;
    Profiles profiles;
    profiles.base[LossHead::fused] = recompute_faster ? 0.3 : 0.2;
    profiles.base[LossHead::recompute] = recompute_faster ? 0.2 : 0.3;
    const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
    const LossHead faster = recompute_faster ? LossHead::recompute : LossHead::fused;
    EXPECT_EQ(cfg.model.loss_head, faster);
    EXPECT_NE(
        plan_text(cfg, r).find(fmt::format("predicted step {:.1f} ms against the {} head's", 1e3 * r.step_seconds,
                                           loss_head_name(recompute_faster ? LossHead::fused : LossHead::recompute))),
        std::string::npos)
        << plan_text(cfg, r);
  }
}

TEST(LossHeadChoice, NeitherFittingNamesEveryHeadsMinimumAndTheLowersSentence) {
  Config cfg = wide_vocab("64KiB"), local = cfg;
  Profiles profiles;
  const int64_t least = least_budget(LossHead::recompute);
  const std::string e = error_of<BudgetTooSmall>([&] { plan_run_auto(cfg, local, at::kFloat, profiles.of()); });
  EXPECT_EQ(e.rfind("model.loss_head = auto tried both loss heads and no plan of either fits: the fused head needs a "
                    "budget of at least " +
                        memory::format_bytes(least_budget(LossHead::fused)) +
                        " and the recompute head needs a budget of at least " + memory::format_bytes(least) +
                        ". With the recompute head: The memory budget 64.00 KiB (64KiB) is below the minimum feasible",
                    0),
            0u)
      << e;
  EXPECT_EQ(cfg.model.loss_head, LossHead::automatic);
}

// Both choices at once: the head's line, then the attention op's, as `remat plan` prints
// them, each typed.
TEST(LossHeadChoice, BothChoicesAreSaidHeadFirst) {
  Config cfg = wide_vocab("");
  cfg.model.attention = Attention::automatic;
  Config local = cfg;
  Profiles profiles;
  const RunPlan r = plan_run_auto(cfg, local, at::kFloat, profiles.of());
  ASSERT_EQ(r.choices.size(), 2u);
  EXPECT_EQ(r.choices[0].line().rfind("loss head: fused (model.loss_head = auto): no ac.budget", 0), 0u)
      << r.choices[0].line();
  EXPECT_EQ(r.choices[0].reason, ChoiceReason::only_candidate);
  EXPECT_EQ(r.choices[1].line().rfind("attention: math (model.attention = auto): ", 0), 0u) << r.choices[1].line();
  EXPECT_EQ(plan_text(cfg, r).rfind(r.choices[0].line() + "\n" + r.choices[1].line() + "\n", 0), 0u);
  EXPECT_EQ(cfg.model.loss_head, LossHead::fused);
  EXPECT_EQ(cfg.model.attention, Attention::math);
  // Named, nothing is said or changed.
  local = cfg;
  EXPECT_TRUE(plan_run_auto(cfg, local, at::kFloat, profiles.of()).choices.empty());
}

TEST(LossHeadChoice, NothingIsDeclaredWithTheChoiceUnresolved) {
  EXPECT_NE(error_of<c10::Error>([] { graph::op::loss(LossHead::automatic); }).find("resolves it"), std::string::npos);
  const std::string e = error_of<std::invalid_argument>([] { load_config("", {"model.loss_head=both"}); });
  EXPECT_NE(e.find("or auto (the planner chooses one of them"), std::string::npos) << e;
}

}  // namespace
}  // namespace remat
