// The step schedule: the order of a step's actions, and the cost model's simulation of it
// against the engine running it, over random steps: policies and random keep-sets,
// uniform chunks, microbatches, pipeline stages on threads (2 and 4 stages, both
// schedules), both attention ops.
#include "plan/plan_test_util.h"
#include "remat/cost.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "remat/schedule.h"
#include "train/pipeline_step.h"
#include "util/gloo_ranks.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <random>

namespace remat {
namespace {

using schedule::Action;
using schedule::Kind;

TEST(StepSchedule, AMicrobatchRunsItsPartsAndRecomputesAChunkBeforeItsLastLayersBackward) {
  const ActivationPlan plan = compile_policy("uniform:2", 4, 0.0);
  const schedule::Stage whole{0, 4, true, true};
  EXPECT_EQ(schedule::forward(plan, whole, 1, false), (std::vector<Action>{{Kind::embed_forward, 1},
                                                                           {Kind::forward, 1, 0},
                                                                           {Kind::forward, 1, 1},
                                                                           {Kind::forward, 1, 2},
                                                                           {Kind::forward, 1, 3},
                                                                           {Kind::head_forward, 1}}));
  // Its backward next: the head keeps its gathered weights for it.
  EXPECT_EQ(schedule::forward(plan, whole, 1, true).back(), (Action{Kind::head_forward, 1, -1, -1, true}));
  EXPECT_EQ(schedule::backward(plan, whole, 1), (std::vector<Action>{{Kind::head_backward, 1},
                                                                     {Kind::recompute, 1, 2, 3},
                                                                     {Kind::backward, 1, 3},
                                                                     {Kind::backward, 1, 2},
                                                                     {Kind::recompute, 1, 0, 1},
                                                                     {Kind::backward, 1, 1},
                                                                     {Kind::backward, 1, 0},
                                                                     {Kind::embed_backward, 1}}));
  // A middle stage holds neither end.
  EXPECT_EQ(schedule::backward(plan, {2, 4, false, false}, 0),
            (std::vector<Action>{{Kind::recompute, 0, 2, 3}, {Kind::backward, 0, 3}, {Kind::backward, 0, 2}}));
}

// A layer that prefetches has its copies back started before the backward of the layer
// above, behind that layer's own (unless that layer's started earlier still); a layer at a
// stage's top, or beside a uniform chunk, starts its own with its backward.
TEST(StepSchedule, APrefetchingLayersCopiesBackStartBeforeTheBackwardOfTheLayerAbove) {
  ActivationPlan plan = compile_policy("uniform:2", 6, 0.0);
  for (int64_t l = 2; l < 6; ++l) plan.layers[static_cast<size_t>(l)] = LayerPlan{};
  for (LayerPlan& lp : plan.layers) {
    lp.offloaded.add(Slot::input);
    lp.prefetch = true;
  }
  const schedule::Stage whole{0, 6, false, false};
  EXPECT_FALSE(plan.may_prefetch(1, 6)) << "in a chunk";
  EXPECT_FALSE(plan.may_prefetch(5, 6)) << "no layer above";
  EXPECT_EQ(schedule::backward(plan, whole, 0), (std::vector<Action>{{Kind::fetch, 0, 5},
                                                                     {Kind::fetch, 0, 4},
                                                                     {Kind::backward, 0, 5},
                                                                     {Kind::fetch, 0, 3},
                                                                     {Kind::backward, 0, 4},
                                                                     {Kind::fetch, 0, 2},
                                                                     {Kind::backward, 0, 3},
                                                                     {Kind::backward, 0, 2},
                                                                     {Kind::recompute, 0, 0, 1},
                                                                     {Kind::backward, 0, 1},
                                                                     {Kind::backward, 0, 0}}));
  // Layer 3 (from 0) tops the stage of layers 2 and 3.
  EXPECT_EQ(
      schedule::backward(plan, {2, 4, false, false}, 0),
      (std::vector<Action>{{Kind::fetch, 0, 3}, {Kind::fetch, 0, 2}, {Kind::backward, 0, 3}, {Kind::backward, 0, 2}}));
  plan.layers[4].prefetch = false;
  EXPECT_EQ(schedule::backward(plan, {3, 6, false, false}, 0), (std::vector<Action>{{Kind::backward, 0, 5},
                                                                                    {Kind::fetch, 0, 4},
                                                                                    {Kind::fetch, 0, 3},
                                                                                    {Kind::backward, 0, 4},
                                                                                    {Kind::backward, 0, 3}}));
}

TEST(StepSchedule, AStepRunsTheMicrobatchesInThePipelinesOrderThenTheOptimizer) {
  const ActivationPlan plan = compile_policy("none", 2, 0.0);
  const schedule::Stage last{1, 2, false, true};
  // The last of two stages under 1F1B: each forward followed by its backward, the head's
  // gathered weights kept from the one to the other.
  EXPECT_EQ(schedule::step(plan, last, pipeline::Schedule::one_f_one_b, 2, 1, 2),
            (std::vector<Action>{{Kind::forward, 0, 1},
                                 {Kind::head_forward, 0, -1, -1, true},
                                 {Kind::head_backward, 0},
                                 {Kind::backward, 0, 1},
                                 {Kind::forward, 1, 1},
                                 {Kind::head_forward, 1, -1, -1, true},
                                 {Kind::head_backward, 1},
                                 {Kind::backward, 1, 1},
                                 {Kind::optimizer}}));
  // Under GPipe the oldest microbatch's backward comes first: no backward follows its
  // forward at once, and every head gathers again.
  EXPECT_EQ(schedule::step(plan, last, pipeline::Schedule::gpipe, 2, 1, 2),
            (std::vector<Action>{{Kind::forward, 0, 1},
                                 {Kind::head_forward, 0},
                                 {Kind::forward, 1, 1},
                                 {Kind::head_forward, 1},
                                 {Kind::head_backward, 0},
                                 {Kind::backward, 0, 1},
                                 {Kind::head_backward, 1},
                                 {Kind::backward, 1, 1},
                                 {Kind::optimizer}}));
  // The first under GPipe: every forward, then every backward.
  const auto gpipe = schedule::step(plan, {0, 1, true, false}, pipeline::Schedule::gpipe, 2, 0, 2);
  EXPECT_EQ(gpipe, (std::vector<Action>{{Kind::embed_forward, 0},
                                        {Kind::forward, 0, 0},
                                        {Kind::embed_forward, 1},
                                        {Kind::forward, 1, 0},
                                        {Kind::backward, 0, 0},
                                        {Kind::embed_backward, 0},
                                        {Kind::backward, 1, 0},
                                        {Kind::embed_backward, 1},
                                        {Kind::optimizer}}));
}

TEST(StepSchedule, AChunkCrossingIntoAStageIsRefused) {
  const ActivationPlan plan = compile_policy("uniform:4", 4, 0.0);
  try {
    schedule::backward(plan, {2, 4, false, true}, 0);
    FAIL() << "a chunk from layer 1 ran on the stage of layers 3 and 4";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("crosses into the pipeline stage that begins at layer 3"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

constexpr int64_t kB = 3, kT = 48, kChunk = 40;

std::vector<MicrobatchData> random_data(const ModelConfig& cfg, int64_t microbatches, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<MicrobatchData> out;
  for (int64_t m = 0; m < microbatches; ++m) {
    out.push_back({at::randint(cfg.vocab_size, {kB, kT}, gen, at::kLong),
                   at::randint(cfg.vocab_size, {kB, kT}, gen, at::kLong), StepContext{7, 1, static_cast<uint64_t>(m)}});
  }
  return out;
}

// The prediction for stage `stage` of the step, as the bytes the step adds to what is live
// before it: the statics are (the batch too, made beforehand), but for the optimizer's,
// which is not run.
int64_t predicted_rise(const testing::RandomStep& r, int64_t stage) {
  cost::StepShape shape = testing::plan_shape(kB, kT, at::kFloat, r.microbatches);
  shape.ce_chunk = kChunk;
  const Layout layout = testing::stage_layout(r.cfg.n_layer, r.stages, stage, r.schedule);
  const cost::StepPrediction p = cost::predict_step(r.cfg, shape, layout, r.plan, r.early_stop, {});
  EXPECT_NE(p.peak_at, "optimizer step") << r.text;
  return p.peak - p.statics.total();
}

StoreOptions options(const testing::RandomStep& r) {
  StoreOptions o;
  o.early_stop = r.early_stop;
  o.pool = false;  // the pool keeps freed buffers charged to whoever freed them last
  return o;
}

// The engine's step on one thread: its microbatches one after another.
int64_t measured_rise(const testing::RandomStep& r, uint64_t seed) {
  auto model = Model::create(r.cfg, at::kCPU, at::kFloat, 3);
  model->set_activation_plan(r.plan, options(r));
  const std::vector<MicrobatchData> data = random_data(r.cfg, r.microbatches, seed);
  model->zero_grad();
  const memory::Account account;
  for (const auto& d : data) model->forward_backward(d.tokens, d.targets, d.ctx, 1.0, kChunk);
  return account.peak();
}

TEST(StepSchedule, RandomStepsPeakWhereTheCostModelSimulatesThem) {
  memory::install_cpu_tracking();
  at::set_num_threads(1);
  std::mt19937 rng(20261126);
  int trials = 0;
  for (const int64_t stages : {1, 2, 4}) {
    for (int trial = 0; trial < 70; ++trial, ++trials) {
      const testing::RandomStep r = testing::random_step(rng, stages);
      const auto seed = static_cast<uint64_t>(trial);
      if (stages == 1) {
        EXPECT_NEAR(predicted_rise(r, 0), measured_rise(r, seed), 8 * 1024) << r.text;
        continue;
      }
      const std::vector<MicrobatchData> data = random_data(r.cfg, r.microbatches, seed);
      std::vector<int64_t> rise(static_cast<size_t>(stages), -1);
      testing::on_gloo_ranks(
          static_cast<int>(stages), 1,
          [&](dist::Comm& comm) {
            at::set_num_threads(1);  // kernels allocate on the rank's own thread, where it is charged
            const int64_t s = comm.pipeline().rank();
            auto model = Model::create(r.cfg, at::kCPU, at::kFloat, 3,
                                       testing::stage_layout(r.cfg.n_layer, stages, s, r.schedule));
            model->set_activation_plan(r.plan, options(r));
            model->zero_grad();
            const auto draw = [&](int64_t m) { return data[static_cast<size_t>(m)]; };
            const memory::Account account;
            run_pipeline(*model, comm.pipeline(), r.schedule, r.microbatches, draw, 1.0, kChunk, 0);
            rise[static_cast<size_t>(s)] = account.peak();
          },
          static_cast<int>(stages));
      for (int64_t s = 0; s < stages; ++s) {
        EXPECT_NEAR(predicted_rise(r, s), rise[static_cast<size_t>(s)], 8 * 1024) << r.text << ", stage " << s + 1;
      }
    }
  }
  EXPECT_GE(trials, 200);
}

}  // namespace
}  // namespace remat
