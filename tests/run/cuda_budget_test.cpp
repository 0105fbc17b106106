// A budget on CUDA holds the caching allocator's reserved bytes, which the cost model's
// allocated bytes undercount: the planner lowers its own budget until every stage's
// reserved peak fits.
#include "remat/config.h"
#include "remat/policy.h"
#include "run/planning.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace remat {
namespace {

Config demo(const std::string& device, const std::string& budget, int64_t pp, bool expandable) {
  Config c = load_config("", {"model.preset=gpt2-demo", "model.vocab_size=512", "train.batch=4", "train.seq=128",
                              "train.grad_accum=2", "run.device=" + device, "parallel.pp=" + std::to_string(pp),
                              "run.expandable_segments=" + std::string(expandable ? "true" : "false")});
  c.ac.budget = budget;
  return c;
}

// The most any stage reserves under `policy`.
int64_t reserved_under(const std::string& policy, int64_t pp, bool expandable) {
  Config c = demo("cuda", "", pp, expandable);
  c.ac.policy.emplace(policy);
  return plan_run(c, at::kFloat, {}).device_peak().reserved_peak;
}

TEST(CudaBudget, EveryStagesReservedPeakHoldsTheBudget) {
  int lowered = 0;
  for (const int64_t pp : {1, 2}) {
    for (const bool expandable : {false, true}) {
      // Budgets from what `full` reserves to what `none` does: each has a plan.
      const int64_t least = reserved_under("full", pp, expandable), most = reserved_under("none", pp, expandable);
      ASSERT_LT(least, most);
      for (int k = 0; k <= 4; ++k) {
        const std::string budget = std::to_string(least + k * (most - least) / 4);
        const std::string what =
            budget + " bytes, pp=" + std::to_string(pp) + ", expandable=" + (expandable ? "1" : "0");
        const RunPlan cpu = plan_run(demo("cpu", budget, pp, expandable), at::kFloat, {});
        EXPECT_TRUE(cpu.device.empty()) << what;
        const RunPlan cuda = plan_run(demo("cuda", budget, pp, expandable), at::kFloat, {});
        ASSERT_EQ(cuda.device.size(), cuda.split.size()) << what;
        for (const auto& d : cuda.device) {
          EXPECT_LE(d.reserved_peak, cuda.budget) << what;
          EXPECT_GE(d.reserved_peak, d.allocated_peak) << what;
        }
        EXPECT_LE(cuda.peak(), cpu.peak()) << what;
        lowered += cuda.peak() < cpu.peak() ? 1 : 0;
      }
    }
  }
  // The allocator's segments change some plans: what fits allocated bytes does not always fit.
  EXPECT_GT(lowered, 0);
}

TEST(CudaBudget, ABudgetUnderWhatAnyPlanReservesIsASentence) {
  const int64_t least = reserved_under("full", 1, false);
  try {
    plan_run(demo("cuda", std::to_string(least / 2), 1, false), at::kFloat, {});
    FAIL() << "a plan fit half of what full reserves";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("The memory budget"), std::string::npos) << e.what();
  }
}

TEST(CudaBudget, APolicysPlanIsPricedAsItIsWithItsReservedBytes) {
  Config c = demo("cuda", "", 1, false);
  c.ac.policy.emplace("full");
  const RunPlan r = plan_run(c, at::kFloat, {});
  ASSERT_EQ(r.device.size(), 1U);
  EXPECT_GE(r.device[0].allocated_peak, r.predicted.peak - r.predicted.statics.small);
  EXPECT_GE(r.device[0].reserved_peak, r.device[0].allocated_peak);
}

}  // namespace
}  // namespace remat
