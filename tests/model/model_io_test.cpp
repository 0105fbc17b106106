// safetensors round trip of a whole model, and refusal of files that do not fit it.
#include "remat/model.h"
#include "remat/safetensors.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace remat {
namespace {

namespace fs = std::filesystem;

class ModelIO : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = model_preset("tiny-gpt2");
    tok_ = at::randint(cfg_.vocab_size, {2, 12}, at::detail::createCPUGenerator(1), at::kLong);
  }

  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  double loss(Model& m) { return m.evaluate(tok_, tok_, 64); }

  // A second model's values, so a failed load is visible as "unchanged".
  std::vector<at::Tensor> snapshot(const Model& m) {
    std::vector<at::Tensor> out;
    for (const auto& p : m.params()) out.push_back(p.value.clone());
    return out;
  }
  void expect_unchanged(const Model& m, const std::vector<at::Tensor>& before) {
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(m.params()[i].value, before[i]));
  }

  std::string load_error(Model& m, const std::string& file) {
    try {
      m.load(file);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }

  remat::testing::TempDir dir_;
  ModelConfig cfg_;
  at::Tensor tok_;
};

TEST_F(ModelIO, SaveThenLoadGivesBitwiseTheSameLoss) {
  auto a = Model::create(cfg_, at::kCPU, at::kFloat, 1);
  auto b = Model::create(cfg_, at::kCPU, at::kFloat, 2);
  ASSERT_NE(loss(*a), loss(*b));
  a->save(path("a.safetensors"));
  b->load(path("a.safetensors"));
  EXPECT_EQ(loss(*a), loss(*b));
  for (size_t i = 0; i < a->params().size(); ++i) EXPECT_TRUE(at::equal(a->params()[i].value, b->params()[i].value));
}

TEST_F(ModelIO, Gpt2ProjectionsAreStoredInHuggingFaceConv1DLayout) {
  auto a = Model::create(cfg_, at::kCPU, at::kFloat, 1);
  a->save(path("a.safetensors"));
  const auto file = model::load_safetensors(path("a.safetensors"));
  ASSERT_NE(file.find("h.0.attn.c_attn.weight"), nullptr);
  EXPECT_EQ(file.find("h.0.attn.c_attn.weight")->sizes(), (at::IntArrayRef{cfg_.d_model, 3 * cfg_.d_model}));
  ASSERT_NE(file.find("h.0.mlp.c_fc.weight"), nullptr);
  EXPECT_EQ(file.find("h.0.mlp.c_fc.weight")->sizes(), (at::IntArrayRef{cfg_.d_model, cfg_.d_ff}));
  // Bitwise the transpose of the internal [out, in] weight.
  for (const auto& p : a->params()) {
    if (p.name == "h.1.mlp.c_proj.weight") {
      EXPECT_TRUE(at::equal(file.find(p.name)->t(), p.value));
    }
  }
}

TEST_F(ModelIO, MissingTensorIsNamedAndNothingIsLoaded) {
  auto a = Model::create(cfg_, at::kCPU, at::kFloat, 1);
  a->save(path("a.safetensors"));
  std::vector<std::pair<std::string, at::Tensor>> ts;
  for (const auto& [name, t] : model::load_safetensors(path("a.safetensors")).tensors) {
    if (name != "h.1.ln_2.bias") ts.emplace_back(name, t);
  }
  model::save_safetensors(path("missing.safetensors"), ts);
  auto b = Model::create(cfg_, at::kCPU, at::kFloat, 2);
  const auto before = snapshot(*b);
  EXPECT_NE(load_error(*b, path("missing.safetensors")).find("has no tensor 'h.1.ln_2.bias'"), std::string::npos);
  expect_unchanged(*b, before);
}

TEST_F(ModelIO, WrongShapeIsNamedAndNothingIsLoaded) {
  auto a = Model::create(cfg_, at::kCPU, at::kFloat, 1);
  a->save(path("a.safetensors"));
  auto file = model::load_safetensors(path("a.safetensors")).tensors;
  for (auto& [name, t] : file) {
    if (name == "ln_f.weight") t = at::ones({cfg_.d_model + 1});
  }
  model::save_safetensors(path("shape.safetensors"), file);
  auto b = Model::create(cfg_, at::kCPU, at::kFloat, 2);
  const auto before = snapshot(*b);
  EXPECT_NE(load_error(*b, path("shape.safetensors"))
                .find(fmt::format("Tensor 'ln_f.weight' in {} has shape [{}] but the model expects [{}]",
                                  path("shape.safetensors"), cfg_.d_model + 1, cfg_.d_model)),
            std::string::npos);
  expect_unchanged(*b, before);
}

TEST_F(ModelIO, CorruptHeaderIsRefusedAndNothingIsLoaded) {
  auto a = Model::create(cfg_, at::kCPU, at::kFloat, 1);
  a->save(path("a.safetensors"));
  // Overwrite the header's first JSON byte.
  {
    std::fstream f(path("a.safetensors"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('#');
  }
  auto b = Model::create(cfg_, at::kCPU, at::kFloat, 2);
  const auto before = snapshot(*b);
  EXPECT_NE(load_error(*b, path("a.safetensors")).find(path("a.safetensors")), std::string::npos);
  expect_unchanged(*b, before);
}

TEST_F(ModelIO, Bfloat16ComputeCopiesFollowTheMasters) {
  // The compute copies are refreshed when a master changes (optimizer step, load).
  auto a = Model::create(cfg_, at::kCPU, at::kBFloat16, 1);
  const at::Tensor before = a->last_logits(tok_);
  EXPECT_EQ(before.scalar_type(), at::kFloat);
  for (auto& p : a->params()) {
    if (p.name == "ln_f.bias") p.value.add_(1.0);
  }
  EXPECT_FALSE(at::equal(a->last_logits(tok_), before));
  auto b = Model::create(cfg_, at::kCPU, at::kFloat, 1);
  b->save(path("b.safetensors"));
  a->load(path("b.safetensors"));
  EXPECT_TRUE(at::equal(a->last_logits(tok_), before));
}

TEST_F(ModelIO, ACheckpointOfAnotherShapeIsRefused) {
  auto a = Model::create(cfg_, at::kCPU, at::kFloat, 1);
  a->save(path("a.safetensors"));
  ModelConfig deeper = cfg_;
  deeper.n_layer = 3;
  auto b = Model::create(deeper, at::kCPU, at::kFloat, 2);
  EXPECT_NE(load_error(*b, path("a.safetensors")).find("has no tensor 'h.2.ln_1.weight'"), std::string::npos);
  ModelConfig shallower = cfg_;
  shallower.n_layer = 1;
  auto c = Model::create(shallower, at::kCPU, at::kFloat, 2);
  EXPECT_NE(load_error(*c, path("a.safetensors")).find("holds tensors this gpt2 model does not have (h.1."),
            std::string::npos);
}

// An unpadded checkpoint (Hugging Face GPT-2's 50257 rows) in a model whose vocabulary is
// padded for tensor parallelism: the real rows load as they are, each padding row is the
// mean row, and exporting the real rows gives the file back.
TEST_F(ModelIO, AnUnpaddedCheckpointLoadsIntoAPaddedModel) {
  constexpr int64_t kReal = 61, kPadded = 64;
  const at::Tensor tok = at::randint(kReal, {2, 12}, at::detail::createCPUGenerator(3), at::kLong);
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    ModelConfig real = model_preset(preset), padded = real;
    real.vocab_size = kReal;
    padded.vocab_size = kPadded;
    auto a = Model::create(real, at::kCPU, at::kDouble, 1);
    a->save(path("real.safetensors"));
    auto b = Model::create(padded, at::kCPU, at::kDouble, 2);
    b->load(path("real.safetensors"));
    for (size_t i = 0; i < a->params().size(); ++i) {
      const at::Tensor& want = a->params()[i].value;
      const at::Tensor& got = b->params()[i].value;
      if (!b->params()[i].vocab) {
        EXPECT_TRUE(at::equal(got, want)) << preset << " " << b->params()[i].name;
        continue;
      }
      EXPECT_TRUE(at::equal(got.narrow(0, 0, kReal), want)) << b->params()[i].name;
      for (int64_t r = kReal; r < kPadded; ++r) EXPECT_TRUE(at::allclose(got[r], want.mean(0), 0, 1e-15));
    }
    // Each padding logit is the mean of the real ones, at most their log-sum-exp minus
    // log(61) (Jensen), so the padding adds at most 3/61 of the real softmax's sum: the
    // loss rises by more than 0 and at most log(1 + 3/61).
    const double before = a->evaluate(tok, tok, 64), after = b->evaluate(tok, tok, 64);
    EXPECT_GT(after, before) << preset;
    EXPECT_LE(after - before, std::log1p(3.0 / kReal)) << preset;
    // The export of the real rows is the file that was loaded.
    const auto exported = b->whole_params(kReal);
    const auto file = a->whole_params();
    ASSERT_EQ(exported.size(), file.size());
    for (size_t i = 0; i < file.size(); ++i) {
      EXPECT_EQ(exported[i].first, file[i].first);
      EXPECT_TRUE(at::equal(exported[i].second, file[i].second)) << file[i].first;
    }
  }
  // Llama's two vocabulary tensors must have as many rows as each other.
  ModelConfig llama = model_preset("tiny-llama");
  llama.vocab_size = kPadded;
  auto c = Model::create(llama, at::kCPU, at::kFloat, 1);
  auto file = c->whole_params(kReal);
  for (auto& [name, t] : file) {
    if (name == "lm_head.weight") t = t.narrow(0, 0, kReal - 1).contiguous();
  }
  model::save_safetensors(path("uneven.safetensors"), file);
  const auto before = snapshot(*c);
  EXPECT_NE(load_error(*c, path("uneven.safetensors"))
                .find(fmt::format("Tensor 'lm_head.weight' in {} has {} vocabulary rows but another of its vocabulary "
                                  "tensors has {}; it is not a checkpoint of one vocabulary (nothing was loaded).",
                                  path("uneven.safetensors"), kReal - 1, kReal)),
            std::string::npos);
  expect_unchanged(*c, before);
}

}  // namespace
}  // namespace remat
