// A step through pipeline stages on Gloo ranks (threads of this process): 2 and 4 stages
// under 1F1B and GPipe give the whole model's loss and gradients, with and without
// recompute; evaluation and the stages' files go through the first stage; a lost stage,
// or a non-finite one, stops the others with a sentence naming it.
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/pipeline.h"
#include "remat/policy.h"
#include "remat/safetensors.h"
#include "train/pipeline_step.h"
#include "train/step.h"
#include "util/gloo_ranks.h"
#include "util/temp_dir.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>

namespace remat {
namespace {

using pipeline::Schedule;

constexpr uint64_t kSeed = 11;
constexpr int64_t kMicro = 3, kB = 2, kT = 8, kChunk = 5, kLayers = 4;

ModelConfig config(const std::string& preset) {
  ModelConfig c = model_preset(preset);
  c.n_layer = kLayers;
  c.dropout = 0.1;
  if (c.vocab_size == 0) c.vocab_size = 96;
  return c;
}

std::vector<MicrobatchData> microbatches(const ModelConfig& cfg) {
  auto gen = at::detail::createCPUGenerator(4);
  std::vector<MicrobatchData> out;
  for (int64_t m = 0; m < kMicro; ++m) {
    out.push_back({at::randint(cfg.vocab_size, {kB, kT}, gen, at::kLong),
                   at::randint(cfg.vocab_size, {kB, kT}, gen, at::kLong), StepContext{7, 1, static_cast<uint64_t>(m)}});
  }
  return out;
}

// The plan of `policy` on `stages`; a trailing "^" adds ac.offload_prefetch.
ActivationPlan plan_of(const ModelConfig& cfg, std::string policy, int64_t stages) {
  AcConfig ac;
  ac.offload_prefetch = policy.back() == '^';
  if (ac.offload_prefetch) policy.pop_back();
  ac.policy.emplace(policy);
  ac.stages = stages;
  return compile_policy(ac, cfg.n_layer, cfg.dropout);
}

struct Whole {
  double loss = 0;
  std::map<std::string, at::Tensor> grads;
};

Whole whole_run(const ModelConfig& cfg, const ActivationPlan& plan) {
  auto model = Model::create(cfg, at::kCPU, at::kFloat, kSeed);
  model->set_activation_plan(plan, {});
  model->zero_grad();
  Whole w;
  for (const auto& d : microbatches(cfg))
    w.loss += model->forward_backward(d.tokens, d.targets, d.ctx, 1.0 / kMicro, kChunk);
  for (const auto& p : model->params()) w.grads[p.name] = p.grad.clone();
  return w;
}

TEST(PipelineStep, StagesOnGlooRanksTrainLikeTheWholeModel) {
  at::set_num_threads(1);
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset);
    for (const int64_t P : {2, 4}) {
      std::map<std::string, Whole> whole;
      std::vector<std::string> policies = {"none", "full", "block:1", "modules:[core_attn]+offload:[input,mlp]"};
      // A stage of one layer has no layer above to prefetch behind.
      if (P == 2) policies.emplace_back("offload:[input,mlp]^");
      for (const std::string& policy : policies) {
        whole[policy] = whole_run(cfg, plan_of(cfg, policy, P));
      }
      for (const Schedule sched : {Schedule::one_f_one_b, Schedule::gpipe}) {
        SCOPED_TRACE(fmt::format("{}, {} stages, {}", preset, P, pipeline::schedule_name(sched)));
        testing::on_gloo_ranks(
            static_cast<int>(P), 1,
            [&](dist::Comm& comm) {
              const int64_t s = comm.pipeline().rank();
              auto model = Model::create(cfg, at::kCPU, at::kFloat, kSeed,
                                         Layout::pipeline_stage(pipeline::even_split(kLayers, P), s));
              for (const auto& [policy, w] : whole) {
                model->set_activation_plan(plan_of(cfg, policy, P), {});
                model->zero_grad();
                double loss = 0;
                const std::vector<MicrobatchData> data = microbatches(cfg);
                const auto draw = [&](int64_t m) { return data[static_cast<size_t>(m)]; };
                for (const double l :
                     run_pipeline(*model, comm.pipeline(), sched, kMicro, draw, 1.0 / kMicro, kChunk, 0)) {
                  loss += l;
                }
                sum_tied_grads(*model, comm.pipeline(), 0);
                EXPECT_EQ(loss, w.loss) << policy << ", stage " << s;
                for (const auto& p : model->params()) {
                  const at::Tensor& want = w.grads.at(p.name);
                  if (p.tied) {
                    // Summed over two stages, not accumulated into one tensor: rounding apart.
                    EXPECT_TRUE(at::allclose(p.grad, want, 1e-5, 1e-7)) << policy << " " << p.name;
                  } else {
                    EXPECT_TRUE(at::equal(p.grad, want)) << policy << " " << p.name << ", stage " << s;
                  }
                }
              }
            },
            static_cast<int>(P));
      }
    }
  }
}

// Validation through three stages on Gloo ranks is the whole model's evaluation, bitwise,
// on every stage.
TEST(PipelineStep, EvaluationThroughStagesIsTheWholeModels) {
  at::set_num_threads(1);
  for (const char* preset : {"gpt2-demo", "llama-demo"}) {
    const ModelConfig cfg = config(preset);
    const std::vector<MicrobatchData> data = microbatches(cfg);
    const double want =
        Model::create(cfg, at::kCPU, at::kFloat, kSeed)->evaluate(data[0].tokens, data[0].targets, kChunk);
    testing::on_gloo_ranks(
        3, 1,
        [&](dist::Comm& comm) {
          const int64_t s = comm.pipeline().rank();
          auto model = Model::create(cfg, at::kCPU, at::kFloat, kSeed, Layout::pipeline_stage({2, 1, 1}, s));
          EXPECT_EQ(evaluate_pipeline(*model, comm.pipeline(), data[0].tokens, data[0].targets, kChunk, "a test"), want)
              << preset << ", stage " << s;
        },
        3);
  }
}

// Three stages' named tensors written into one file on the first: its own first, then each
// later stage's in order, the tied copy once (the first stage's), every dtype and shape
// bit for bit. The first stage holds one received tensor at a time: its tracked memory
// rises during the write by at most the largest of them (512 KiB), not by the 2 MiB the
// later stages send in all.
TEST(PipelineStep, NamedTensorsAreWrittenOnTheFirstStageATensorAtATime) {
  memory::install_cpu_tracking();
  const remat::testing::TempDir dir;
  const std::string path = (dir / "stages.safetensors").string();
  const auto made = [](int s) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(s) + 1);
    std::vector<std::pair<std::string, at::Tensor>> mine{
        {"shared", at::full({2}, 1.5f + static_cast<float>(s))},  // a tied copy: the first stage's is kept
        {fmt::format("s{}.float", s), at::randn({s + 1, 3}, gen)},
        {fmt::format("s{}.long", s), at::arange(s + 2)},
        {fmt::format("s{}.bf16", s), at::randn({4}, gen).to(at::kBFloat16)},
        {fmt::format("s{}.scalar", s), at::full({}, static_cast<double>(s))},
    };
    if (s > 0) {
      for (int k = 0; k < 2; ++k) mine.emplace_back(fmt::format("s{}.big{}", s, k), at::randn({128, 1024}, gen));
    }
    return mine;
  };
  int64_t rise = -1;
  testing::on_gloo_ranks(
      3, 1,
      [&](dist::Comm& comm) {
        const int s = comm.pipeline().rank();
        auto mine = made(s);
        comm.barrier("the tensors made");
        memory::Stats before;
        if (s == 0) {
          memory::reset_peak(at::kCPU);
          before = memory::stats(at::kCPU);
        }
        write_on_first_stage(comm.pipeline(), std::move(mine), s == 0 ? path : "", {{"k", "v"}}, "a test");
        if (s == 0) rise = memory::stats(at::kCPU).peak - before.current;
      },
      3);
  const model::SafeTensors file = model::load_safetensors(path);
  EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"k", "v"}}));
  std::vector<std::pair<std::string, at::Tensor>> expected;
  for (int s = 0; s < 3; ++s) {
    for (auto& named : made(s)) {
      if (s == 0 || named.first != "shared") expected.push_back(std::move(named));
    }
  }
  ASSERT_EQ(file.tensors.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(file.tensors[i].first, expected[i].first);
    EXPECT_TRUE(file.tensors[i].second.equal(expected[i].second)) << expected[i].first;
    EXPECT_EQ(file.tensors[i].second.scalar_type(), expected[i].second.scalar_type()) << expected[i].first;
  }
  EXPECT_GE(rise, 128 * 1024 * 4);
  EXPECT_LT(rise, 128 * 1024 * 4 + 64 * 1024);
}

// The last stage is lost before its first forward: the first stage stops within the
// timeout with a sentence naming the lost rank and the transfer it waited on.
TEST(PipelineStep, ALostStageStopsTheOthersWithASentence) {
  at::set_num_threads(1);
  const ModelConfig cfg = config("llama-demo");
  const auto errors = testing::gloo_rank_errors(2, 1, 2, std::chrono::seconds(3), [&](dist::Comm& comm) {
    const int64_t s = comm.pipeline().rank();
    auto model = Model::create(cfg, at::kCPU, at::kFloat, kSeed, Layout::pipeline_stage({2, 2}, s));
    if (s == 1) throw std::runtime_error("stage 2 is lost");
    const std::vector<MicrobatchData> data = microbatches(cfg);
    run_pipeline(
        *model, comm.pipeline(), Schedule::one_f_one_b, kMicro, [&](int64_t m) { return data[static_cast<size_t>(m)]; },
        1.0 / kMicro, kChunk, 4);
  });
  EXPECT_EQ(errors[1], "stage 2 is lost");
  // It stops at the first transfer with stage 2 that finds it gone: the send of an
  // activation (posting one on a closed connection fails too) or a gradient's receive.
  EXPECT_EQ(errors[0].find("rank 1 stopped answering during the "), 0u) << errors[0];
  EXPECT_NE(errors[0].find("stage 2 (step 5)"), std::string::npos) << errors[0];
}

// A non-finite weight on the last stage alone: before the update (its loss and the
// shared gradient norm are not finite) and made by the update (the other stage's weights
// stay finite). Every stage stops at once with the same sentence, naming the parameter and
// the stage that holds it, where a stage alone stopping would leave the other waiting.
TEST(PipelineStep, ANonFiniteStageStopsEveryStageNamingIt) {
  at::set_num_threads(1);
  const ModelConfig cfg = config("llama-demo");
  const data::TokenDataset data(at::randint(cfg.vocab_size, {400}, at::detail::createCPUGenerator(3), at::kInt));
  TrainConfig train;
  train.batch = kB;
  train.seq = kT;
  train.grad_accum = kMicro;
  train.ce_chunk = kChunk;
  train.steps = 4;
  train.warmup = 0;
  const auto whole = Model::create(cfg, at::kCPU, at::kFloat, kSeed);
  // The last stage's first matrix (decayed, so the update below overflows it).
  const Param* target = nullptr;
  for (const Param& p : whole->params()) {
    if (p.decay && p.name.find("layers.3.") != std::string::npos && target == nullptr) target = &p;
  }
  ASSERT_NE(target, nullptr);
  const std::string name = target->name + " (pipeline stage 2, rank 1)";
  const auto run_with = [&](const TrainConfig& t, const std::function<void(Param&)>& spoil) {
    return testing::gloo_rank_errors(2, 1, 2, std::chrono::seconds(20), [&](dist::Comm& comm) {
      const int64_t s = comm.pipeline().rank();
      auto model = Model::create(cfg, at::kCPU, at::kFloat, kSeed, Layout::pipeline_stage({2, 2}, s));
      for (Param& p : model->params()) {
        if (p.name == target->name) spoil(p);
      }
      TrainStep step(*model, t, kSeed, &comm);
      std::mt19937_64 rng(5);
      step.run(0, data, rng);
    });
  };
  for (const std::string& e : run_with(train, [](Param& p) { p.value.view(-1)[1] = std::nan(""); })) {
    EXPECT_NE(
        e.find("at step 1, before any update, so the initial model is at fault, not the learning rate: parameter " +
               name + " holds non-finite values"),
        std::string::npos)
        << e;
  }
  // A decoupled weight decay of lr x decay = 1e36 on an entry of 1e3 overflows float32;
  // on the first stage's entries (at most about 0.1) it does not.
  TrainConfig huge = train;
  huge.lr = 1e37;
  huge.min_lr = 0;
  for (const std::string& e : run_with(huge, [](Param& p) { p.value.view(-1)[0] = 1e3; })) {
    EXPECT_EQ(e.rfind("The update of step 1 made parameter " + name + " non-finite", 0), 0u) << e;
  }
}

}  // namespace
}  // namespace remat
