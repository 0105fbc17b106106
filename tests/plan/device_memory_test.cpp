// The allocations of a step as the CUDA caching allocator sees them: the same walk as the
// cost model's, buffer by buffer, so its live bytes peak where predict_step says; and what
// the allocator's model makes of them.
#include "plan/plan_test_util.h"
#include "remat/caching_allocator.h"
#include "remat/cost.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

namespace remat {
namespace {

using memory::AllocatorEvent;

// The live bytes of `events` at their highest, checking that each free follows its
// allocation and that what stays live is `held_after` bytes.
int64_t live_peak(const std::vector<AllocatorEvent>& events, int64_t* held_after) {
  std::map<int64_t, int64_t> live;
  int64_t current = 0, peak = 0;
  for (const AllocatorEvent& e : events) {
    if (e.kind == AllocatorEvent::Kind::malloc) {
      EXPECT_GT(e.bytes, 0);
      EXPECT_TRUE(live.emplace(e.id, e.bytes).second) << "id " << e.id << " allocated twice";
      current += e.bytes;
      peak = std::max(peak, current);
    } else {
      const auto it = live.find(e.id);
      EXPECT_NE(it, live.end()) << "id " << e.id << " freed but not live";
      if (it == live.end()) continue;
      current -= it->second;
      live.erase(it);
    }
  }
  *held_after = current;
  return peak;
}

// Stage `stage` of `r` on one of `tp` tensor-parallel ranks, the moments over `zero` ranks.
Layout layout_of(const testing::RandomStep& r, int64_t stage, int64_t tp, int64_t zero) {
  Layout l = testing::stage_layout(r.cfg.n_layer, r.stages, stage, r.schedule);
  l.tp = tp;
  l.dp = zero;
  l.zero = 1;
  return l;
}

TEST(StepAllocations, LiveBytesPeakWherePredictStepSays) {
  // Two steps: the first makes AdamW's moments, which predict_step counts from the start.
  std::mt19937 rng(20261126);
  for (const int64_t stages : {1, 2, 4}) {
    for (int trial = 0; trial < 40; ++trial) {
      const testing::RandomStep r = testing::random_step(rng, stages);
      const at::ScalarType dtype = rng() % 3 == 0 ? at::kBFloat16 : at::kFloat;
      const int64_t tp = rng() % 3 == 0 ? 2 : 1, zero = rng() % 2 ? 2 : 1, workspace = 4096 * (rng() % 2);
      const int64_t stage = static_cast<int64_t>(rng() % static_cast<uint64_t>(stages));
      cost::StepShape shape = testing::plan_shape(3, 48, dtype, r.microbatches);
      shape.ce_chunk = 40;
      const Layout layout = layout_of(r, stage, tp, zero);
      const std::string what = fmt::format("{}, stage {}, {}, tp {}, zero {}, workspace {}", r.text, stage,
                                           c10::toString(dtype), tp, zero, workspace);
      const cost::StepPrediction p = cost::predict_step(r.cfg, shape, layout, r.plan, r.early_stop, {});
      int64_t held = 0;
      const int64_t peak =
          live_peak(cost::step_allocations(r.cfg, shape, layout, r.plan, r.early_stop, 2, workspace), &held);
      EXPECT_EQ(peak, p.peak - p.statics.small + workspace) << what;
      // What stays is what a step holds throughout: the statics and the workspace.
      EXPECT_EQ(held, p.statics.total() - p.statics.small + workspace) << what;
    }
  }
}

TEST(StepAllocations, TheSecondStepRepeatsTheFirstWithTheMomentsMade) {
  const ModelConfig cfg = testing::plan_config("gpt2-demo", 2, 0.0);
  const cost::StepShape shape = testing::plan_shape(2, 32);
  const ActivationPlan plan = compile_policy("every:2", cfg.n_layer, cfg.dropout);
  const auto one = cost::step_allocations(cfg, shape, {}, plan, true, 1, 0);
  const auto two = cost::step_allocations(cfg, shape, {}, plan, true, 2, 0);
  const auto three = cost::step_allocations(cfg, shape, {}, plan, true, 3, 0);
  // The second step's events are the third's: sizes and kinds, in order.
  const size_t first = one.size(), second = two.size() - one.size();
  ASSERT_EQ(three.size(), first + 2 * second);
  EXPECT_GT(first, second);  // the first step also makes AdamW's moments
  for (size_t i = 0; i < second; ++i) {
    const AllocatorEvent& a = two[first + i];
    const AllocatorEvent& b = three[first + second + i];
    EXPECT_EQ(a.kind, b.kind) << i;
    EXPECT_EQ(a.bytes, b.bytes) << i;
  }
}

TEST(DeviceMemory, ReservedHoldsTheAllocatedWhichHoldsTheLivePeak) {
  const ModelConfig cfg = testing::plan_config("llama-demo", 4, 0.0);
  const cost::StepShape shape = testing::plan_shape(4, 64, at::kBFloat16, 2);
  for (const char* policy : {"none", "full", "uniform:2", "modules:[core_attn]"}) {
    const ActivationPlan plan = compile_policy(policy, cfg.n_layer, cfg.dropout);
    const cost::StepPrediction p = cost::predict_step(cfg, shape, {}, plan, true, {});
    for (const bool expandable : {false, true}) {
      memory::AllocatorRules rules;
      rules.expandable_segments = expandable;
      const cost::DeviceMemory m = cost::predict_device_memory(cfg, shape, {}, plan, true, rules, 0);
      // Each request rounds up to 512 bytes, and segments hold whole blocks.
      EXPECT_GE(m.allocated_peak, p.peak - p.statics.small) << policy;
      EXPECT_GE(m.reserved_peak, m.allocated_peak) << policy;
    }
  }
}

TEST(StepAllocations, OnCudaTheSdpaOpAllocatesAsTheFlashKernelDoes) {
  // The flash backward's float32 dq accumulator, [B, T rounded up to 128, Hq, D rounded up
  // to 32] (ATen's flash kernel), is requested once per layer's backward where the
  // shape's kernels are CUDA's, and never where they are the CPU's (it accumulates by thread).
  ModelConfig cfg = testing::plan_config("llama-demo", 2, 0.0);
  cfg.attention = Attention::sdpa;
  cost::StepShape shape = testing::plan_shape(2, 200, at::kBFloat16);
  const ActivationPlan plan = compile_policy("none", cfg.n_layer, cfg.dropout);
  ASSERT_EQ(cfg.head_dim(), 32);
  const int64_t accumulator = 2 * 256 * cfg.n_head * 32 * 4;
  const auto requests = [&](at::DeviceType device) {
    shape.device = device;
    int64_t n = 0;
    for (const AllocatorEvent& e : cost::step_allocations(cfg, shape, {}, plan, true, 1, 0)) {
      n += e.kind == AllocatorEvent::Kind::malloc && e.bytes == accumulator;
    }
    return n;
  };
  EXPECT_EQ(requests(at::kCUDA) - requests(at::kCPU), cfg.n_layer);
}

}  // namespace
}  // namespace remat
