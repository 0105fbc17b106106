// A run that cannot fit the memory its machine has free is refused before it allocates:
// its parameters, gradients and moments before any time profile builds a model, its plan's
// peak after planning, with the budget that would fit named.
#include "run/run.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace remat {
namespace {

struct Resolved {
  std::string error;  ///< empty: resolved
  int64_t peak = 0;
  int64_t host = 0;  ///< predicted host bytes of the offloaded slots
  int profiles = 0;  ///< time profiles asked for (each would build a model)
};

Resolved resolve(const std::vector<std::string>& overrides, int64_t available, int64_t host_available = -1) {
  Resolved r;
  RunInputs in;
  in.memory_available = available;
  in.host_available = host_available;
  PriceSource prices(
      [&](const Config&) {
        ++r.profiles;
        Prices p;
        p.times.flops_per_second = 1.0;
        return p;
      },
      // A byte copied costs a FLOP: offload is priced.
      [](const Config&, Prices& p) { p.times.host_bytes_per_second = 1.0; });
  in.prices = &prices;
  try {
    const RunSpec spec = resolve_run(load_config("", overrides), in);
    r.peak = spec.plan.peak();
    r.host = spec.plan.predicted.host_peak;
  } catch (const std::invalid_argument& e) {
    r.error = e.what();
  }
  return r;
}

int64_t statics(const std::vector<std::string>& overrides) {
  RunInputs in;
  PriceSource prices([](const Config&) { return Prices{}; }, [](const Config&, Prices&) {});
  in.prices = &prices;
  const RunSpec spec = resolve_run(load_config("", overrides), in);
  return cost::static_bytes(spec.local.model, spec.shape, spec.layout).total();
}

// The memory free that leaves a CPU rank's tensors `room` bytes: an eighth of them and
// 256 MiB go to the heap.
int64_t free_for(int64_t room) { return (int64_t{256} << 20) + room / 8 * 9; }

const std::vector<std::string> kNone = {"model.preset=gpt2-demo", "ac.policy=none", "ac.profile=false"};
const std::vector<std::string> kAutos = {"model.preset=gpt2-demo", "model.attention=auto", "model.loss_head=auto",
                                         "ac.profile=false"};

TEST(MachineFit, UncheckedOrAmpleMemoryResolvesAsBefore) {
  const Resolved unchecked = resolve(kNone, -1);
  ASSERT_EQ(unchecked.error, "");
  const Resolved ample = resolve(kNone, free_for(unchecked.peak + 8));
  EXPECT_EQ(ample.error, "");
  EXPECT_EQ(ample.peak, unchecked.peak);
  const Resolved autos = resolve(kAutos, free_for(resolve(kAutos, -1).peak + 8));
  EXPECT_EQ(autos.error, "");
}

TEST(MachineFit, StaticsAboveTheMachineAreRefusedBeforeAnyProfile) {
  // Both autos unresolved: the statics are counted before either op is chosen.
  const Resolved r = resolve(kAutos, free_for(statics(kNone) - 1));
  EXPECT_EQ(r.profiles, 0);
  EXPECT_NE(r.error.find("for its parameters, gradients and AdamW moments alone, more than the "), std::string::npos)
      << r.error;
  EXPECT_NE(r.error.find("no recompute plan fits; lower model.n_layer"), std::string::npos) << r.error;
}

TEST(MachineFit, APlanAboveTheMachineNamesABudgetThatFits) {
  const int64_t none = resolve(kNone, -1).peak;
  std::vector<std::string> full = kNone;
  full[1] = "ac.policy=full";
  const int64_t least = resolve(full, -1).peak;
  ASSERT_LT(least + (2 << 20), none);
  const int64_t room = (none + least) / 2 / 8 * 8, available = free_for(room);

  const Resolved r = resolve(kNone, available);
  const std::string budget = "ac.budget=" + std::to_string(room >> 20) + "MiB";
  EXPECT_EQ(r.error.rfind("The plan none peaks at ", 0), 0u) << r.error;
  EXPECT_NE(r.error.find("give a memory budget of at most that, " + budget + " in place of ac.policy,"),
            std::string::npos)
      << r.error;

  // The budget named resolves to a plan under what the machine has.
  std::vector<std::string> budgeted = kNone;
  budgeted[1] = budget;
  const Resolved fits = resolve(budgeted, available);
  ASSERT_EQ(fits.error, "");
  EXPECT_LE(fits.peak, room);

  // A budget above the machine is named as such.
  budgeted[1] = "ac.budget=" + std::to_string(none);
  const Resolved over = resolve(budgeted, available);
  EXPECT_NE(over.error.find("ac.budget=" + std::to_string(none) + " is more than that: give at most " + budget),
            std::string::npos)
      << over.error;
}

// A batch no plan fits is refused from bytes alone, before a time profile ran a step of it
// (a million sequences allocated gigabytes for a minute before the plan's check refused
// them): below the least peak of any op and head the autos may choose, and not above it.
TEST(MachineFit, ABatchNoPlanFitsIsRefusedBeforeAnyProfile) {
  // The least of the minimum feasible budgets the planner names for each op and head.
  int64_t least = std::numeric_limits<int64_t>::max();
  PriceSource declared = PriceSource::declared();
  RunInputs in;
  in.prices = &declared;
  for (const char* attention : {"math", "tiled"}) {
    for (const char* head : {"fused", "recompute"}) {
      try {
        resolve_run(load_config("", {kAutos[0], "ac.budget=1B", std::string("model.attention=") + attention,
                                     std::string("model.loss_head=") + head, kAutos[3]}),
                    in);
      } catch (const BudgetTooSmall& e) {
        least = std::min(least, e.min_budget);
      }
    }
  }
  ASSERT_LT(least, std::numeric_limits<int64_t>::max());
  const Resolved below = resolve(kAutos, free_for((least - 1) / 8 * 8));
  EXPECT_EQ(below.profiles, 0);
  EXPECT_NE(below.error.find("A step of train.batch=16 x train.seq=128 tokens peaks at "), std::string::npos)
      << below.error;
  EXPECT_NE(below.error.find("no plan fits; lower train.batch or train.seq"), std::string::npos) << below.error;
  // At the least, a plan fits: the run goes on to its profiles (and to the budget it names).
  const Resolved at = resolve(kAutos, free_for((least + 7) / 8 * 8));
  EXPECT_GT(at.profiles, 0) << at.error;
  EXPECT_EQ(at.error.find("no plan fits"), std::string::npos) << at.error;
}

// Offloaded slots need host memory: a plan whose host bytes exceed what the rank has free
// is refused before anything runs, whether a policy or the planner (under a host budget
// given above that) chose it.
TEST(MachineFit, OffloadAboveTheHostMemoryFreeIsRefused) {
  std::vector<std::string> offload = kNone;
  offload[1] = "ac.policy=full+offload:[input]";
  const int64_t host = resolve(offload, -1).host;
  ASSERT_GT(host, 0);
  EXPECT_EQ(resolve(offload, -1, host).error, "");
  const Resolved r = resolve(offload, -1, host - 1);
  EXPECT_EQ(r.error.rfind("The plan full+offload:[input] keeps ", 0), 0u) << r.error;
  EXPECT_NE(r.error.find("this rank has free; offload fewer slots, or lower train.batch"), std::string::npos)
      << r.error;

  const std::vector<std::string> planned = {kNone[0], "ac.budget=" + std::to_string(resolve(offload, -1).peak),
                                            kNone[2], std::string("ac.host_budget=1GiB")};
  const Resolved over = resolve(planned, -1, 1);
  EXPECT_NE(over.error.find("offload fewer slots (a smaller ac.host_budget)"), std::string::npos) << over.error;
}

}  // namespace
}  // namespace remat
