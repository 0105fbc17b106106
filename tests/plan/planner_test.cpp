// The planner: its plans equal brute force over every plan of small instances, fit the
// budget as the engine measures it, and its bytes equal Korthikanti et al.'s formula.
#include "plan/plan_test_util.h"
#include "plan/statics.h"
#include "remat/budget.h"
#include "remat/cost.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "util/error_of.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>

namespace remat {
namespace {

ModelConfig config(const std::string& preset, int64_t layers, double dropout) {
  return testing::plan_config(preset, layers, dropout);
}

cost::StepShape shape_of(int64_t B, int64_t T, at::ScalarType dtype = at::kFloat) {
  return testing::plan_shape(B, T, dtype);
}

// Every plan of `L` layers over `candidates` and uniform chunks up to `max_chunk` (each
// with its input kept whole, and under tensor parallelism alone also as a share per rank),
// each single layer also with every op of `ops` (LayerPlan::attention), every choice of
// `weights` (LayerPlan::weights_kept) and, with a `host_budget`, every offload set of
// offload_sets, and with `prefetch` every choice of the layers that prefetch
// (LayerPlan::prefetch), priced by the step simulator; the least time it adds (recompute,
// the other attention op's pass, host copies, weights gathered again) within `budget` and
// `host_budget`.
double brute_force(const ModelConfig& cfg, const cost::StepShape& shape, const Layout& layout,
                   const cost::NodeTimes& times, const std::vector<SlotMask>& candidates, int64_t max_chunk,
                   int64_t budget, int64_t* plans_seen,
                   const std::vector<std::optional<Attention>>& ops = {std::nullopt}, int64_t host_budget = 0,
                   bool prefetch = false, const std::vector<bool>& weights = {false}) {
  const graph::BlockGraph block = graph::block_graph(cfg, shape.batch, shape.seq, shape.dtype, layout);
  const int64_t L = cfg.n_layer;
  double best = -1;
  ActivationPlan plan;
  plan.layers.resize(L);
  const SlotMask everything = SlotMask::droppable();
  const cost::LayerPricer pricer(block, true, times);
  const std::vector<bool> holds =
      layout.tp > 1 && !layout.sp ? std::vector<bool>{false, true} : std::vector<bool>{false};
  std::function<void(int64_t)> walk = [&](int64_t pos) {
    if (pos == L) {
      for (uint32_t mask = 0; mask < (prefetch ? 1u << L : 1u); ++mask) {
        bool counted = false;  // a flag that does not prefetch repeats the plan without it
        for (int64_t l = 0; l < L; ++l) {
          plan.layers[l].prefetch = (mask >> l & 1u) != 0;
          counted = counted || (plan.layers[l].prefetch && !plan.may_prefetch(l, L));
        }
        if (counted) continue;
        ++*plans_seen;
        const auto p = cost::predict_step(cfg, shape, layout, plan, true, times);
        const double seconds = p.added_seconds();
        if (p.peak <= budget && p.host_peak <= host_budget && (best < 0 || seconds < best)) best = seconds;
      }
      return;
    }
    for (const bool sharded : holds) {
      for (const auto& c : candidates) {
        for (const auto& op : ops) {
          for (const SlotMask moved :
               host_budget > 0 ? offload_sets(block, pricer, c, sharded) : std::vector<SlotMask>{{}}) {
            for (const bool kept : weights) {
              plan.layers[pos] = {c, -1, sharded, op, moved, false, kept};
              walk(pos + 1);
            }
          }
        }
      }
      for (int64_t n = 2; n <= std::min(max_chunk, L - pos); ++n) {
        for (int64_t j = pos; j < pos + n; ++j) {
          plan.layers[j] = {everything, j == pos ? -1 : pos, j == pos && sharded, {}, {}};
        }
        walk(pos + n);
      }
    }
  };
  walk(0);
  return best;
}

TEST(Planner, EqualsBruteForceOnSmallInstances) {
  const std::vector<SlotMask> candidates = {{},
                                            {Slot::attn_probs, Slot::attn_dropout},
                                            {Slot::mlp_act_in},
                                            {Slot::attn_qkv, Slot::attn_probs, Slot::attn_dropout},
                                            {Slot::mlp_proj_in, Slot::mlp_fc_in}};
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 4, 0.1);
    const auto shape = shape_of(2, 64);
    const Layout layout;
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 3;
    const Planner planner(cfg, shape, layout, times, opts);
    const int64_t lo = planner.least_budget(), hi = planner.none_peak();
    int solved = 0;
    for (int i = -1; i <= 12; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 12;
      int64_t seen = 0;
      const double brute = brute_force(cfg, shape, layout, times, candidates, 3, budget, &seen);
      const auto r = testing::solve(planner, budget);
      ASSERT_EQ(r.has_value(), brute >= 0) << preset << " budget " << budget;
      if (!r) continue;
      ++solved;
      EXPECT_DOUBLE_EQ(r->prediction.recompute_seconds, brute) << preset << " budget " << budget;
      EXPECT_LE(r->prediction.peak, budget);
      EXPECT_EQ(seen, 711);  // 5^4 single-layer choices plus every chunking
    }
    EXPECT_EQ(solved, 13) << "every budget from the minimum up fits";
    // The minimum is exact: one byte less fits nothing.
    int64_t seen = 0;
    EXPECT_LT(brute_force(cfg, shape, layout, times, candidates, 3, lo - 1, &seen), 0);
    EXPECT_GE(brute_force(cfg, shape, layout, times, candidates, 3, lo, &seen), 0);
  }
}

// ZeRO-3 over `ranks` data-parallel ranks.
Layout zero3_layout(int64_t ranks) {
  Layout l;
  l.dp = ranks;
  l.zero = 3;
  return l;
}

// Times in FLOPs, a layer's gather at the data-parallel links taking half its forward's.
cost::NodeTimes gathers_priced(const ModelConfig& cfg, const cost::StepShape& shape, const Layout& layout) {
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  const graph::BlockGraph block = graph::block_graph(cfg, shape.batch, shape.seq, shape.dtype, layout);
  const int64_t gathered = cost::gathered_weights(cfg, layout, shape.dtype).layer;
  times.data_link_bytes_per_second =
      graph::LinkTraffic::all_reduce(gathered, layout.dp).bytes / (0.5 * block.forward_flops());
  return times;
}

// Under ZeRO-3 over two ranks, a layer's gathered weights are kept to its backward (more
// bytes kept) or gathered again (one more gather at the data-parallel links, priced at half
// a block's forward): with keep-sets and uniform chunks over three layers, and with offload
// too over two, the plans equal brute force over every layer's choices, within every budget.
TEST(Planner, KeepsOrGathersAgainEachLayersWeightsAsBruteForceDoes) {
  const std::vector<SlotMask> candidates = {{}, {Slot::attn_probs, Slot::attn_dropout}};
  for (const int64_t layers : {3, 2}) {
    const int64_t host = layers == 2 ? int64_t{1} << 40 : 0;
    const ModelConfig cfg = config("gpt2-demo", layers, 0.1);
    const auto shape = shape_of(1, 64);
    const Layout layout = zero3_layout(2);
    cost::NodeTimes times = gathers_priced(cfg, shape, layout);
    const int64_t gathered = cost::gathered_weights(cfg, layout, shape.dtype).layer;
    ASSERT_GT(gathered, 0);
    times.host_bytes_per_second = 4.0;
    times.host_copies_overlap = false;
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 2;
    const Planner planner(cfg, shape, layout, times, opts);
    const int64_t lo = planner.least_budget(host), hi = planner.none_peak() + layers * gathered;
    int kept = 0, again = 0;
    for (int i = 0; i <= 6; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 6;
      int64_t seen = 0;
      const double brute = brute_force(cfg, shape, layout, times, candidates, 2, budget, &seen, {std::nullopt}, host,
                                       false, {false, true});
      const auto r = testing::solve(planner, budget, host);
      ASSERT_EQ(r.has_value(), brute >= 0) << layers << " layers, budget " << budget;
      if (!r) continue;
      EXPECT_DOUBLE_EQ(r->prediction.added_seconds(), brute) << layers << " layers, budget " << budget;
      EXPECT_LE(r->prediction.peak, budget);
      for (int64_t l = 0; l < cfg.n_layer; ++l) ++(r->plan.keeps_weights(l) ? kept : again);
    }
    // Both choices are taken somewhere: the brute force weighed each.
    EXPECT_GT(kept, 0) << layers << " layers";
    EXPECT_GT(again, 0) << layers << " layers";
  }
}

// At some budget keeping some layers' weights and gathering the others' again is faster
// than either for every layer (torchtitan's and DeepSpeed's one setting for all), and at
// none is it slower than the faster of them.
TEST(Planner, ChoosingPerLayerWhetherToGatherAgainBeatsEitherForAll) {
  const ModelConfig cfg = config("llama-demo", 4, 0.0);
  const auto shape = shape_of(1, 128);
  const Layout layout = zero3_layout(4);
  const cost::NodeTimes times = gathers_priced(cfg, shape, layout);
  const auto planner_of = [&](Reshard r) {
    PlannerOptions opts;
    opts.reshard = r;
    return Planner(cfg, shape, layout, times, opts);
  };
  const Planner choose = planner_of(Reshard::automatic), always = planner_of(Reshard::always),
                never = planner_of(Reshard::never);
  const auto seconds = [](const Planner& p, int64_t budget) {
    const auto r = testing::solve(p, budget);
    return r ? r->prediction.added_seconds() : std::numeric_limits<double>::infinity();
  };
  const int64_t lo = choose.least_budget(), hi = never.none_peak();
  EXPECT_EQ(lo, always.least_budget());
  int beaten = 0;
  for (int i = 0; i <= 32; ++i) {
    const int64_t budget = lo + (hi - lo) * i / 32;
    const double best = std::min(seconds(always, budget), seconds(never, budget));
    const double own = seconds(choose, budget);
    EXPECT_LE(own, best) << "budget " << budget;
    if (own < best) ++beaten;
  }
  EXPECT_GT(beaten, 0);
}

// The prediction names the gathered weights live at the peak: at the loss head (the peak
// of a plan keeping everything, with a large vocabulary) the head's own, and one layer's
// for each layer keeping its weights to its backward, which raises the peak by as much.
// In the top layer's backward (the peak of full recompute, with the preset's vocabulary)
// that layer's, and the kept weights of the layers under it: its own kept ones are the
// running part's there.
TEST(Planner, NamesTheGatheredWeightsLiveAtThePeak) {
  ModelConfig cfg = config("gpt2-demo", 4, 0.0);
  cfg.vocab_size = 16384;
  const auto shape = shape_of(2, 64);
  const Layout layout = zero3_layout(2);
  const cost::GatheredWeights g = cost::gathered_weights(cfg, layout, shape.dtype);
  ASSERT_GT(g.layer, 0);
  ASSERT_NE(g.layer, g.head);
  const Planner planner(cfg, shape, layout, gathers_priced(cfg, shape, layout));
  const cost::StepPrediction none = planner.predict(ActivationPlan::none(4), {}, Ledgers::peak).stages[0];
  ASSERT_EQ(none.peak_at, "loss head");
  for (int64_t keeping = 0; keeping <= 4; ++keeping) {
    ActivationPlan plan = ActivationPlan::none(4);
    for (int64_t l = 0; l < keeping; ++l) plan.layers[static_cast<size_t>(l)].weights_kept = true;
    const cost::StepPrediction p = planner.predict(plan, {}, Ledgers::peak).stages[0];
    EXPECT_EQ(p.peak_at, "loss head") << keeping;
    EXPECT_EQ(p.peak, none.peak + keeping * g.layer) << keeping;
    EXPECT_EQ(p.peak_running_weights, g.head) << keeping;
    EXPECT_EQ(p.peak_kept_weights, keeping * g.layer) << keeping;
  }
  const ModelConfig small = config("gpt2-demo", 4, 0.0);
  const Planner recomputing(small, shape, layout, gathers_priced(small, shape, layout));
  for (const int64_t keeping : {0, 1, 4}) {
    ActivationPlan plan = compile_policy("full", small.n_layer);
    for (int64_t l = 4 - keeping; l < 4; ++l) plan.layers[static_cast<size_t>(l)].weights_kept = true;
    const cost::StepPrediction p = recomputing.predict(plan, {}, Ledgers::peak).stages[0];
    EXPECT_EQ(p.peak_at, "backward of layer 4") << keeping;
    EXPECT_EQ(p.peak_running_weights, g.layer) << keeping;
    EXPECT_EQ(p.peak_kept_weights, std::max<int64_t>(keeping - 1, 0) * g.layer) << keeping;
  }
}

// Under tensor parallelism alone each layer's input may also be kept as a share per rank,
// all-gathered before its backward at a measured cost: still the brute force's optimum;
// tighter budgets share inputs, and the loosest (no recompute) keeps them whole.
TEST(Planner, EqualsBruteForceWithInputsKeptAsShares) {
  const std::vector<SlotMask> candidates = {{}, {Slot::attn_probs, Slot::attn_dropout}, {Slot::mlp_act_in}};
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 3, 0.1);
    const cost::StepShape shape = shape_of(2, 64);
    const Layout layout = testing::tp_layout(2);
    cost::NodeTimes times;
    times.flops_per_second = 1.0;
    times.seconds[graph::kInputGather] = graph::block_graph(cfg, 2, 64, at::kFloat, layout).forward_flops() / 1000;
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 3;
    const Planner planner(cfg, shape, layout, times, opts);
    const int64_t lo = planner.least_budget(), hi = planner.none_peak();
    int sharing = 0;  // plans that keep some input as a share
    for (int i = 0; i <= 12; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 12;
      int64_t seen = 0;
      const double brute = brute_force(cfg, shape, layout, times, candidates, 3, budget, &seen);
      const auto r = testing::solve(planner, budget);
      ASSERT_TRUE(r.has_value()) << preset << " budget " << budget;
      EXPECT_DOUBLE_EQ(r->prediction.recompute_seconds, brute) << preset << " budget " << budget;
      EXPECT_LE(r->prediction.peak, budget);
      EXPECT_EQ(seen, 242);  // 6 single-layer choices, 2 per chunk, 3 layers
      const auto shared = [&] {
        return std::count_if(r->plan.layers.begin(), r->plan.layers.end(),
                             [](const LayerPlan& l) { return l.input_sharded; });
      };
      sharing += shared() > 0;
      if (i == 12) {
        EXPECT_EQ(shared(), 0) << preset;
      }
    }
    EXPECT_GT(sharing, 0) << preset;
    int64_t seen = 0;
    EXPECT_LT(brute_force(cfg, shape, layout, times, candidates, 3, lo - 1, &seen), 0);
  }
}

// model.attention = auto per layer: with the other op's times, each layer may run math or
// tiled attention. The plans equal brute force over every op and keep-set per layer (the
// pass difference counted), fit the budget, and mix the ops between the extremes: a
// loose budget keeps math, the faster pass here, in every layer; tighter ones turn some
// layers tiled, whose kept log-sum-exp is far smaller than math's probabilities.
TEST(Planner, ChoosesTheAttentionOpPerLayerAsBruteForceDoes) {
  const std::vector<SlotMask> candidates = {{}, {Slot::attn_probs, Slot::attn_dropout}, {Slot::mlp_act_in}};
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    ModelConfig cfg = config(preset, 3, 0.1);
    cfg.attention_tile = 16;
    const auto shape = shape_of(2, 64);
    const Layout layout;
    ModelConfig tiled = cfg;
    tiled.attention = Attention::tiled;
    cost::NodeTimes times;
    times.flops_per_second = 1.0;
    auto other = std::make_shared<cost::OtherAttention>();
    other->op = Attention::tiled;
    other->times.flops_per_second = 1.0;
    // A tiled layer's pass takes a tenth of a math block's forward longer.
    other->pass_delta = 0.1 * graph::block_graph(cfg, 2, 64, at::kFloat).forward_flops();
    times.other_attention = other;
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 2;
    const Planner planner(cfg, shape, layout, times, opts);
    cost::NodeTimes flops;
    flops.flops_per_second = 1.0;
    const Planner math_only(cfg, shape, layout, flops, opts);
    const Planner tiled_only(tiled, shape, layout, flops, opts);
    const int64_t lo = planner.least_budget(), hi = planner.none_peak();
    // Its uniform chunks run the model's op (math), so tiled alone, chunks tiled, may fit lower.
    EXPECT_LE(lo, math_only.least_budget()) << preset;
    int mixed = 0;
    for (int i = 0; i <= 10; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 10;
      int64_t seen = 0;
      const double brute =
          brute_force(cfg, shape, layout, times, candidates, 2, budget, &seen, {Attention::math, Attention::tiled});
      const auto r = testing::solve(planner, budget);
      ASSERT_TRUE(r.has_value()) << preset << " budget " << budget;
      EXPECT_DOUBLE_EQ(r->prediction.recompute_seconds + r->prediction.attention_seconds, brute)
          << preset << " budget " << budget;
      EXPECT_LE(r->prediction.peak, budget);
      EXPECT_EQ(seen, 6 * 6 * 6 + 6 + 6);  // 6 single-layer choices, or a chunk of 2 at either end
      const auto tiled_layers = std::count_if(r->plan.layers.begin(), r->plan.layers.end(), [](const LayerPlan& l) {
        EXPECT_TRUE(l.attention.has_value()) << "the plan names every layer's op";
        return l.attention == Attention::tiled;
      });
      mixed += tiled_layers > 0 && tiled_layers < cfg.n_layer;
      if (i == 10) {
        EXPECT_EQ(tiled_layers, 0) << preset << ": math fits without recompute, and is faster";
      }
      // Never slower than either op alone where that op fits.
      for (const Planner* alone : {&math_only, &tiled_only}) {
        if (const auto a = testing::solve(*alone, budget)) {
          EXPECT_LE(r->prediction.recompute_seconds + r->prediction.attention_seconds,
                    a->prediction.recompute_seconds + (alone == &tiled_only ? 3 * other->pass_delta : 0.0))
              << preset << " budget " << budget;
        }
      }
    }
    EXPECT_GT(mixed, 0) << preset << ": some budget mixes the ops";
  }
}

// Solves `budget` and `host` bytes of host budget with `planner` (options `opts`, times
// `times`, uniform chunks up to 2) and checks the plan against brute force over the same
// keep-sets and offload sets: equal added time, within the budget and the host budget.
// Returns the plan.
std::optional<testing::Solved> expect_offload_plan_as_brute_force(const Planner& planner, const ModelConfig& cfg,
                                                                  const cost::StepShape& shape,
                                                                  const cost::NodeTimes& times,
                                                                  const PlannerOptions& opts, int64_t budget,
                                                                  int64_t host, const std::string& what) {
  const Layout& layout = planner.layout();
  int64_t seen = 0;
  const double brute = brute_force(cfg, shape, layout, times, opts.candidates, 2, budget, &seen, {std::nullopt}, host);
  const double with_prefetch =
      brute_force(cfg, shape, layout, times, opts.candidates, 2, budget, &seen, {std::nullopt}, host, true);
  auto r = testing::solve(planner, budget, host);
  EXPECT_TRUE(r.has_value()) << what;
  if (!r) return r;
  // The program is exact over the three fates; the prefetches it adds after only take time off.
  ActivationPlan unfetched = r->plan;
  for (LayerPlan& l : unfetched.layers) l.prefetch = false;
  EXPECT_DOUBLE_EQ(planner.predict(unfetched).stages[0].added_seconds(), brute) << what;
  EXPECT_LE(r->prediction.added_seconds(), planner.predict(unfetched).stages[0].added_seconds()) << what;
  EXPECT_GE(r->prediction.added_seconds(), with_prefetch * (1 - 1e-12)) << what;
  EXPECT_LE(r->prediction.peak, budget) << what;
  EXPECT_LE(r->prediction.host_peak, host) << what;
  return r;
}

// With a host budget a kept slot may also wait in host memory, its copies priced at the
// host rate: the plans (before the prefetches added after the program, which take time off
// but never below brute force with prefetch) equal brute force over every keep-set,
// offload set and chunking, with the host budget loose (the offloaded bytes never bind)
// and tight under copies so cheap that every plan would rather offload more (they bind),
// fit both budgets, are never slower than the plans that offload nothing, and fit budgets
// those cannot; the least budget is exact.
TEST(Planner, OffloadsAsBruteForceDoesWithinBothBudgets) {
  const std::vector<SlotMask> candidates = {{}, {Slot::attn_probs, Slot::attn_dropout}};
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    // Two layers: the second's options depend on the host bytes the first offloads.
    const ModelConfig cfg = config(preset, 2, 0.1);
    const auto shape = shape_of(2, 32);
    const Layout layout;
    const graph::BlockGraph block = graph::block_graph(cfg, 2, 32, at::kFloat);
    cost::NodeTimes times = testing::offload_times(block);
    times.host_copy_latency_seconds = block.forward_flops() / 200;
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 2;
    const Planner without(cfg, shape, layout, times, opts);
    const int64_t layer_bytes = block.saved_bytes();
    struct Case {
      int64_t host_budget;
      double copy_speedup;
    };
    for (const Case c : {Case{int64_t{1} << 40, 1.0}, Case{layer_bytes / 2, 100.0}}) {
      cost::NodeTimes priced = times;
      priced.host_bytes_per_second *= c.copy_speedup;
      priced.host_copy_latency_seconds /= c.copy_speedup;
      const Planner planner(cfg, shape, layout, priced, opts);
      const int64_t lo = planner.least_budget(c.host_budget), hi = planner.none_peak();
      EXPECT_LT(lo, without.least_budget()) << preset << ": offload fits below recompute alone";
      int offloading = 0;
      for (int i = 0; i <= 6; ++i) {
        const int64_t budget = lo + (hi - lo) * i / 6;
        const auto r =
            expect_offload_plan_as_brute_force(planner, cfg, shape, priced, opts, budget, c.host_budget,
                                               fmt::format("{} budget {} host {}", preset, budget, c.host_budget));
        ASSERT_TRUE(r.has_value());
        offloading += r->prediction.host_peak > 0;
        if (c.copy_speedup == 1.0) {
          if (const auto w = testing::solve(without, budget)) {
            EXPECT_LE(r->prediction.added_seconds(), w->prediction.added_seconds()) << preset << " budget " << budget;
          }
        }
      }
      EXPECT_GT(offloading, 0) << preset;
      int64_t seen = 0;
      EXPECT_LT(brute_force(cfg, shape, layout, priced, candidates, 2, lo - 1, &seen, {std::nullopt}, c.host_budget), 0)
          << preset << " host " << c.host_budget;
    }
    // Without a host copy rate offload would look free: nothing is offloaded.
    cost::NodeTimes free_copies = times;
    free_copies.host_bytes_per_second = 0;
    EXPECT_EQ(Planner(cfg, shape, layout, free_copies, opts).least_budget(testing::kAllHost), without.least_budget());
  }
}

// Where copies run beside the compute, the solved plan starts a layer's copies back during
// the backward of the layer above wherever the step's prediction then gains and the budget
// still holds: over a sweep of budgets some plans do, each only where
// ActivationPlan::may_prefetch allows, within the budget, and faster than without.
TEST(Planner, PrefetchesWhereTheStepGainsAndTheBudgetHolds) {
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 4, 0.1);
    const Planner planner = testing::waiting_copies_planner(cfg, shape_of(2, 32));
    const int64_t lo = planner.least_budget(testing::kAllHost), hi = planner.none_peak();
    int prefetching = 0;
    for (int i = 0; i <= 24; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 24;
      const auto r = testing::solve(planner, budget, testing::kAllHost);
      ASSERT_TRUE(r.has_value()) << preset << " budget " << budget;
      ActivationPlan unfetched = r->plan;
      bool any = false;
      for (int64_t l = 0; l < cfg.n_layer; ++l) {
        const LayerPlan& lp = r->plan.layers[static_cast<size_t>(l)];
        EXPECT_EQ(lp.prefetch, r->plan.prefetches(l, cfg.n_layer)) << preset << " layer " << l;
        any = any || lp.prefetch;
        unfetched.layers[static_cast<size_t>(l)].prefetch = false;
      }
      EXPECT_LE(r->prediction.peak, budget) << preset;
      if (!any) continue;
      ++prefetching;
      EXPECT_LT(r->prediction.added_seconds(), planner.predict(unfetched).stages[0].added_seconds()) << preset;
    }
    EXPECT_GT(prefetching, 0) << preset;
  }
}

// Under tensor parallelism alone a kept input may also be held as a share per rank, which
// is never offloaded: with both, the plans still equal brute force, within both budgets.
TEST(Planner, OffloadsAsBruteForceDoesWithInputsKeptAsShares) {
  const std::vector<SlotMask> candidates = {{}, {Slot::attn_probs, Slot::attn_dropout}};
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 2, 0.1);
    const cost::StepShape shape = shape_of(2, 32);
    const Layout layout = testing::tp_layout(2);
    const graph::BlockGraph block = graph::block_graph(cfg, 2, 32, at::kFloat, layout);
    cost::NodeTimes times = testing::offload_times(block);
    times.seconds[graph::kInputGather] = block.forward_flops() / 1000;
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 2;
    const int64_t host = block.saved_bytes();
    const Planner planner(cfg, shape, layout, times, opts);
    const int64_t lo = planner.least_budget(host), hi = planner.none_peak();
    int offloading = 0;
    for (int i = 0; i <= 2; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 3;
      const auto r = expect_offload_plan_as_brute_force(planner, cfg, shape, times, opts, budget, host,
                                                        fmt::format("{} budget {}", preset, budget));
      ASSERT_TRUE(r.has_value());
      offloading += r->prediction.host_peak > 0;
      for (const LayerPlan& l : r->plan.layers) {
        EXPECT_FALSE(l.input_sharded && l.offloaded.has(Slot::input)) << preset;
      }
    }
    EXPECT_GT(offloading, 0) << preset;
    int64_t seen = 0;
    EXPECT_LT(brute_force(cfg, shape, layout, times, candidates, 2, lo - 1, &seen, {std::nullopt}, host), 0);
  }
}

// Every offload set priced for a keep-set moves only kept slots and grows by one slot at a
// time, the one whose copies add least to the step per byte first (here the waits: the
// compute loses nothing beside them): the block input, copied behind the whole forward and
// back behind the whole backward, hides entirely and comes before every slot that waits. A
// shared input is left alone.
TEST(Planner, OffloadSetsGrowByTheSlotWhoseCopiesCostLeast) {
  const ModelConfig cfg = config("gpt2-demo", 2, 0.1);
  const SlotMask dropped{Slot::attn_probs, Slot::attn_dropout};
  const graph::BlockGraph block = graph::block_graph(cfg, 2, 64, at::kFloat);
  const cost::LayerPricer pricer(block, true, testing::offload_times(block));
  const std::vector<SlotMask> sets = offload_sets(block, pricer, dropped, false);
  ASSERT_GE(sets.size(), 3u);
  EXPECT_TRUE(sets.front().empty());
  double last = 0;
  size_t input_at = 0, first_waiting = sets.size();
  for (size_t i = 1; i < sets.size(); ++i) {
    EXPECT_EQ(sets[i].slots().size(), i);
    EXPECT_TRUE((sets[i].bits() & dropped.bits()) == 0) << "offloads a dropped slot";
    Slot added = Slot::input;
    for (const Slot s : sets[i].slots()) {
      if (!sets[i - 1].has(s)) added = s;
    }
    const cost::LayerCost alone = pricer.price(dropped, false, SlotMask{added});
    ASSERT_GT(alone.host, 0) << slot_name(added) << ": an offload set moves only slots with bytes of their own";
    const double per_byte = alone.copy_added_seconds() / static_cast<double>(alone.host);
    EXPECT_GE(per_byte, last) << slot_name(added);
    last = per_byte;
    if (added == Slot::input) input_at = i;
    if (per_byte > 0 && first_waiting == sets.size()) first_waiting = i;
  }
  EXPECT_GT(input_at, 0u);
  EXPECT_LT(input_at, first_waiting) << "the input's copies hide";
  EXPECT_LT(first_waiting, sets.size()) << "some slot's copies cannot hide";
  const graph::BlockGraph shared = graph::block_graph(cfg, 2, 64, at::kFloat, testing::tp_layout(2));
  const cost::LayerPricer shared_pricer(shared, true, testing::offload_times(shared));
  for (const SlotMask& s : offload_sets(shared, shared_pricer, dropped, true)) EXPECT_FALSE(s.has(Slot::input));
}

// The state merging keeps a 128-layer plan exact enough to fit; how long it takes is
// printed, not asserted (README: about a second on two busy cores).
TEST(Planner, PlansA128LayerModelWithinItsBudget) {
  ModelConfig cfg = config("llama3-8b", 128, 0.0);
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  const auto start = std::chrono::steady_clock::now();
  const Planner planner(cfg, shape_of(1, 4096, at::kBFloat16), {}, times);
  const int64_t lo = planner.least_budget();
  const int64_t budget = lo + (planner.none_peak() - lo) / 3;
  const auto r = testing::solve(planner, budget);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.has_value());
  EXPECT_LE(r->prediction.peak, budget);
  EXPECT_EQ(r->plan.layers.size(), 128u);
  // Between the extremes the plan recomputes some layers' slots and keeps others'.
  EXPECT_GT(r->prediction.recompute_flops, 0.0);
  EXPECT_LT(r->prediction.recompute_flops, planner.predict(compile_policy("full", 128)).stages[0].recompute_flops);
  std::printf("128 layers, %zu frontier points per layer, planned in %.3f s\n", planner.layer_frontier().size(),
              seconds);
}

TEST(Planner, SweepsBudgetsCoarseToFineEachOnce) {
  EXPECT_EQ(sweep_order(1), std::vector<int>{0});
  EXPECT_EQ(sweep_order(2), (std::vector<int>{0, 1}));
  EXPECT_EQ(sweep_order(5), (std::vector<int>{0, 4, 2, 1, 3}));
  const std::vector<int> order = sweep_order(24);
  ASSERT_EQ(order.size(), 24U);
  EXPECT_EQ(std::vector<int>(order.begin(), order.begin() + 5), (std::vector<int>{0, 23, 11, 6, 18}));
  EXPECT_EQ(std::set<int>(order.begin(), order.end()).size(), 24U);
}

TEST(Planner, AFrontierPastItsTimeSolvesOnlyItsEnds) {
  const ModelConfig cfg = config("gpt2-demo", 4, 0.0);
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  const Planner planner(cfg, shape_of(2, 64, at::kFloat), {}, times);
  const Frontier all = planner.frontier(0, 12);
  EXPECT_EQ(all.asked, 12);
  EXPECT_EQ(all.solved, 12);
  // A limit every solve passes: the two ends, the least-memory and the fastest plans.
  const Frontier ends = planner.frontier(0, 12, 1e-12);
  EXPECT_EQ(ends.solved, 2);
  ASSERT_FALSE(ends.points.empty());
  EXPECT_EQ(ends.points.front().peak, all.points.front().peak);
  EXPECT_EQ(ends.points.back().recompute_seconds, all.points.back().recompute_seconds);
}

// The fused loss head keeps the output weight's gradient ([V, C], float32) where the
// recomputing one keeps the hidden states and a log-sum-exp per token: at a large
// vocabulary and few tokens the recomputing head fits lower budgets, and a budget between
// the two minimums is refused with the head that fits it named.
TEST(Planner, NamesTheRecomputingLossHeadWhereOnlyItFits) {
  ModelConfig cfg = config("gpt2", 2, 0.0);
  cfg.attention = Attention::tiled;
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  // Enough tokens that the fused head's least-memory plan peaks in the loss head, not in
  // the optimizer step (whose largest temporary is as large as the tied [V, C] weight).
  cost::StepShape shape = shape_of(32, 64);
  shape.ce_chunk = 1024;
  ModelConfig recompute = cfg;
  recompute.loss_head = LossHead::recompute;
  const Planner fused_planner(cfg, shape, {}, times), recompute_planner(recompute, shape, {}, times);
  const int64_t fused_min = fused_planner.least_budget();
  const int64_t recompute_min = recompute_planner.least_budget();
  ASSERT_LT(recompute_min, fused_min);
  const int64_t between = (fused_min + recompute_min) / 2;
  EXPECT_FALSE(fused_planner.plan({between, 0}).has_value());
  EXPECT_TRUE(recompute_planner.plan({between, 0}).has_value());
  const std::string why = fused_planner.explain_infeasible({between, 0}, "between");
  EXPECT_NE(why.find("With model.loss_head=recompute"), std::string::npos) << why;
  EXPECT_NE(why.find(memory::format_bytes(recompute_min) + ", within this budget"), std::string::npos) << why;
  // Below both minimums the other head's minimum is still given, without the claim.
  const std::string low = fused_planner.explain_infeasible({recompute_min - 1, 0}, "low");
  EXPECT_NE(low.find("the minimum is " + memory::format_bytes(recompute_min) + "."), std::string::npos) << low;
  // The recomputing head's own sentence has nothing to add.
  EXPECT_EQ(recompute_planner.explain_infeasible({recompute_min - 1, 0}, "low").find("model.loss_head"),
            std::string::npos);
}

// Korthikanti et al. 2022, Table 2: with 16-bit activations and 1-byte dropout masks a
// GPT layer saves sbh(34 + 5as/h) bytes without recompute and 2sbh with full recompute,
// and per rank of t-way tensor parallelism sbh(10 + 24/t + 5as/(ht)) (the layer norms'
// inputs and outputs and the residual masks stay whole on every rank, the rest is split
// with the heads and features). With sequence parallelism and the layer norms' outputs
// kept as the rank's positions (gathered again for the backward, as Megatron does:
// tp_recompute_allgather), sbh(34/t + 5as/(ht)), selective 34sbh/t, full 2sbh/t (also
// without it, the input kept as a share: distribute_saved_activations); keeping
// the two gathered outputs instead adds 2 x 2sbh(1 - 1/t). remat's GPT-2 block saves
// exactly that set plus each LayerNorm's mean and rstd (float32, of the rank's positions);
// with tiled attention, 34 sbh plus the log-sum-exp rows and those statistics.
TEST(Planner, GptLayerBytesEqualKorthikantisFormula) {
  struct Shape {
    int64_t s, b, h, a;
  };
  for (const Shape sh : {Shape{128, 4, 256, 4}, Shape{512, 2, 768, 12}, Shape{2048, 1, 1024, 16}}) {
    ModelConfig cfg = config("gpt2", 3, 0.1);
    cfg.d_model = sh.h;
    cfg.n_head = sh.a;
    cfg.n_kv_head = sh.a;
    cfg.d_ff = 4 * sh.h;
    cfg.max_seq = sh.s;
    const cost::NodeTimes times;
    const int64_t sbh = sh.s * sh.b * sh.h;
    const int64_t layernorm_stats = 2 * 2 * sh.s * sh.b * 4;
    const SlotMask all = SlotMask::droppable();
    for (int64_t t : {1, 2, 4}) {
      const auto block = graph::block_graph(cfg, sh.b, sh.s, at::kBFloat16, testing::tp_layout(t));
      EXPECT_EQ(cost::price_layer(block, {}, true, times).kept,
                sbh * 10 + sbh * 24 / t + 5 * sh.a * sh.s * sh.s * sh.b / t + layernorm_stats)
          << "t " << t << " h " << sh.h;
      EXPECT_EQ(cost::price_layer(block, all, true, times).kept, 2 * sbh) << "t " << t << " h " << sh.h;
      if (t == 1) continue;
      // distribute_saved_activations: the input of a layer recomputed whole, as a share.
      EXPECT_EQ(cost::price_layer(block, all, true, times, true).kept, 2 * sbh / t) << "t " << t << " h " << sh.h;
      const auto sp = graph::block_graph(cfg, sh.b, sh.s, at::kBFloat16, testing::tp_layout(t, true));
      const SlotMask regather{Slot::attn_gathered, Slot::mlp_gathered};
      const SlotMask selective = regather | SlotMask{Slot::attn_probs, Slot::attn_dropout};
      const int64_t attention = 5 * sh.a * sh.s * sh.s * sh.b / t, stats = layernorm_stats / t;
      EXPECT_EQ(cost::price_layer(sp, regather, true, times).kept, sbh * 34 / t + attention + stats) << "t " << t;
      EXPECT_EQ(cost::price_layer(sp, selective, true, times).kept, sbh * 34 / t + stats) << "t " << t;
      EXPECT_EQ(cost::price_layer(sp, all, true, times).kept, 2 * sbh / t) << "t " << t;
      EXPECT_EQ(cost::price_layer(sp, {}, true, times).kept, sbh * 34 / t + 2 * 2 * (sbh - sbh / t) + attention + stats)
          << "t " << t;
    }
    // Tiled attention keeps no [s x s] tensor: the 5as/h term becomes one float32
    // log-sum-exp per row (its output is the projection's input, already in the 34).
    cfg.attention = Attention::tiled;
    const auto tiled = graph::block_graph(cfg, sh.b, sh.s, at::kBFloat16);
    EXPECT_EQ(cost::price_layer(tiled, {}, true, times).kept, sbh * 34 + 4 * sh.a * sh.s * sh.b + layernorm_stats);
    EXPECT_EQ(cost::price_layer(tiled, all, true, times).kept, 2 * sbh);
  }
}

// Trained steps under budget plans: the measured peak never exceeds the budget and is
// within 5% of the prediction.
TEST(Planner, BudgetPlansFitWhenTheEngineRunsThem) {
  memory::install_cpu_tracking();
  at::set_num_threads(1);
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 4, 0.1);
    const int64_t B = 4, T = 64;
    auto shape = shape_of(B, T);
    cost::NodeTimes times;
    times.flops_per_second = 1e9;
    const Planner planner(cfg, shape, {}, times);
    const int64_t lo = planner.least_budget(), hi = planner.none_peak();
    for (int i = 0; i <= 4; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 4;
      const auto r = testing::solve(planner, budget);
      ASSERT_TRUE(r.has_value());
      auto model = Model::create(cfg, at::kCPU, at::kFloat, 3);
      model->set_activation_plan(r->plan, {});
      auto gen = at::detail::createCPUGenerator(9);
      auto tok = at::randint(cfg.vocab_size, {B, T}, gen, at::kLong);
      auto tgt = at::randint(cfg.vocab_size, {B, T}, gen, at::kLong);
      model->zero_grad();
      // What the prediction's statics hold beside the model: optimizer state (2 x params)
      // is allocated here so the engine's step sees the same bytes a trainer's does.
      std::vector<at::Tensor> moments;
      for (const auto& p : model->params()) {
        moments.push_back(at::zeros_like(p.value));
        moments.push_back(at::zeros_like(p.value));
      }
      const int64_t before = memory::stats(at::kCPU).current;
      memory::reset_peak(at::kCPU);
      model->forward_backward(tok, tgt, {5, 2, 0}, 1.0, shape.ce_chunk);
      const int64_t measured = memory::stats(at::kCPU).peak;
      const auto& p = r->prediction;
      // `before` holds parameters, gradients, moments, batch; the prediction counts them too.
      const int64_t predicted_above = p.peak - p.statics.total();
      const int64_t measured_above = measured - before;
      // The statics' allowance for small tensors is what the measurement may use beyond the simulation.
      EXPECT_LE(measured_above, budget - (p.statics.total() - p.statics.small)) << preset << " budget " << budget;
      EXPECT_NEAR(static_cast<double>(measured_above), static_cast<double>(predicted_above),
                  0.05 * static_cast<double>(p.peak))
          << preset << " budget " << budget;
    }
  }
}

// A percentage is a fraction of the peak whatever its size; a bare number is a fraction up
// to 1 and whole bytes above; nothing wraps past int64.
TEST(Budget, PercentagesFractionsAndBytesParseAsWritten) {
  EXPECT_EQ(parse_budget("60%", 1000), 600);
  EXPECT_EQ(parse_budget("101%", 1000), 1010);
  EXPECT_EQ(parse_budget("0.6", 1000), 600);
  EXPECT_EQ(parse_budget("4096", 1000), 4096);
  EXPECT_EQ(parse_budget("1.5e9", 1000), 1500000000);
  EXPECT_EQ(parse_budget("2GiB", 1000), int64_t{2} << 30);
  auto refusal = [](const std::string& text) {
    try {
      parse_budget(text, 1000);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(refusal("1e30"),
            "The memory budget \"1e30\" is 1e+30 bytes, beyond any device (the most accepted is 4 "
            "EiB); give a size such as 12GiB or a fraction such as 0.6.");
  EXPECT_NE(refusal("9000000TiB").find("beyond any device"), std::string::npos);
  EXPECT_EQ(refusal("1.5"),
            "The memory budget \"1.5\" is neither a fraction of the no-recompute peak (at most 1) "
            "nor a whole number of bytes; write e.g. 0.6, 60% or 512MiB.");
  // Read as 16 bytes, infinity and NaN by std::stod; a zero budget was "not a size".
  for (const char* text : {"0x10", "0X1p4", "inf", "nan", "-inf"}) {
    EXPECT_NE(refusal(text).find("is not a size"), std::string::npos) << text;
  }
  EXPECT_EQ(refusal("0"),
            "The memory budget \"0\" leaves no memory; give a size above 0 (e.g. 512MiB) or a fraction of the "
            "no-recompute peak (e.g. 0.6 or 60%).");
  EXPECT_NE(refusal("-5GiB").find("leaves no memory"), std::string::npos);
}

// A host budget is of the host memory free: 150% was taken as more than there is, where
// 1.5 was refused; both are refused now, and 0x10 is no longer 16 bytes.
TEST(Budget, AHostBudgetIsAtMostTheHostMemoryFree) {
  EXPECT_EQ(parse_host_budget("100%", 1000), 1000);
  EXPECT_EQ(parse_host_budget("0", 1000), 0);
  EXPECT_EQ(parse_host_budget("64KiB", 1000), 65536);
  const auto refusal = [](const std::string& text) {
    return testing::error_of<std::invalid_argument>([&] { parse_host_budget(text, 1000); });
  };
  EXPECT_EQ(refusal("150%"),
            "ac.host_budget = \"150%\" is more than all the host memory free; give at most 100% (or a size, e.g. "
            "64GiB).");
  EXPECT_NE(refusal("1.5").find("is not a size"), std::string::npos);
  EXPECT_NE(refusal("0x10").find("is not a size"), std::string::npos);
}

}  // namespace
}  // namespace remat
