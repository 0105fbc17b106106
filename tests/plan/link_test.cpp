// Collectives priced without a measured profile: by the bytes a ring sends at the link's
// rate (graph::LinkTraffic, cost::NodeTimes), and the plans that pricing leads to.
#include "plan/plan_test_util.h"
#include "remat/cost.h"
#include "remat/planner.h"
#include "remat/prices.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace remat {
namespace {

// FLOP pricing at 1 GFLOP/s, links of 100 MB/s and 20 us a ring step.
cost::NodeTimes flop_times() {
  cost::NodeTimes t;
  t.flops_per_second = 1e9;
  t.link_bytes_per_second = 1e8;
  t.link_latency_seconds = 2e-5;
  return t;
}

const graph::Node& node_of(const graph::BlockGraph& g, const graph::OpDef& op) {
  const auto it = std::find_if(g.nodes.begin(), g.nodes.end(), [&](const graph::Node& n) { return n.op == &op; });
  TORCH_INTERNAL_ASSERT(it != g.nodes.end());
  return *it;
}

// A ring over t ranks: t - 1 steps, each rank sending (t - 1)/t of the whole tensor; an
// all-reduce twice that.
TEST(LinkPricing, RingTrafficIsTheWholeTensorsShareOfTheOtherRanks) {
  const graph::LinkTraffic g = graph::LinkTraffic::gather(8000, 4);
  EXPECT_EQ(g.bytes, 6000);
  EXPECT_EQ(g.messages, 3);
  const graph::LinkTraffic r = graph::LinkTraffic::all_reduce(8000, 4);
  EXPECT_EQ(r.bytes, 12000);
  EXPECT_EQ(r.messages, 6);
  EXPECT_TRUE(graph::LinkTraffic::gather(8000, 1).none());
}

// Keeping attn.gathered's shard and gathering again (tp_recompute_allgather) costs its
// all-gather: bytes over the rate plus a latency per step, not 0.
TEST(LinkPricing, ReGatherCostsItsBytesAtTheLinkRate) {
  const ModelConfig cfg = testing::plan_config("gpt2-demo", 2, 0.0);
  const int64_t B = 2, T = 64, C = cfg.d_model;
  for (const int64_t t : {2, 4}) {
    const graph::BlockGraph block = graph::block_graph(cfg, B, T, at::kFloat, testing::tp_layout(t, true));
    const cost::NodeTimes times = flop_times();
    const double whole = static_cast<double>(B * T * C * 4);
    const double gather = static_cast<double>(t - 1) * 2e-5 + whole * static_cast<double>(t - 1) / t / 1e8;
    EXPECT_DOUBLE_EQ(times.node_seconds(node_of(block, graph::op::sp_gather())), gather) << t;
    // The reduce-scatter is Gloo's all-reduce of the whole sum, twice the bytes and steps.
    const graph::Node& scatter = node_of(block, graph::op::sp_scatter());  // its bias added after the sum
    EXPECT_DOUBLE_EQ(times.node_seconds(scatter), scatter.flops / 1e9 + 2 * gather) << t;
    EXPECT_DOUBLE_EQ(times.node_link_seconds(scatter), 2 * gather) << t;
    const cost::LayerCost again = cost::price_layer(block, {Slot::attn_gathered}, true, times);
    EXPECT_DOUBLE_EQ(again.recompute_seconds, gather) << t;
    EXPECT_DOUBLE_EQ(again.recompute_link_seconds, gather) << t;
    EXPECT_EQ(again.recompute_flops, 0) << t;
    // A measured time is taken as it is.
    cost::NodeTimes measured = times;
    measured.seconds[node_of(block, graph::op::sp_gather()).name] = 0.5;
    EXPECT_DOUBLE_EQ(cost::price_layer(block, {Slot::attn_gathered}, true, measured).recompute_seconds, 0.5) << t;
  }
}

// The all-gather of a block input kept as shares (distribute_saved_activations), and a
// tensor-parallel all-reduce of bfloat16 sums, which go through Gloo in float32.
TEST(LinkPricing, InputGatherAndAllReduceCostTheirBytesAtTheLinkRate) {
  const ModelConfig cfg = testing::plan_config("gpt2-demo", 2, 0.0);
  const int64_t B = 2, T = 64, C = cfg.d_model;
  const cost::NodeTimes times = flop_times();
  for (const int64_t t : {2, 4}) {
    const graph::BlockGraph block = graph::block_graph(cfg, B, T, at::kFloat, testing::tp_layout(t));
    const double whole = static_cast<double>(B * T * C * 4);
    const double gather = static_cast<double>(t - 1) * 2e-5 + whole * static_cast<double>(t - 1) / t / 1e8;
    EXPECT_DOUBLE_EQ(times.input_gather_seconds(block), gather) << t;
    const cost::LayerCost whole_input = cost::price_layer(block, {}, true, times, false);
    const cost::LayerCost shared = cost::price_layer(block, {}, true, times, true);
    EXPECT_DOUBLE_EQ(shared.recompute_seconds - whole_input.recompute_seconds, gather) << t;
    cost::NodeTimes measured = times;
    measured.seconds[graph::kInputGather] = 0.25;
    EXPECT_DOUBLE_EQ(measured.input_gather_seconds(block), 0.25) << t;

    const graph::BlockGraph bf16 = graph::block_graph(cfg, B, T, at::kBFloat16, testing::tp_layout(t));
    const graph::Node& reduce = node_of(bf16, graph::op::tp_reduce());
    EXPECT_DOUBLE_EQ(reduce.forward_link.bytes, 2.0 * whole * static_cast<double>(t - 1) / t) << t;
    EXPECT_EQ(reduce.forward_link.messages, 2 * (t - 1)) << t;
    EXPECT_TRUE(reduce.backward_link.none()) << t;
    EXPECT_TRUE(node_of(bf16, graph::op::tp_copy()).forward_link.none()) << t;
    EXPECT_EQ(node_of(bf16, graph::op::tp_copy()).backward_link.messages, 2 * (t - 1)) << t;
  }
}

// The vocabulary-parallel loss completes its rows' statistics over the ranks in its
// forward (ops/cross_entropy.cpp, chunk_loss): per chunk of rows, one all-reduce each of
// the row max, the sums of exp and the target logits, one float32 per row each (bfloat16
// too: the statistics' dtype), three collectives a chunk. Its backward runs none.
TEST(LinkPricing, VocabularyParallelLossAllReducesThreeFloatsPerRow) {
  const int64_t B = 2, T = 64, N = B * T, chunk = 48;  // chunks of 48, 48 and 32 rows
  const int64_t chunks = (N + chunk - 1) / chunk;
  const cost::NodeTimes times = flop_times();
  for (const LossHead head : {LossHead::fused, LossHead::recompute}) {
    ModelConfig cfg = testing::plan_config("gpt2-demo", 2, 0.0);
    cfg.loss_head = head;
    for (const int64_t t : {2, 4}) {
      for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        const graph::BlockGraph g = graph::head_graph(cfg, B, T, dtype, chunk, testing::tp_layout(t));
        const graph::Node& loss = node_of(g, graph::op::loss(head));
        const double bytes = 3.0 * 2.0 * static_cast<double>(N * 4) * static_cast<double>(t - 1) / t;
        const int64_t messages = chunks * 3 * 2 * (t - 1);
        EXPECT_DOUBLE_EQ(loss.forward_link.bytes, bytes) << t;
        EXPECT_EQ(loss.forward_link.messages, messages) << t;
        EXPECT_TRUE(loss.backward_link.none()) << t;
        // The head's forward, which the planner prices, takes them.
        const double link = static_cast<double>(messages) * 2e-5 + bytes / 1e8;
        EXPECT_DOUBLE_EQ(times.node_seconds(loss), loss.flops / 1e9 + link) << t;
      }
    }
    // One rank holds the whole vocabulary: nothing to complete.
    EXPECT_TRUE(node_of(graph::head_graph(cfg, B, T, at::kFloat, chunk), graph::op::loss(head)).forward_link.none());
  }
}

// With the collectives priced, a budget that needs no recompute keeps every tensor whole:
// no input as shares, no gathered copy dropped; a tight one still shares or gathers again
// where that is what fits.
TEST(LinkPricing, PlannerKeepsTensorsWholeWhenTheBudgetDoesNotNeedTheSaving) {
  for (const bool sp : {false, true}) {
    for (const char* preset : {"gpt2-demo", "llama-demo"}) {
      const ModelConfig cfg = testing::plan_config(preset, 3, 0.1);
      const Planner planner(cfg, testing::plan_shape(2, 64), testing::tp_layout(2, sp), flop_times(), PlannerOptions{});
      const auto whole = [](const ActivationPlan& p) {
        return std::none_of(p.layers.begin(), p.layers.end(), [](const LayerPlan& l) {
          return l.input_sharded || l.dropped.has(Slot::attn_gathered) || l.dropped.has(Slot::mlp_gathered);
        });
      };
      const auto loose = testing::solve(planner, planner.none_peak());
      ASSERT_TRUE(loose.has_value());
      EXPECT_TRUE(whole(loose->plan)) << preset << " sp " << sp;
      EXPECT_EQ(loose->prediction.recompute_seconds, 0) << preset << " sp " << sp;
      const auto tight = testing::solve(planner, planner.least_budget());
      ASSERT_TRUE(tight.has_value());
      EXPECT_FALSE(whole(tight->plan)) << preset << " sp " << sp;
      EXPECT_GT(tight->prediction.recompute_link_seconds, 0) << preset << " sp " << sp;
    }
  }
}

// The data-parallel collectives are priced at the data-parallel links (not the tensor-
// parallel ones), per stage: the gathers the plan adds (stage 3's regathers) in the plan's
// added time, the rest apart from it, and the step at declared rates is the simulated
// passes, recompute and regathers plus the slowest stage's other collectives.
TEST(LinkPricing, DataParallelCollectivesArePricedAtTheirOwnLinks) {
  const ModelConfig cfg = testing::plan_config("gpt2-demo", 4, 0.0);
  const cost::StepShape shape = testing::plan_shape(2, 64, at::kFloat, 2);
  for (const int64_t pp : {1, 2}) {
    for (const int64_t zero : {0, 2, 3}) {
      Layout layout = testing::tp_layout(2, false);
      layout.dp = 4;
      layout.pp = pp;
      layout.zero = zero;
      cost::NodeTimes times = flop_times();
      times.data_link_bytes_per_second = 3e7;
      times.data_link_latency_seconds = 1e-4;
      const ActivationPlan plan = compile_policy("full", cfg.n_layer);
      const PlanResult r = Planner(cfg, shape, layout, times).predict(plan, {}, Ledgers::peak);
      times.link_bytes_per_second *= 10;  // faster tensor-parallel links change none of it
      const PlanResult faster = Planner(cfg, shape, layout, times).predict(plan, {}, Ledgers::peak);
      double slowest = 0;
      for (size_t s = 0; s < r.stages.size(); ++s) {
        const std::string what = fmt::format("pp {} zero {} stage {}", pp, zero, s);
        const cost::DataParallelTraffic t =
            cost::data_parallel_traffic(cfg, shape, layout.at_stage(static_cast<int64_t>(s)), plan);
        ASSERT_FALSE(t.total().none()) << what;
        const auto at_links = [](const graph::LinkTraffic& l) {
          return static_cast<double>(l.messages) * 1e-4 + l.bytes / 3e7;
        };
        const double seconds = at_links(t.fixed()), again = at_links(t.regathers);
        EXPECT_EQ(t.regathers.none(), zero < 3) << what;
        EXPECT_NEAR(r.stages[s].data_parallel_seconds, seconds, 1e-9 * seconds) << what;
        EXPECT_NEAR(r.stages[s].regather_seconds, again, 1e-9 * again) << what;
        EXPECT_NEAR(r.stages[s].added_seconds() - r.stages[s].recompute_seconds, again, 1e-9 * again) << what;
        EXPECT_EQ(faster.stages[s].data_parallel_seconds, r.stages[s].data_parallel_seconds) << what;
        EXPECT_EQ(faster.stages[s].regather_seconds, r.stages[s].regather_seconds) << what;
        slowest = std::max(slowest, seconds);
      }
      EXPECT_NEAR(declared_step_seconds(r), r.simulated_seconds + slowest, 1e-9 * slowest) << pp << " " << zero;
    }
  }
}

}  // namespace
}  // namespace remat
