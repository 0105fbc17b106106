// Policies: the segments they choose, their refusals, and that applying one leaves the
// user's module tree as it was.
#include "remat/checkpoint.h"

#include "checkpoint/checkpoint_test_util.h"

#include <torch/csrc/autograd/autograd.h>

namespace {

using remat::CheckpointSegment;
using remat::plan_checkpoint_segments;
using remat::testing::expect_error;
using remat::testing::seeded;

// "p[0..2) c[2..3)" style rendering, to compare plans in one line.
std::string render(const std::vector<CheckpointSegment>& segments) {
  std::string s;
  for (const auto& seg : segments) {
    s += (s.empty() ? "" : " ") + std::string(seg.checkpointed ? "c" : "p") + "[" + std::to_string(seg.begin) + ".." +
         std::to_string(seg.end) + ")";
  }
  return s;
}

TEST(CheckpointPolicy, SegmentsOfEachPolicy) {
  EXPECT_EQ(render(plan_checkpoint_segments("none", 4)), "p[0..4)");
  EXPECT_EQ(render(plan_checkpoint_segments("full", 3)), "c[0..1) c[1..2) c[2..3)");
  // every:K is 1-based: modules 2 and 4 of 5 are indices 1 and 3.
  EXPECT_EQ(render(plan_checkpoint_segments("every:2", 5)), "p[0..1) c[1..2) p[2..3) c[3..4) p[4..5)");
  EXPECT_EQ(render(plan_checkpoint_segments("every:1", 2)), "c[0..1) c[1..2)");
  EXPECT_EQ(render(plan_checkpoint_segments("every:3", 3)), "p[0..2) c[2..3)");
  EXPECT_EQ(render(plan_checkpoint_segments("uniform:2", 5)), "c[0..2) c[2..4) c[4..5)");
  EXPECT_EQ(render(plan_checkpoint_segments("uniform:3", 3)), "c[0..3)");
}

TEST(CheckpointPolicy, PlansDependOnlyOnPosition) {
  // The same call gives the same plan every time: no counter survives between calls.
  EXPECT_EQ(render(plan_checkpoint_segments("every:2", 4)), render(plan_checkpoint_segments("every:2", 4)));
}

TEST(CheckpointPolicy, RefusalsSayWhatIsValid) {
  expect_error([] { plan_checkpoint_segments("every:0", 4); },
               "remat::apply_checkpointing: policy 'every:0': K must be at least 1 (every:K "
               "checkpoints modules K, 2K, 3K, ... counted from 1); use 'none' to checkpoint "
               "nothing.");
  expect_error([] { plan_checkpoint_segments("every:5", 4); },
               "remat::apply_checkpointing: policy 'every:5': K = 5 is larger than the stack, "
               "which has 4 modules; use K between 1 and 4.");
  expect_error([] { plan_checkpoint_segments("uniform:0", 4); }, "policy 'uniform:0': N must be at least 1");
  expect_error([] { plan_checkpoint_segments("uniform:9", 4); },
               "policy 'uniform:9': N = 9 is larger than the stack, which has 4 modules");
  expect_error([] { plan_checkpoint_segments("every:two", 4); }, "policy 'every:two': K must be a whole number");
  expect_error([] { plan_checkpoint_segments("every:-1", 4); }, "policy 'every:-1': K must be a whole number");
  expect_error([] { plan_checkpoint_segments("every:99999999999999999999999", 4); },
               "is larger than the stack, which has 4 modules");
  expect_error([] { plan_checkpoint_segments("selective", 4); },
               "remat::apply_checkpointing: unknown checkpointing policy 'selective'. Valid "
               "policies: none, full, every:K (1 <= K <= 4), uniform:N (1 <= N <= 4).");
}

TEST(CheckpointPolicy, ApplyingLeavesTheModuleTreeUntouched) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  std::vector<std::string> names_before;
  std::vector<void*> storages_before;
  for (const auto& item : seq->named_parameters()) {
    names_before.push_back(item.key());
    storages_before.push_back(item.value().data_ptr());
  }
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "full");
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({2, 4}, gen).requires_grad_(true);
  stack.forward(x).sum().backward();
  std::vector<std::string> names_after;
  std::vector<void*> storages_after;
  for (const auto& item : seq->named_parameters()) {
    names_after.push_back(item.key());
    storages_after.push_back(item.value().data_ptr());
    EXPECT_TRUE(item.value().grad().defined()) << item.key();
  }
  EXPECT_EQ(names_after, names_before);
  EXPECT_EQ(storages_after, storages_before);
  EXPECT_EQ(seq->size(), 2u);
}

TEST(CheckpointPolicy, SegmentsAreNamedInErrors) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  remat::CheckpointOptions o;
  o.name = "encoder";
  o.use_reentrant = true;
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "uniform:2", o);
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({2, 4}, gen).requires_grad_(true);
  const at::Tensor y = stack.forward(x);
  expect_error([&] { torch::autograd::grad({y.sum()}, {x}); },
               "remat::checkpoint 'encoder modules[2]': use_reentrant=true does not work");
}

TEST(CheckpointPolicy, ChangedContainerIsRefused) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "every:2");
  seq->push_back(torch::nn::Linear(4, 4));
  at::Generator gen = seeded(1);
  expect_error(
      [&] {
        stack.forward(at::randn({2, 4}, gen));
      },
      "remat::apply_checkpointing: the container has 3 modules now but had 2 when its "
      "checkpointing was planned");
}

}  // namespace
