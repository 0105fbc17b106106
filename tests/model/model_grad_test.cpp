// The engine's explicit forward/backward against LibTorch autograd on the same weights,
// tokens and dropout masks, in float64.
#include "model/reference.h"
#include "remat/model.h"
#include "util/sdpa.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cmath>

namespace remat {
namespace {

struct Case {
  std::string preset;
  int64_t batch, seq;
  double dropout;
  int64_t ce_chunk;
  Attention attention = Attention::math;  ///< tiled: 4-position tiles, several per sequence
  bool mixed = false;  ///< the odd layers run another op (LayerPlan::attention): tiled with math, else math
};

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-30, b.abs().max().item<double>());
}

class ModelGrad : public ::testing::TestWithParam<Case> {};

TEST_P(ModelGrad, LossAndEveryParameterGradientMatchAutograd) {
  const Case tc = GetParam();
  if (tc.attention == Attention::sdpa) REMAT_SKIP_WITHOUT_SDPA();
  ModelConfig cfg = model_preset(tc.preset);
  cfg.dropout = tc.dropout;
  cfg.attention = tc.attention;
  cfg.attention_tile = 4;
  auto model = Model::create(cfg, at::kCPU, at::kDouble, /*seed=*/7);
  if (tc.mixed) {
    ActivationPlan plan;
    plan.layers.resize(static_cast<size_t>(cfg.n_layer));
    for (size_t l = 1; l < plan.layers.size(); l += 2) {
      plan.layers[l].attention = cfg.attention == Attention::math ? Attention::tiled : Attention::math;
    }
    model->set_activation_plan(plan, {});
  }
  // Larger than init scale so every path carries signal well above rounding.
  auto gen = at::detail::createCPUGenerator(3);
  for (auto& p : model->params()) p.value.add_(at::randn(p.value.sizes(), gen, at::kDouble) * 0.1);

  auto tokens = at::randint(cfg.vocab_size, {tc.batch, tc.seq}, gen, at::kLong);
  auto targets = at::randint(cfg.vocab_size, {tc.batch, tc.seq}, gen, at::kLong);
  targets.index_put_({0, 0}, -1);  // an ignored position
  const StepContext ctx{11, 5, 2};

  model->zero_grad();
  const double loss = model->forward_backward(tokens, targets, ctx, 1.0, tc.ce_chunk);

  std::map<std::string, at::Tensor> leaves;
  std::vector<at::Tensor> inputs;
  for (const auto& p : model->params()) {
    leaves[p.name] = p.value.detach().clone().requires_grad_(true);
    inputs.push_back(leaves[p.name]);
  }
  at::Tensor ref = testing::reference_loss(cfg, leaves, tokens, targets, ctx);
  auto grads = torch::autograd::grad({ref}, inputs);

  EXPECT_LT(std::abs(loss - ref.item<double>()) / std::abs(ref.item<double>()), 1e-12);
  ASSERT_EQ(grads.size(), model->params().size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& p = model->params()[i];
    ASSERT_GT(grads[i].abs().max().item<double>(), 0.0) << p.name << " gets no gradient in the reference";
    EXPECT_LT(rel_err(p.grad, grads[i]), 1e-10) << p.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ModelGrad,
                         ::testing::Values(Case{"tiny-gpt2", 2, 7, 0.0, 5}, Case{"tiny-gpt2", 3, 16, 0.2, 1024},
                                           Case{"tiny-llama", 2, 9, 0.0, 4}, Case{"tiny-llama", 1, 16, 0.25, 7},
                                           Case{"tiny-gpt2", 3, 16, 0.2, 1024, Attention::tiled},
                                           Case{"tiny-llama", 2, 9, 0.25, 4, Attention::tiled},
                                           Case{"tiny-gpt2", 2, 11, 0.2, 6, Attention::math, true},
                                           Case{"tiny-llama", 2, 13, 0.25, 5, Attention::tiled, true},
                                           Case{"tiny-gpt2", 2, 7, 0.0, 5, Attention::sdpa},
                                           Case{"tiny-llama", 2, 13, 0.0, 4, Attention::sdpa, true}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return fmt::format("{}_b{}_t{}_p{}_{}{}", c.preset == "tiny-gpt2" ? "gpt2" : "llama",
                                              c.batch, c.seq, static_cast<int>(c.dropout * 100),
                                              attention_name(c.attention), c.mixed ? "_mixed" : "");
                         });

TEST(ModelGrad, GradientAccumulationOverMicrobatchesEqualsTheSumOfParts) {
  ModelConfig cfg = model_preset("tiny-gpt2");
  auto model = Model::create(cfg, at::kCPU, at::kDouble, 1);
  auto gen = at::detail::createCPUGenerator(5);
  auto tok = at::randint(cfg.vocab_size, {2, 8}, gen, at::kLong);
  auto tgt = at::randint(cfg.vocab_size, {2, 8}, gen, at::kLong);
  model->zero_grad();
  model->forward_backward(tok, tgt, {1, 0, 0}, 0.5, 64);
  model->forward_backward(tok, tgt, {1, 0, 1}, 0.5, 64);
  std::vector<at::Tensor> accumulated;
  for (const auto& p : model->params()) accumulated.push_back(p.grad.clone());
  std::vector<at::Tensor> parts(accumulated.size());
  for (uint64_t micro = 0; micro < 2; ++micro) {
    model->zero_grad();
    model->forward_backward(tok, tgt, {1, 0, micro}, 0.5, 64);
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i] = micro == 0 ? model->params()[i].grad.clone() : parts[i] + model->params()[i].grad;
    }
  }
  for (size_t i = 0; i < parts.size(); ++i) EXPECT_LT(rel_err(accumulated[i], parts[i]), 1e-12);
}

// Two accumulated microbatches of B rows train like one batch of 2B rows (without dropout,
// whose keys differ per microbatch; every target counted, so the means agree).
TEST(ModelGrad, TwoMicrobatchesOfBEqualOneBatchOf2B) {
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    ModelConfig cfg = model_preset(preset);
    cfg.dropout = 0.0;
    auto model = Model::create(cfg, at::kCPU, at::kDouble, 1);
    auto gen = at::detail::createCPUGenerator(5);
    auto tok = at::randint(cfg.vocab_size, {4, 8}, gen, at::kLong);
    auto tgt = at::randint(cfg.vocab_size, {4, 8}, gen, at::kLong);
    model->zero_grad();
    const double whole = model->forward_backward(tok, tgt, {1, 0, 0}, 1.0, 64);
    std::vector<at::Tensor> batch;
    for (const auto& p : model->params()) batch.push_back(p.grad.clone());
    model->zero_grad();
    double halves = 0;
    for (int64_t m = 0; m < 2; ++m) {
      halves += 0.5 * model->forward_backward(tok.narrow(0, 2 * m, 2), tgt.narrow(0, 2 * m, 2),
                                              {1, 0, static_cast<uint64_t>(m)}, 0.5, 64);
    }
    EXPECT_NEAR(halves, whole, 1e-12 * std::abs(whole)) << preset;
    for (size_t i = 0; i < batch.size(); ++i) {
      EXPECT_LT(rel_err(model->params()[i].grad, batch[i]), 1e-12) << preset << " " << model->params()[i].name;
    }
  }
}

// A step's first backward writes the gradients (the model zeroes only the embedding's,
// which its op adds into by rows): over a buffer of NaN it gives the gradients a fresh
// model's does, the tied table (GPT-2's, which the head writes first) and the positions' too,
// with the loss scale of one microbatch of one and of two.
TEST(ModelGrad, AStepsFirstBackwardWritesOverWhateverTheGradientsHeld) {
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (const double scale : {1.0, 0.5}) {
        ModelConfig cfg = model_preset(preset);
        auto gen = at::detail::createCPUGenerator(5);
        const at::Tensor tok = at::randint(cfg.vocab_size, {2, 8}, gen, at::kLong);
        const at::Tensor tgt = at::randint(cfg.vocab_size, {2, 8}, gen, at::kLong);
        auto fresh = Model::create(cfg, at::kCPU, dtype, 1);
        fresh->zero_grad();
        fresh->forward_backward(tok, tgt, {1, 0, 0}, scale, 64);
        auto stale = Model::create(cfg, at::kCPU, dtype, 1);
        stale->grad_buffer().fill_(std::nan(""));
        stale->zero_grad();
        stale->forward_backward(tok, tgt, {1, 0, 0}, scale, 64);
        for (size_t i = 0; i < fresh->params().size(); ++i) {
          EXPECT_TRUE(at::equal(stale->params()[i].grad, fresh->params()[i].grad))
              << preset << " " << dtype << " scale " << scale << " " << fresh->params()[i].name;
        }
      }
    }
  }
}

}  // namespace
}  // namespace remat
