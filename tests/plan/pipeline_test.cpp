// Pipeline plans: the solver reproduces ColossalAI's example and equals brute force, both
// over its own model and over every plan the step simulator prices; each stage's
// prediction holds its microbatches in flight and its own parameters.
#include "plan/plan_test_util.h"
#include "remat/cost.h"
#include "remat/ops.h"
#include "remat/pipeline.h"
#include "remat/planner.h"
#include "remat/policy.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

namespace remat {
namespace {

using pipeline::Schedule;

TEST(PipelineSchedule, HoldsAtMostItsMicrobatchesInFlight) {
  EXPECT_EQ(pipeline::actions(Schedule::one_f_one_b, 2, 1, 3),
            (std::vector<pipeline::Action>{{false, 0}, {true, 0}, {false, 1}, {true, 1}, {false, 2}, {true, 2}}));
  EXPECT_EQ(pipeline::actions(Schedule::one_f_one_b, 2, 0, 3),
            (std::vector<pipeline::Action>{{false, 0}, {false, 1}, {true, 0}, {false, 2}, {true, 1}, {true, 2}}));
  // One stage runs each microbatch's forward, then its backward, whatever the schedule.
  const std::vector<pipeline::Action> alone{{false, 0}, {true, 0}, {false, 1}, {true, 1}};
  EXPECT_EQ(pipeline::actions(Schedule::gpipe, 1, 0, 2), alone);
  for (size_t i = 0; i < alone.size(); ++i) EXPECT_EQ(pipeline::backward_follows(alone, i), i % 2 == 0) << i;
  const auto first = pipeline::actions(Schedule::one_f_one_b, 2, 0, 3);
  for (size_t i = 0; i < first.size(); ++i) EXPECT_FALSE(pipeline::backward_follows(first, i)) << i;
  for (const Schedule sched : {Schedule::one_f_one_b, Schedule::gpipe}) {
    for (int64_t P = 1; P <= 5; ++P) {
      for (int64_t M = 1; M <= 7; ++M) {
        for (int64_t s = 0; s < P; ++s) {
          const auto actions = pipeline::actions(sched, P, s, M);
          ASSERT_EQ(actions.size(), static_cast<size_t>(2 * M));
          int64_t held = 0, most = 0, forwards = 0, backwards = 0;
          for (const auto& a : actions) {
            // Forwards and backwards each in microbatch order, a backward after its forward.
            EXPECT_EQ(a.microbatch, a.backward ? backwards++ : forwards++);
            EXPECT_LT(a.microbatch, forwards);
            held += a.backward ? -1 : 1;
            most = std::max(most, held);
          }
          EXPECT_EQ(most, pipeline::in_flight(sched, P, s, M)) << P << " stages, stage " << s << ", " << M;
        }
      }
    }
  }
}

// The simulated step of balanced stages is the schedules' known (m + p - 1) slots of a
// forward and a backward; one stage is its microbatches one after another.
TEST(PipelineSchedule, BalancedStagesTakeTheirSlotsOfTheFillAndDrain) {
  for (const Schedule sched : {Schedule::one_f_one_b, Schedule::gpipe}) {
    for (int64_t P = 1; P <= 5; ++P) {
      for (int64_t M = 1; M <= 7; ++M) {
        const std::vector<pipeline::StageTimes> stages(static_cast<size_t>(P), {1.5, 2.75});
        EXPECT_DOUBLE_EQ(pipeline::simulate(sched, stages, M), static_cast<double>(M + P - 1) * 4.25)
            << pipeline::schedule_name(sched) << ", " << P << " stages, " << M << " microbatches";
      }
    }
  }
}

// Unbalanced stages and transfers, worked by hand. Two stages, 2 microbatches, stage 1
// taking 1 + 2 s and stage 2 3 + 4 s, transfers 0.5 s. 1F1B: stage 1 runs F0 [0, 1], F1
// [1, 2]; stage 2 F0 [1.5, 4.5], B0 [4.5, 8.5], F1 [8.5, 11.5], B1 [11.5, 15.5]; stage 1 B0
// [9, 11], B1 [16, 18]. GPipe's stage 2 runs F1 first, [4.5, 7.5], then B0 [7.5, 11.5] and
// B1 [11.5, 15.5]: stage 1's B0 [12, 14], B1 [16, 18].
// Three microbatches, 1F1B: stage 1 F0 F1 B0 F2 B1 B2 waits for B0 (ready at 9), so F2
// runs [11, 12], stage 2's F2 [15.5, 18.5] and B2 [18.5, 22.5], stage 1's B2 [23, 25].
// GPipe: stage 2's forwards end at 10.5, its backwards at 14.5, 18.5, 22.5: B2 [23, 25].
TEST(PipelineSchedule, UnbalancedStagesWaitForTheirNeighbours) {
  const std::vector<pipeline::StageTimes> stages{{1, 2}, {3, 4}};
  for (const Schedule sched : {Schedule::one_f_one_b, Schedule::gpipe}) {
    EXPECT_DOUBLE_EQ(pipeline::simulate(sched, stages, 2, 0.5), 18) << pipeline::schedule_name(sched);
    EXPECT_DOUBLE_EQ(pipeline::simulate(sched, stages, 3, 0.5), 25) << pipeline::schedule_name(sched);
  }
}

TEST(PipelinePlan, HoldsTheMicrobatchesItsScheduleHasInFlight) {
  // 1F1B: stage s of p (from 0) holds p - s, at most all microbatches; GPipe all of them.
  EXPECT_EQ(pipeline::in_flight(Schedule::one_f_one_b, 4, 0, 8), 4);
  EXPECT_EQ(pipeline::in_flight(Schedule::one_f_one_b, 4, 3, 8), 1);
  EXPECT_EQ(pipeline::in_flight(Schedule::one_f_one_b, 4, 0, 2), 2);
  EXPECT_EQ(pipeline::in_flight(Schedule::gpipe, 4, 3, 8), 8);
  EXPECT_EQ(pipeline::even_split(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(pipeline::schedule_of_name("gpipe"), Schedule::gpipe);
  EXPECT_THROW(pipeline::schedule_of_name("interleaved"), std::invalid_argument);
}

// ColossalAI issue #5509: 32 layers on 4 devices of 20 GB under 1F1B. Per 8 layers a stage
// holds 40/30/20/10 GB of activations without checkpointing and 4/3/2/1 GB with it (10
// GB and 1 GB per microbatch in flight, the 4/3/2/1 microbatches of 1F1B); a layer's
// forward and backward take 3 units, one more when checkpointed. In units of 1/8 GB: 10
// per plain layer and microbatch, 1 per checkpointed one, a budget of 160.
pipeline::Problem colossalai_example() {
  constexpr int64_t unit = 125'000'000;  // 1/8 GB
  pipeline::Problem p;
  p.layers = 32;
  p.budget = 160 * unit;
  for (int64_t s = 0; s < 4; ++s) p.in_flight.push_back(pipeline::in_flight(Schedule::one_f_one_b, 4, s, 8));
  p.pieces = {{1, 10 * unit, 10 * unit, 3.0}, {1, 1 * unit, 1 * unit, 4.0}};  // plain, checkpointed
  p.frame = [](int64_t, int64_t) { return pipeline::Frame{}; };
  return p;
}

std::vector<int64_t> checkpointed(const pipeline::Solution& s) {
  std::vector<int64_t> out;
  for (const auto& st : s.stages) out.push_back(std::count(st.pieces.begin(), st.pieces.end(), int64_t{1}));
  return out;
}

TEST(PipelinePlan, ReproducesColossalAIsExample) {
  pipeline::Problem p = colossalai_example();
  const auto joint = pipeline::solve(p);
  ASSERT_TRUE(joint.has_value());
  // The optimum: 7/8/8/9 layers with 4/3/0/0 checkpointed, 113% of the 24 units
  // the even split takes without recompute (which does not fit: stage 1 would hold 40 GB).
  EXPECT_EQ(joint->seconds, 27.0);
  EXPECT_NEAR(joint->seconds / 24.0, 1.125, 1e-12);
  std::vector<int64_t> layers, peaks;
  for (const auto& st : joint->stages) {
    layers.push_back(st.layers);
    peaks.push_back(st.peak / 125'000'000);
  }
  EXPECT_EQ(layers, (std::vector<int64_t>{7, 8, 8, 9}));
  EXPECT_EQ(checkpointed(*joint), (std::vector<int64_t>{4, 3, 0, 0}));
  EXPECT_EQ(peaks, (std::vector<int64_t>{136, 159, 160, 90}));  // 17, 19.9, 20, 11.3 GB as the issue lists
  EXPECT_EQ(joint->stages[joint->bottleneck].seconds, 27.0);

  // The even split, 8 layers a stage: its first stage must checkpoint 5 layers, 121%.
  p.split = {8, 8, 8, 8};
  const auto even = pipeline::solve(p);
  ASSERT_TRUE(even.has_value());
  EXPECT_EQ(even->seconds, 29.0);
  EXPECT_EQ(std::lround(100 * even->seconds / 24.0), 121);
  EXPECT_EQ(checkpointed(*even)[0], 5);
  EXPECT_EQ(even->bottleneck, 0);

  // At 15 units a stage can hold at most 3, 5, 7 and 15 checkpointed layers: 30 of the 32.
  p.split.clear();
  p.budget = 15 * 125'000'000;
  EXPECT_FALSE(pipeline::solve(p).has_value());
  p.budget = 16 * 125'000'000;  // 4 + 5 + 8 + 16 layers
  EXPECT_TRUE(pipeline::solve(p).has_value());
}

// An independent reading of the stage model for the brute force: walk the pieces, then
// add the other microbatches in flight.
int64_t walk_peak(const pipeline::Problem& p, const pipeline::Frame& f, int64_t k, const std::vector<int64_t>& ids) {
  int64_t below = f.under, high = f.outside;
  for (const int64_t i : ids) {
    high = std::max(high, below + p.pieces[i].top);
    below += p.pieces[i].kept;
  }
  if (f.head_top >= 0) high = std::max(high, below + f.head_top);
  return std::max(f.statics + (k - 1) * (below + f.over) + high, f.statics + f.optimizer);
}

// The least (slowest stage, total) over every split and every tiling of each stage.
std::optional<std::pair<double, double>> brute_force(const pipeline::Problem& p) {
  const auto P = static_cast<int64_t>(p.in_flight.size());
  std::optional<std::pair<double, double>> best;
  std::vector<int64_t> ids;  // the pieces of the stages so far
  std::function<void(int64_t, int64_t, double, double)> stage;
  // Stage s holds n layers from `used`; its pieces start at ids[begin]; `left` to tile.
  std::function<void(int64_t, int64_t, int64_t, size_t, int64_t, double, double)> tile =
      [&](int64_t s, int64_t used, int64_t n, size_t begin, int64_t left, double slow, double total) {
        if (left == 0) {
          const pipeline::Frame f = p.frame(s, n);
          const std::vector<int64_t> mine(ids.begin() + static_cast<std::ptrdiff_t>(begin), ids.end());
          if (walk_peak(p, f, p.in_flight[s], mine) > p.budget) return;
          int64_t host = 0;
          for (const int64_t i : mine) host += p.pieces[i].host;
          if (p.in_flight[s] * host > p.host_budget) return;
          double t = f.seconds;
          for (const int64_t i : mine) t += p.pieces[i].seconds;
          stage(s + 1, used + n, std::max(slow, t), total + t);
          return;
        }
        for (int64_t i = 0; i < static_cast<int64_t>(p.pieces.size()); ++i) {
          if (p.pieces[i].span > left) continue;
          ids.push_back(i);
          tile(s, used, n, begin, left - p.pieces[i].span, slow, total);
          ids.pop_back();
        }
      };
  stage = [&](int64_t s, int64_t used, double slow, double total) {
    if (s == P) {
      if (used == p.layers && (!best || std::pair{slow, total} < *best)) best = std::pair{slow, total};
      return;
    }
    for (int64_t n = 1; used + n + (P - s - 1) <= p.layers; ++n) {
      if (s == P - 1 && used + n != p.layers) continue;
      tile(s, used, n, ids.size(), n, slow, total);
    }
  };
  stage(0, 0, 0.0, 0.0);
  return best;
}

TEST(PipelinePlan, SolverEqualsBruteForceOnRandomProblems) {
  std::mt19937_64 rng(20261124);
  const auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  // Offloaded bytes from a generator of their own: the problems are otherwise those
  // without offload. Two in three problems offload; their host budgets bind or not.
  std::mt19937_64 host_rng(20261127);
  const auto host_uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(host_rng);
  };
  int feasible = 0, offloading = 0, host_bound = 0, coarse_found = 0, coarse_lost = 0;
  for (int trial = 0; trial < 150; ++trial) {
    pipeline::Problem p;
    p.layers = uniform(2, 6);
    const int64_t P = uniform(1, std::min<int64_t>(3, p.layers));
    const Schedule sched = uniform(0, 1) == 0 ? Schedule::one_f_one_b : Schedule::gpipe;
    const int64_t m = uniform(1, 4);
    for (int64_t s = 0; s < P; ++s) p.in_flight.push_back(pipeline::in_flight(sched, P, s, m));
    for (int64_t i = uniform(2, 4); i > 0; --i) {
      const int64_t kept = uniform(1, 100);
      p.pieces.push_back(
          {uniform(1, 10) <= 7 ? 1 : uniform(2, 3), kept, kept + uniform(0, 120), static_cast<double>(uniform(1, 20))});
    }
    if (std::none_of(p.pieces.begin(), p.pieces.end(), [](const pipeline::Piece& c) { return c.span == 1; })) {
      p.pieces[0].span = 1;
    }
    const bool offloads = host_uniform(0, 2) > 0;
    for (auto& c : p.pieces) c.host = offloads && c.span == 1 && host_uniform(0, 1) == 1 ? host_uniform(1, 80) : 0;
    p.host_budget = offloads ? host_uniform(0, 600) : 0;
    const int64_t fixed = uniform(0, 200), per_layer = uniform(0, 60), under = uniform(0, 50), over = uniform(0, 50);
    const int64_t head = uniform(0, 150), outside = uniform(0, 150), opt = uniform(0, 500);
    p.frame = [=](int64_t s, int64_t n) {
      pipeline::Frame f;
      f.statics = fixed + n * per_layer + (s == 0 ? 30 : 0);
      f.under = s == 0 ? under : 0;
      f.outside = s == 0 ? outside : 0;
      f.over = s == P - 1 ? over : 0;
      f.head_top = s == P - 1 ? head : -1;
      f.optimizer = opt + 2 * n;
      f.seconds = (s == 0 ? 2.0 : 0.0) + (s == P - 1 ? 5.0 : 0.0);
      return f;
    };
    p.budget = uniform(200, 2500);
    const auto brute = brute_force(p);
    const auto solved = pipeline::solve(p);
    ASSERT_EQ(solved.has_value(), brute.has_value()) << "trial " << trial;
    if (!solved) continue;
    ++feasible;
    EXPECT_EQ(solved->seconds, brute->first) << "trial " << trial;
    // A solution's stages as the problem prices them: each stage's sum of times.
    const auto check = [&](const pipeline::Solution& sol) {
      double total = 0;
      int64_t layers = 0;
      for (size_t s = 0; s < sol.stages.size(); ++s) {
        const auto& st = sol.stages[s];
        total += st.seconds;
        EXPECT_EQ(st.first, layers) << "trial " << trial;
        layers += st.layers;
        EXPECT_EQ(st.peak, walk_peak(p, p.frame(static_cast<int64_t>(s), st.layers), p.in_flight[s], st.pieces));
        EXPECT_LE(st.peak, p.budget) << "trial " << trial;
        int64_t host = 0;
        for (const int64_t i : st.pieces) host += p.pieces[static_cast<size_t>(i)].host;
        EXPECT_EQ(st.host, p.in_flight[s] * host) << "trial " << trial;
        EXPECT_LE(st.host, p.host_budget) << "trial " << trial;
      }
      EXPECT_EQ(layers, p.layers);
      return total;
    };
    const double total = check(*solved);
    for (const auto& st : solved->stages) offloading += st.host > 0;
    EXPECT_EQ(total, brute->second) << "trial " << trial;
    // Whether the plan without the host budget would have offloaded more than it allows.
    pipeline::Problem loose = p;
    loose.host_budget = std::numeric_limits<int64_t>::max() / 8;
    const auto free = pipeline::solve(loose);
    host_bound += free.has_value() && free->seconds < solved->seconds;
    // With two states kept per position the cells widen until two are left: a plan found
    // is still one the problem prices as solved, and no faster than the best.
    pipeline::Problem narrow = p;
    narrow.max_states = 2;
    const auto coarse = pipeline::solve(narrow);
    coarse_found += coarse.has_value();
    coarse_lost += !coarse || coarse->seconds > solved->seconds;
    if (coarse) {
      check(*coarse);
      EXPECT_GE(coarse->seconds, solved->seconds) << "trial " << trial;
    }
  }
  EXPECT_GT(feasible, 40) << "the random budgets should fit many problems";
  EXPECT_GT(coarse_found, feasible / 2) << "two states a position should still plan most problems";
  EXPECT_GT(coarse_lost, 0) << "two states a position should lose some plans";
  EXPECT_GT(offloading, 20) << "some plans offload";
  EXPECT_GT(host_bound, 5) << "some host budgets bind";
}

ModelConfig config(const std::string& preset, int64_t layers) { return testing::plan_config(preset, layers, 0.1); }

cost::StepShape shape_of(int64_t B, int64_t T, int64_t microbatches) {
  return testing::plan_shape(B, T, at::kFloat, microbatches);
}

// A stage holds its own layers' parameters and the others' activations in flight.
// Measured passes time the stages: each stage's forward and backward adds its layers'
// measured passes, its recompute and its ends' share of their measured pass (the two
// shares summing to it; shared as their forward nodes' times are, here by FLOPs, of which
// the embedding's lookup has none). The simulated step lies between the bottleneck's microbatches
// alone and the (m + p - 1) slots of the bottleneck's time, which bound any order.
TEST(PipelinePlan, MeasuredPassesTimeEachStage) {
  const ModelConfig cfg = config("llama-demo", 4);
  cost::NodeTimes times;
  times.flops_per_second = 1e9;
  times.layer_pass_seconds = 0.5;
  times.ends_pass_seconds = 0.25;
  const int64_t M = 3;
  const PlanResult r = Planner(cfg, shape_of(2, 64, M), testing::pipeline_layout(2, Schedule::one_f_one_b), times, {})
                           .predict(compile_policy("every:2", 4, 0.1), {1, 3});
  double ends = 0;
  for (size_t s = 0; s < 2; ++s) {
    const double recompute = r.stages[s].recompute_seconds / static_cast<double>(M);
    const double share = r.stage_seconds[s] - static_cast<double>(r.split[s]) * 0.5 - recompute;
    EXPECT_GE(share, 0) << "stage " << s + 1;
    ends += share;
  }
  EXPECT_NEAR(ends, 0.25, 1e-12);
  EXPECT_GT(r.stages[1].recompute_seconds, 0);  // layer 2 and 4 of every:2 recompute
  EXPECT_EQ(r.bottleneck, 1);
  EXPECT_GE(r.simulated_seconds, static_cast<double>(M) * r.stage_seconds[1]);
  EXPECT_LE(r.simulated_seconds, r.schedule_seconds);
  EXPECT_LT(r.simulated_seconds, r.schedule_seconds);  // stage 1 is the faster: its slots are shorter
}

TEST(PipelinePlan, StagePredictionsHoldTheirPartsAndTheMicrobatchesInFlight) {
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 4);
    cost::NodeTimes times;
    times.flops_per_second = 1.0;
    const ActivationPlan plan = compile_policy("block:1", 4, 0.1);
    const cost::StepShape shape = shape_of(2, 64, 4);
    const cost::StepPrediction all = cost::predict_step(cfg, shape, {}, plan, true, times);
    const Layout first = testing::stage_layout(4, 2, 0), last = testing::stage_layout(4, 2, 1);
    const auto a = cost::predict_step(cfg, shape, first, plan, true, times);
    const auto b = cost::predict_step(cfg, shape, last, plan, true, times);
    EXPECT_EQ(a.layers.size(), 2u);
    EXPECT_EQ(b.first_layer, 2);
    EXPECT_EQ(a.head, 0);
    EXPECT_EQ(b.embedding, 0);
    // The layers' kept bytes split between the stages; the tied GPT-2 head holds its own
    // copy of the embedding on the last stage.
    // Llama's rotation tables are every stage's.
    const int64_t tied = cfg.arch == Arch::gpt2 ? cfg.vocab_size * cfg.d_model * 4 : 0;
    const int64_t rope = cfg.arch == Arch::llama ? ops::rope_tables_bytes(cfg.max_seq, cfg.head_dim(), at::kFloat) : 0;
    EXPECT_GT(a.statics.params, 0);
    EXPECT_EQ(a.statics.params + b.statics.params, all.statics.params + tied + rope) << preset;
    EXPECT_EQ(a.statics.grads + b.statics.grads, all.statics.grads + tied) << preset;
    EXPECT_EQ(a.kept_activations + b.kept_activations, all.kept_activations) << preset;
    EXPECT_EQ(a.recompute_seconds + b.recompute_seconds, all.recompute_seconds) << preset;
    // Under 1F1B the first of two stages holds two of its four microbatches at once, the
    // first of three three: the peak has one more microbatch's kept bytes beside it.
    Layout three = first;
    three.pp = 3;
    three.split = {2, 1, 1};
    const auto c = cost::predict_step(cfg, shape, three, plan, true, times);
    ASSERT_NE(a.peak_at, "optimizer step");
    EXPECT_EQ(c.peak - c.statics.batch, a.peak - a.statics.batch + a.kept_activations) << preset;
    EXPECT_EQ(2 * c.statics.batch, 3 * a.statics.batch);
    EXPECT_EQ(c.peak_at, a.peak_at);
  }
}

// Every plan of a small pipeline over a few keep-sets and uniform chunks of two, priced by
// the step simulator stage by stage: the solver's plan is the fastest that fits.
TEST(PipelinePlan, PlannerEqualsBruteForceOverSimulatedPlans) {
  const std::vector<SlotMask> candidates = {{}, {Slot::attn_probs, Slot::attn_dropout}, {Slot::mlp_act_in}};
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  const SlotMask everything = SlotMask::droppable();
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 4);
    const cost::StepShape shape = shape_of(2, 64, 3);
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 2;
    for (const int64_t P : {2, 3}) {
      for (const Schedule sched : {Schedule::one_f_one_b, Schedule::gpipe}) {
        const Planner planner(cfg, shape, testing::pipeline_layout(P, sched), times, opts);
        // Every split and every plan of it, predicted once.
        struct Priced {
          int64_t peak;
          double slowest;
        };
        std::vector<Priced> all;
        ActivationPlan plan;
        plan.layers.resize(4);
        std::function<void(const std::vector<int64_t>&, int64_t)> walk = [&](const std::vector<int64_t>& split,
                                                                             int64_t pos) {
          if (pos == 4) {
            const PlanResult r = planner.predict(plan, split);
            all.push_back({r.peak(), r.stage_seconds[r.bottleneck]});
            return;
          }
          int64_t end = 0;  // the end of the stage holding `pos`
          for (const int64_t n : split) {
            end += n;
            if (end > pos) break;
          }
          for (const auto& c : candidates) {
            plan.layers[pos] = {c, -1, false, {}, {}};
            walk(split, pos + 1);
          }
          if (pos + 2 <= end) {
            plan.layers[pos] = {everything, -1, false, {}, {}};
            plan.layers[pos + 1] = {everything, pos, false, {}, {}};
            walk(split, pos + 2);
          }
        };
        std::function<void(std::vector<int64_t>&, int64_t)> splits = [&](std::vector<int64_t>& split, int64_t left) {
          if (static_cast<int64_t>(split.size()) == P) {
            if (left == 0) walk(split, 0);
            return;
          }
          for (int64_t n = 1; n <= left; ++n) {
            split.push_back(n);
            splits(split, left - n);
            split.pop_back();
          }
        };
        std::vector<int64_t> split;
        splits(split, 4);
        int64_t lo = all[0].peak, hi = all[0].peak;
        for (const auto& a : all) {
          lo = std::min(lo, a.peak);
          hi = std::max(hi, a.peak);
        }
        EXPECT_EQ(planner.least_budget(), lo) << preset << " P " << P;
        for (int i = 0; i <= 10; ++i) {
          const int64_t budget = lo + (hi - lo) * i / 10;
          double brute = -1;
          for (const auto& a : all) {
            if (a.peak <= budget && (brute < 0 || a.slowest < brute)) brute = a.slowest;
          }
          const auto r = planner.plan({budget, 0});
          ASSERT_TRUE(r.has_value()) << preset << " P " << P << " budget " << budget;
          EXPECT_NEAR(r->stage_seconds[r->bottleneck], brute, 1e-9 * brute) << preset << " P " << P << " " << i;
          EXPECT_LE(r->peak(), budget);
          EXPECT_NEAR(r->schedule_seconds, (3 + P - 1) * r->stage_seconds[r->bottleneck], 1e-9 * brute);
        }
        EXPECT_FALSE(planner.plan({lo - 1, 0}).has_value());
      }
    }
  }
}

// With a host budget the pipeline planner also offloads, each stage holding its offloaded
// bytes once per microbatch in flight: its plans equal brute force over every split, every
// layer's keep-set and offload set and every chunk, with the host budget binding, and no
// stage offloads more than it.
TEST(PipelinePlan, OffloadsAsBruteForceDoesWithinTheHostBudget) {
  const std::vector<SlotMask> candidates = {{Slot::attn_probs, Slot::attn_dropout}};
  const SlotMask everything = SlotMask::droppable();
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 3);
    const cost::StepShape shape = shape_of(2, 32, 3);
    const graph::BlockGraph block = graph::block_graph(cfg, 2, 32, at::kFloat);
    const cost::NodeTimes times = testing::offload_times(block);
    PlannerOptions opts;
    opts.candidates = candidates;
    opts.max_chunk = 2;
    const int64_t host_budget = block.saved_bytes() / 2;  // binds: less than one layer's saved bytes
    const cost::LayerPricer pricer(block, true, times);
    const std::vector<SlotMask> sets = offload_sets(block, pricer, candidates[0], false);
    const pipeline::Schedule sched = Schedule::one_f_one_b;
    for (const int64_t P : {1, 2}) {
      const Planner planner(cfg, shape, testing::pipeline_layout(P, sched), times, opts);
      struct Priced {
        int64_t peak, host;
        double slowest;
      };
      std::vector<Priced> all;
      ActivationPlan plan;
      plan.layers.resize(3);
      std::function<void(const std::vector<int64_t>&, int64_t)> walk = [&](const std::vector<int64_t>& split,
                                                                           int64_t pos) {
        if (pos == 3) {
          const PlanResult r = planner.predict(plan, split);
          int64_t host = 0;
          for (const auto& st : r.stages) host = std::max(host, st.host_peak);
          all.push_back({r.peak(), host, r.stage_seconds[r.bottleneck]});
          return;
        }
        int64_t end = 0;  // the end of the stage holding `pos`
        for (const int64_t n : split) {
          end += n;
          if (end > pos) break;
        }
        for (const SlotMask moved : sets) {
          plan.layers[pos] = {candidates[0], -1, false, {}, moved};
          walk(split, pos + 1);
        }
        if (pos + 2 <= end) {
          plan.layers[pos] = {everything, -1, false, {}, {}};
          plan.layers[pos + 1] = {everything, pos, false, {}, {}};
          walk(split, pos + 2);
        }
      };
      for (const std::vector<int64_t>& split :
           P == 1 ? std::vector<std::vector<int64_t>>{{3}} : std::vector<std::vector<int64_t>>{{1, 2}, {2, 1}}) {
        walk(split, 0);
      }
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (const auto& a : all) {
        if (a.host > host_budget) continue;
        lo = std::min(lo, a.peak);
        hi = std::max(hi, a.peak);
      }
      EXPECT_EQ(planner.least_budget(host_budget), lo) << preset << " P " << P;
      int offloading = 0, bound = 0;
      for (int i = 0; i <= 6; ++i) {
        const int64_t budget = lo + (hi - lo) * i / 6;
        double brute = -1, unbounded = -1;
        for (const auto& a : all) {
          if (a.peak > budget) continue;
          if (unbounded < 0 || a.slowest < unbounded) unbounded = a.slowest;
          if (a.host <= host_budget && (brute < 0 || a.slowest < brute)) brute = a.slowest;
        }
        const auto r = planner.plan({budget, host_budget});
        ASSERT_TRUE(r.has_value()) << preset << " P " << P << " budget " << budget;
        // The program's plan is the one before its prefetches, which only take time off.
        ActivationPlan unfetched = r->plan;
        for (LayerPlan& l : unfetched.layers) l.prefetch = false;
        const PlanResult program = planner.predict(unfetched, r->split);
        EXPECT_NEAR(program.stage_seconds[program.bottleneck], brute, 1e-9 * brute) << preset << " P " << P << " " << i;
        EXPECT_LE(r->stage_seconds[r->bottleneck], program.stage_seconds[program.bottleneck]);
        EXPECT_LE(r->peak(), budget);
        for (const auto& st : r->stages) {
          EXPECT_LE(st.host_peak, host_budget);
          offloading += st.host_peak > 0;
        }
        bound += unbounded < brute;
      }
      EXPECT_GT(offloading, 0) << preset << " P " << P;
      EXPECT_GT(bound, 0) << preset << " P " << P << ": the host budget binds";
    }
  }
}

// Where the copies back would keep the compute waiting, each stage's layers below another
// of the stage prefetch where that stage's step gains and its peak stays within the budget;
// none prefetches at a stage's top, whose layer above is on the next rank. One microbatch:
// with two in flight, each prefetch here would raise its stage's peak over the budget.
TEST(PipelinePlan, EachStagePrefetchesWhereItsStepGains) {
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 8);
    const Planner planner =
        testing::waiting_copies_planner(cfg, shape_of(2, 32, 1), testing::pipeline_layout(2, Schedule::one_f_one_b));
    const int64_t lo = planner.least_budget(testing::kAllHost);
    const int64_t hi = planner.none_peak();
    int prefetching = 0;
    for (int i = 0; i <= 12; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 12;
      const auto r = planner.plan({budget, testing::kAllHost});
      ASSERT_TRUE(r.has_value()) << preset << " budget " << budget;
      EXPECT_LE(r->peak(), budget) << preset;
      ActivationPlan unfetched = r->plan;
      bool any = false;
      for (int64_t l = 0, end = 0, s = 0; l < cfg.n_layer; ++l) {
        if (l == end) end += r->split[static_cast<size_t>(s++)];
        EXPECT_EQ(r->plan.layers[static_cast<size_t>(l)].prefetch, r->plan.prefetches(l, end))
            << preset << " layer " << l;
        any = any || r->plan.layers[static_cast<size_t>(l)].prefetch;
        unfetched.layers[static_cast<size_t>(l)].prefetch = false;
      }
      if (!any) continue;
      ++prefetching;
      const PlanResult before = planner.predict(unfetched, r->split);
      double gained = 0;
      for (size_t s = 0; s < r->stages.size(); ++s) {
        EXPECT_LE(r->stages[s].added_seconds(), before.stages[s].added_seconds()) << preset << " stage " << s;
        gained += before.stages[s].added_seconds() - r->stages[s].added_seconds();
      }
      EXPECT_GT(gained, 0) << preset;
    }
    EXPECT_GT(prefetching, 0) << preset;
  }
}

// Past the program's merge of its partial plans, offload options may crowd out the best
// plan without them: the planner with a host budget is never slower than without one
// (at these sizes, it was at some budgets before it solved the plan without offload too).
TEST(PipelinePlan, OffloadNeverSlowsThePlanPastTheMerge) {
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset, 8);
    const cost::StepShape shape = shape_of(2, 32, 4);
    const graph::BlockGraph block = graph::block_graph(cfg, 2, 32, at::kFloat);
    cost::NodeTimes times = testing::offload_times(block);
    times.host_bytes_per_second /= 16;  // copies that often do not pay
    PlannerOptions opts;
    opts.max_states = 16;
    const Planner planner(cfg, shape, testing::pipeline_layout(2, Schedule::one_f_one_b), times, opts);
    const int64_t lo = planner.least_budget();
    const int64_t hi = planner.none_peak();
    for (int i = 0; i <= 12; ++i) {
      const int64_t budget = lo + (hi - lo) * i / 12;
      const auto alone = planner.plan({budget, 0});
      const auto r = planner.plan({budget, testing::kAllHost});
      ASSERT_TRUE(alone.has_value() && r.has_value()) << preset << " budget " << budget;
      EXPECT_LE(r->stage_seconds[r->bottleneck], alone->stage_seconds[alone->bottleneck]) << preset << " " << i;
      EXPECT_LE(r->peak(), budget) << preset;
    }
  }
}

// The size: 32 layers on 8 stages, the whole frontier and chunks up to four. How
// long it takes is printed (README), not asserted.
TEST(PipelinePlan, Plans32LayersOn8Stages) {
  const ModelConfig cfg = config("llama-demo", 32);
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  const Planner planner(cfg, shape_of(4, 128, 16), testing::pipeline_layout(8, Schedule::one_f_one_b), times);
  const int64_t none = planner.none_peak();
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = planner.plan({none * 6 / 10, 0});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.has_value());
  EXPECT_LE(r->peak(), none * 6 / 10);
  int64_t layers = 0;
  for (const int64_t n : r->split) layers += n;
  EXPECT_EQ(layers, 32);
  std::printf("32 layers x 8 stages planned in %.3f s (frontier of %zu keep-sets)\n", seconds,
              planner.layer_frontier().size());
}

}  // namespace
}  // namespace remat
