// Models made by Hugging Face's transformers (tests/data/hf_models/make_fixtures.py: a
// GPT-2 and a Llama with every weight drawn afresh, saved with save_pretrained) load into
// remat through their config.json, and remat's logits and loss equal transformers' float64
// ones within float32 rounding. The other direction: remat's export of a changed model
// (its model.safetensors and config.json) is written where REMAT_HF_EXPORT says, for
// make_fixtures.py check to load into transformers (the LibTorch 2.x lane does).
#include "remat/config.h"
#include "remat/model.h"
#include "remat/safetensors.h"
#include "util/atomic_file.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace remat {
namespace {

namespace fs = std::filesystem;

// The fixtures' logits reach 2.5: float32's rounding through two blocks of width 32 leaves
// them within a few units in the last place of that (8e-7 and 1.2e-6 seen here, 1.4e-6 on
// the loss), while a misplaced tensor (a transposed weight, RoPE's halves swapped, a wrong
// norm epsilon) moves them by 1e-2 and more. make_fixtures.py holds the export to the same
// bound.
constexpr double kBound = 1e-5;

const std::string kFixtures = std::string(REMAT_SOURCE_DIR) + "/tests/data/hf_models/";

// Logits [T, V] of every prefix of `ids` [1, T], float32.
at::Tensor all_logits(Model& model, const at::Tensor& ids) {
  std::vector<at::Tensor> rows;
  for (int64_t t = 1; t <= ids.size(1); ++t) rows.push_back(model.last_logits(ids.narrow(1, 0, t))[0]);
  return at::stack(rows);
}

// The loss transformers computes with labels = ids: each position predicts the next.
double loss_of(Model& model, const at::Tensor& ids) {
  const int64_t t = ids.size(1) - 1;
  return model.evaluate(ids.narrow(1, 0, t), ids.narrow(1, 1, t), 64);
}

class HfModels : public ::testing::TestWithParam<const char*> {};

TEST_P(HfModels, LogitsAndLossEqualTransformers) {
  const std::string folder = kFixtures + GetParam();
  const ModelConfig cfg = hf_model_config(folder + "/config.json", ModelConfig{});
  EXPECT_EQ(arch_name(cfg.arch), std::string(GetParam()));
  auto model = Model::create(cfg, at::kCPU, at::kFloat, 1);
  model->load(folder + "/model.safetensors");
  const model::SafeTensors goldens = model::load_safetensors(folder + "/goldens.safetensors");
  const at::Tensor ids = *goldens.find("ids");
  const at::Tensor want = *goldens.find("logits");
  const double diff = (all_logits(*model, ids).to(at::kDouble) - want).abs().max().item<double>();
  EXPECT_LE(diff, kBound) << "largest logit " << want.abs().max().item<double>();
  const double want_loss = goldens.find("loss")->item<double>();
  EXPECT_NEAR(loss_of(*model, ids), want_loss, kBound);
  // Not a vacuous match: the fixture's weights are far from a fresh model's.
  auto fresh = Model::create(cfg, at::kCPU, at::kFloat, 1);
  EXPECT_GT((all_logits(*fresh, ids).to(at::kDouble) - want).abs().max().item<double>(), 100 * kBound);

  const char* export_root = std::getenv("REMAT_HF_EXPORT");
  if (export_root == nullptr) return;
  // Every parameter changed (seeded), so that the export is remat's weights, not the file's.
  const auto gen = at::detail::createCPUGenerator(3);
  for (auto& p : model->params()) p.value.add_(at::randn(p.value.sizes(), gen, at::kFloat) * 0.05);
  const fs::path out = fs::path(export_root) / GetParam();
  fs::create_directories(out);
  model->save((out / "model.safetensors").string(), {{"format", "pt"}});
  util::write_file_atomically((out / "config.json").string(), hf_config_json(cfg, cfg.vocab_size, -1, -1));
  model::save_safetensors(
      (out / "remat_logits.safetensors").string(),
      {{"ids", ids}, {"logits", all_logits(*model, ids)}, {"loss", at::full({1}, loss_of(*model, ids), at::kDouble)}});
}

INSTANTIATE_TEST_SUITE_P(Architectures, HfModels, ::testing::Values("gpt2", "llama"),
                         [](const auto& info) { return std::string(info.param); });

// What remat's blocks cannot be is refused with the file and the key named.
TEST(HfConfig, RefusesWhatRematsBlocksDoNotHave) {
  const testing::TempDir dir;
  const std::string path = (dir / "config.json").string();
  // What follows "The model config PATH " in the refusal; empty when there is none.
  const auto error = [&](const std::string& json) {
    util::write_file_atomically(path, json);
    try {
      hf_model_config(path, ModelConfig{});
    } catch (const std::exception& e) {
      const std::string what = e.what(), head = "The model config " + path + " ";
      return what.rfind(head, 0) == 0 ? what.substr(head.size()) : what;
    }
    return std::string();
  };
  const std::string llama =
      R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 128)";
  EXPECT_EQ(error(llama + R"(, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}})"),
            "asks for RoPE of type \"llama3\" in \"rope_scaling\", but remat's RoPE is the default one, unscaled "
            "(Llama 3.1's and 3.2's \"llama3\" scaling is not built).");
  EXPECT_EQ(error(llama + R"(, "tie_word_embeddings": true})"),
            "sets \"tie_word_embeddings\" to true, but remat's Llama has a head of its own (lm_head.weight), not the "
            "embedding's.");
  EXPECT_EQ(error(llama + R"(, "hidden_act": "gelu"})"),
            "sets \"hidden_act\" to \"gelu\", but remat's Llama MLP is SwiGLU, with SiLU.");
  EXPECT_EQ(error(R"({"model_type": "mistral"})"), "is of model_type \"mistral\"; remat builds gpt2 and llama.");
  EXPECT_EQ(error(R"({"model_type": "gpt2", "n_layer": 2, "n_head": 2})"),
            "has no \"n_embd\", which gives the model's shape.");
  EXPECT_EQ(error(R"({"model_type": "gpt2", "n_layer": 2.5})"),
            "holds 2.5 as \"n_layer\", not a whole number from 1 to 2^31.");
  EXPECT_EQ(error(llama + "}"), "");
}

}  // namespace
}  // namespace remat
