// Pipeline stages (StageSpan) and the split microbatch calls (Model::forward, ::backward):
// a model cut into stages, run in one process in a 1F1B order with several microbatches in
// flight, trains exactly like the whole model: the same losses, bitwise the same gradients
// (the tied embedding's summed over its two stages), the same recompute work, and each
// stage's predicted activation bytes are what its forward keeps.
#include "util/temp_dir.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/policy.h"

#include <ATen/Parallel.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <map>
#include <set>

namespace remat {
namespace {

constexpr uint64_t kSeed = 3;
constexpr int64_t kMicrobatches = 3, kB = 2, kT = 9, kChunk = 7;
constexpr double kScale = 1.0 / kMicrobatches;

ModelConfig config(const std::string& preset) {
  ModelConfig c = model_preset(preset);
  c.n_layer = 4;
  c.dropout = 0.1;
  return c;
}

// The embedding's name where the head reads it too, else empty.
std::string tied_embedding(const ModelConfig& c) {
  if (!c.tie_embeddings) return "";
  return c.arch == Arch::gpt2 ? "wte.weight" : "model.embed_tokens.weight";
}

// Layers per stage, in order.
using Split = std::vector<int64_t>;

std::string split_text(const Split& split) {
  std::vector<std::string> parts;
  for (int64_t n : split) parts.push_back(std::to_string(n));
  return fmt::format("{}", fmt::join(parts, ","));
}

// The policy compiled with the stage split, so that no uniform chunk crosses a stage.
ActivationPlan plan_of(const ModelConfig& cfg, const std::string& policy, const Split& split) {
  if (policy == "uniform:2" && split == Split{1, 2, 1}) {
    // compile_policy refuses chunks longer than the smallest stage; this is the plan
    // uniform:2 means within each stage (a shorter chunk where a stage has one layer): the
    // middle stage's two layers one chunk, the one-layer stages full.
    ActivationPlan plan = compile_policy("full", cfg.n_layer, cfg.dropout);
    plan.layers[2].chunk_begin = 1;
    return plan;
  }
  AcConfig ac;
  ac.policy = policy;
  ac.stages = static_cast<int64_t>(split.size());
  if (split.size() > 1) ac.num_layers_per_stage = split_text(split);
  return compile_policy(ac, cfg.n_layer, cfg.dropout);
}

std::vector<std::unique_ptr<Model>> make_stages(const ModelConfig& cfg, const Split& split) {
  std::vector<std::unique_ptr<Model>> stages;
  for (size_t s = 0; s < split.size(); ++s) {
    stages.push_back(Model::create(cfg, at::kCPU, at::kFloat, kSeed,
                                   Layout::pipeline_stage({split.begin(), split.end()}, static_cast<int64_t>(s))));
  }
  return stages;
}

struct Batch {
  at::Tensor tokens, targets;
};

std::vector<Batch> batches(const ModelConfig& cfg) {
  auto gen = at::detail::createCPUGenerator(9);
  std::vector<Batch> out;
  for (int64_t m = 0; m < kMicrobatches; ++m) {
    out.push_back(
        {at::randint(cfg.vocab_size, {kB, kT}, gen, at::kLong), at::randint(cfg.vocab_size, {kB, kT}, gen, at::kLong)});
  }
  out[1].targets.index_put_({0, 0}, -1);  // an ignored position
  return out;
}

StepContext context(int64_t m) { return {5, 2, static_cast<uint64_t>(m)}; }

// The recompute work a store did, comparable between the whole model and its stages (not
// the kept bytes: a stage whose layers all keep everything has no store to count them).
struct Work {
  int64_t dropped = 0, recomputed = 0, ops = 0;
  void add(Model& m) {
    const ActivationStore* st = m.store();
    if (st == nullptr) return;
    dropped += st->counters().bytes_dropped;
    recomputed += st->counters().bytes_recomputed;
    ops += st->counters().ops_recomputed;
  }
  bool operator==(const Work& o) const { return dropped == o.dropped && recomputed == o.recomputed && ops == o.ops; }
};

struct Outcome {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> grads;  ///< by name; the tied embedding's summed over its stages
  Work work;
};

Outcome whole_run(const ModelConfig& cfg, const ActivationPlan& plan, const StoreOptions& options) {
  auto model = Model::create(cfg, at::kCPU, at::kFloat, kSeed);
  model->set_activation_plan(plan, options);
  model->zero_grad();
  const std::vector<Batch> data = batches(cfg);
  Outcome r;
  for (int64_t m = 0; m < kMicrobatches; ++m) {
    const Batch& b = data[static_cast<size_t>(m)];
    r.losses.push_back(model->forward_backward(b.tokens, b.targets, context(m), kScale, kChunk));
  }
  for (const auto& p : model->params()) {
    EXPECT_FALSE(p.tied) << p.name << ": a model of every layer has no tied copy";
    r.grads[p.name] = p.grad.clone();
  }
  r.work.add(*model);
  return r;
}

// The stages in one process, in a 1F1B order: forward microbatches 0 and 1 through every
// stage, backward 0, forward 2, backward 1, backward 2. Activations go to the next stage
// and gradients back as copies, as a transfer would deliver them.
Outcome staged_run(const ModelConfig& cfg, const Split& split, const ActivationPlan& plan,
                   const StoreOptions& options) {
  auto stages = make_stages(cfg, split);
  for (auto& s : stages) {
    s->set_activation_plan(plan, options);
    s->zero_grad();
  }
  const std::vector<Batch> data = batches(cfg);
  const size_t S = stages.size();
  std::vector<std::vector<std::unique_ptr<Microbatch>>> flight(kMicrobatches);
  Outcome r;
  r.losses.resize(kMicrobatches);
  auto forward = [&](int64_t m) {
    at::Tensor x = data[static_cast<size_t>(m)].tokens;
    for (size_t s = 0; s < S; ++s) {
      flight[m].push_back(stages[s]->forward(x, data[static_cast<size_t>(m)].targets, context(m), kChunk));
      if (s + 1 < S) {
        ASSERT_TRUE(flight[m].back()->output.defined());
        x = flight[m].back()->output.clone();
      }
    }
    ASSERT_FALSE(flight[m].back()->output.defined());
    r.losses[static_cast<size_t>(m)] = flight[m].back()->loss;
  };
  auto backward = [&](int64_t m) {
    at::Tensor dy;
    for (size_t s = S; s-- > 0;) {
      dy = stages[s]->backward(*flight[m][s], dy, kScale);
      // Nothing a recompute pooled outlives a backward: the next call may be a forward.
      EXPECT_EQ(memory::stats(at::kCPU).pool_idle, 0) << "stage " << s << ", microbatch " << m;
      if (s > 0) {
        ASSERT_TRUE(dy.defined());
        dy = dy.clone();
      }
    }
    EXPECT_FALSE(dy.defined()) << "the first stage's input is token ids";
    flight[m].clear();
  };
  forward(0);
  forward(1);
  backward(0);
  forward(2);
  backward(1);
  backward(2);

  for (const auto& s : stages) {
    for (const auto& p : s->params()) {
      auto [it, fresh] = r.grads.emplace(p.name, p.grad.clone());
      if (!fresh) it->second += p.grad;  // the tied embedding's second stage
    }
    r.work.add(*s);
  }
  return r;
}

struct Case {
  std::string preset;
  Split split;
  bool tied;  ///< model.tie_embeddings
};

ModelConfig config(const Case& c) {
  ModelConfig m = config(c.preset);
  m.tie_embeddings = c.tied;
  return m;
}

class Stage : public ::testing::TestWithParam<Case> {};

TEST_P(Stage, OneFOneBOverStagesEqualsTheWholeModel) {
  at::set_num_threads(1);
  memory::install_cpu_tracking();  // recomputes pool their buffers
  const auto& split = GetParam().split;
  const ModelConfig cfg = config(GetParam());
  StoreOptions options;
  options.check = DeterminismCheck::values;  // records of three microbatches in flight must stay apart
  for (const char* policy : {"none", "full", "every:2", "uniform:2"}) {
    SCOPED_TRACE(policy);
    const ActivationPlan plan = plan_of(cfg, policy, split);
    const Outcome whole = whole_run(cfg, plan, options);
    const Outcome staged = staged_run(cfg, split, plan, options);
    EXPECT_EQ(staged.losses, whole.losses);
    ASSERT_EQ(staged.grads.size(), whole.grads.size());
    for (const auto& [name, g] : whole.grads) {
      const at::Tensor& s = staged.grads.at(name);
      if (name == tied_embedding(cfg)) {
        // A tied embedding: the whole model accumulates the head's and the embedding's
        // parts microbatch by microbatch into one tensor, the stages each their own, summed
        // at the end; float addition in another order, so equal to rounding only.
        EXPECT_TRUE(at::allclose(s, g, 1e-5, 1e-7)) << (s - g).abs().max().item<double>();
      } else {
        EXPECT_TRUE(at::equal(s, g)) << name;
      }
    }
    EXPECT_TRUE(staged.work == whole.work);
    if (std::string(policy) != "none") {
      EXPECT_GT(staged.work.ops, 0);
    }
  }
}

TEST_P(Stage, ParametersAreTheWholeModelsOfTheSameNames) {
  const auto& split = GetParam().split;
  const ModelConfig cfg = config(GetParam());
  auto whole = Model::create(cfg, at::kCPU, at::kFloat, kSeed);
  std::map<std::string, const Param*> by_name;
  for (const auto& p : whole->params()) by_name[p.name] = &p;
  std::multiset<std::string> held;
  const auto stages = make_stages(cfg, split);
  for (size_t s = 0; s < stages.size(); ++s) {
    EXPECT_EQ(stages[s]->first_stage(), s == 0);
    EXPECT_EQ(stages[s]->last_stage(), s + 1 == stages.size());
    for (const auto& p : stages[s]->params()) {
      ASSERT_TRUE(by_name.count(p.name)) << p.name;
      const Param& w = *by_name.at(p.name);
      EXPECT_TRUE(at::equal(p.value, w.value)) << p.name;
      EXPECT_EQ(p.decay, w.decay) << p.name;
      EXPECT_EQ(p.vocab, w.vocab) << p.name;
      // Only a tied token embedding is read by two stages: the first's embedding, the
      // last's head.
      EXPECT_EQ(p.tied, p.name == tied_embedding(cfg)) << p.name;
      held.insert(p.name);
    }
  }
  for (const auto& [name, p] : by_name) {
    EXPECT_EQ(held.count(name), name == tied_embedding(cfg) ? 2u : 1u) << name;
  }
}

// Evaluation through the stages, each stage's output the next one's input, is the whole
// model's: the same ops on the same values in the same order.
TEST_P(Stage, EvaluationThroughTheStagesIsTheWholeModels) {
  const auto& split = GetParam().split;
  const ModelConfig cfg = config(GetParam());
  auto whole = Model::create(cfg, at::kCPU, at::kFloat, kSeed);
  const auto stages = make_stages(cfg, split);
  for (const Batch& b : batches(cfg)) {
    at::Tensor x = b.tokens;
    double loss = -1;
    for (const auto& s : stages) {
      at::Tensor out;
      loss = s->evaluate(x, b.targets, kChunk, &out);
      EXPECT_EQ(out.defined(), !s->last_stage());
      x = out;
    }
    EXPECT_EQ(loss, whole->evaluate(b.tokens, b.targets, kChunk));
  }
}

TEST_P(Stage, PredictedActivationBytesEqualWhatEachStageKeeps) {
  const auto& split = GetParam().split;
  const ModelConfig cfg = config(GetParam());
  const Batch b = batches(cfg)[0];
  for (const char* policy : {"none", "full", "every:2", "uniform:2", "modules:[core_attn]"}) {
    const ActivationPlan plan = plan_of(cfg, policy, split);
    ActivationBytes sum;
    auto whole = Model::create(cfg, at::kCPU, at::kFloat, kSeed);
    whole->set_activation_plan(plan, {});
    const ActivationBytes all = whole->predict_activation_bytes(kB, kT);
    at::Tensor x = b.tokens;
    std::vector<std::unique_ptr<Microbatch>> flight;
    for (auto& s : make_stages(cfg, split)) {
      s->set_activation_plan(plan, {});
      ActivationBytes m;
      flight.push_back(s->forward(x, b.targets, context(0), kChunk, &m));
      x = flight.back()->output;
      const ActivationBytes p = s->predict_activation_bytes(kB, kT);
      EXPECT_EQ(p.blocks, m.blocks) << policy;
      EXPECT_EQ(p.embedding, m.embedding) << policy;
      EXPECT_EQ(p.head, m.head) << policy;
      EXPECT_EQ(static_cast<int64_t>(m.blocks.size()), s->stage().count);
      sum.embedding += p.embedding;
      sum.head += p.head;
      sum.blocks.insert(sum.blocks.end(), p.blocks.begin(), p.blocks.end());
    }
    EXPECT_EQ(sum.embedding, all.embedding) << policy;
    EXPECT_EQ(sum.head, all.head) << policy;
    EXPECT_EQ(sum.blocks, all.blocks) << policy;
  }
}

INSTANTIATE_TEST_SUITE_P(Splits, Stage,
                         ::testing::Values(Case{"tiny-gpt2", {2, 2}, true}, Case{"tiny-gpt2", {1, 2, 1}, true},
                                           Case{"tiny-gpt2", {2, 2}, false}, Case{"tiny-llama", {2, 2}, false},
                                           Case{"tiny-llama", {1, 2, 1}, false}, Case{"tiny-llama", {2, 2}, true}),
                         [](const auto& info) {
                           std::string split;
                           for (int64_t n : info.param.split) split += std::to_string(n);
                           const bool gpt2 = info.param.preset == "tiny-gpt2";
                           const char* head = info.param.tied == gpt2 ? "" : info.param.tied ? "_tied" : "_untied";
                           return fmt::format("{}_{}{}", gpt2 ? "gpt2" : "llama", split, head);
                         });

TEST(StagePlan, AChunkAcrossAStageBoundaryIsRefused) {
  const ModelConfig cfg = config("tiny-llama");
  auto middle = Model::create(cfg, at::kCPU, at::kFloat, kSeed, Layout::pipeline_stage({1, 2, 1}, 1));
  try {
    middle->set_activation_plan(compile_policy("uniform:2", cfg.n_layer, cfg.dropout), {});  // chunks 1-2, 3-4
    FAIL() << "a chunk beginning in the previous stage was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("The activation plan's chunk of layer 2 (counted from 1) begins at layer 1, "
                                         "before this pipeline stage's first layer 2"),
              std::string::npos)
        << e.what();
  }
}

TEST(StageSpan, OutOfRangeSpansAndWholeModelCallsAreRefused) {
  const ModelConfig cfg = config("tiny-gpt2");
  ASSERT_EQ(cfg.n_layer, 4);
  // A stage past the last, before the first, one of no layers, and splits of too many or
  // too few layers.
  for (const Layout& bad :
       {Layout::pipeline_stage({2, 2}, 2), Layout::pipeline_stage({2, 2}, -1), Layout::pipeline_stage({4, 0}, 1),
        Layout::pipeline_stage({2, 3}, 0), Layout::pipeline_stage({1, 2}, 0)}) {
    EXPECT_THROW(Model::create(cfg, at::kCPU, at::kFloat, kSeed, bad), c10::Error)
        << fmt::format("stage {} of [{}]", bad.stage, fmt::join(bad.split, ","));
  }
  auto first = Model::create(cfg, at::kCPU, at::kFloat, kSeed, Layout::pipeline_stage({2, 2}, 0));
  const Batch b = batches(cfg)[0];
  EXPECT_THROW(first->forward_backward(b.tokens, b.targets, context(0), 1.0, kChunk), c10::Error);
  EXPECT_THROW(first->evaluate(b.tokens, b.targets, kChunk), c10::Error);  // nowhere for its output
  const auto mb = first->forward(b.tokens, at::Tensor(), context(0), kChunk);
  EXPECT_THROW(first->backward(*mb, at::Tensor(), 1.0), c10::Error);  // no output gradient
  first->backward(*mb, at::zeros_like(mb->output), 1.0);
  EXPECT_THROW(first->backward(*mb, at::zeros_like(mb->output), 1.0), c10::Error);  // twice
}

TEST(StageSpan, AStageLoadsItsParametersFromAWholeCheckpoint) {
  const testing::TempDir dir;
  const ModelConfig cfg = config("tiny-gpt2");
  auto whole = Model::create(cfg, at::kCPU, at::kFloat, kSeed);
  whole->save(dir / "whole.safetensors");
  auto last = Model::create(cfg, at::kCPU, at::kFloat, kSeed + 1, Layout::pipeline_stage({2, 2}, 1));
  last->load(dir / "whole.safetensors");
  std::map<std::string, at::Tensor> saved;
  for (const auto& p : whole->params()) saved[p.name] = p.value;
  for (const auto& p : last->params()) EXPECT_TRUE(at::equal(p.value, saved.at(p.name))) << p.name;
}

}  // namespace
}  // namespace remat
