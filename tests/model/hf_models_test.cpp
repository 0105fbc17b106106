// Models made by Hugging Face's transformers (tests/data/hf_models/make_fixtures.py: a
// GPT-2, a Llama, and a Llama 3.2-style one with its head tied to its embedding, RoPE
// scaled as "llama3" and its weights saved in shards, every weight drawn afresh, saved with
// save_pretrained) load into remat through their config.json, and remat's logits and loss
// equal transformers' float64 ones within float32 rounding. The other direction: remat's
// export of a changed model (its model.safetensors, config.json and tokenizer files) is
// written where REMAT_HF_EXPORT says, for make_fixtures.py check to load into transformers
// (the LibTorch 2.x lane does).
#include "remat/config.h"
#include "remat/model.h"
#include "remat/safetensors.h"
#include "remat/tokenizer.h"
#include "util/atomic_file.h"
#include "util/error_of.h"
#include "util/paths.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
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

const std::string kFixtures = std::string(remat::testing::kSourceDir) + "/tests/data/hf_models/";

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

struct Fixture {
  const char* folder;
  const char* arch;
  const char* weights;  ///< model.safetensors, or the index of its shards
};

class HfModels : public ::testing::TestWithParam<Fixture> {};

TEST_P(HfModels, LogitsAndLossEqualTransformers) {
  const std::string folder = kFixtures + GetParam().folder;
  const ModelConfig cfg = hf_model_config(folder + "/config.json", ModelConfig{});
  EXPECT_EQ(arch_name(cfg.arch), std::string(GetParam().arch));
  auto model = Model::create(cfg, at::kCPU, at::kFloat, 1);
  model->load(folder + "/" + GetParam().weights);
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
  const fs::path out = fs::path(export_root) / GetParam().folder;
  fs::create_directories(out);
  model->save((out / "model.safetensors").string(), {{"format", "pt"}});
  util::write_file_atomically((out / "config.json").string(), hf_config_json(cfg, cfg.vocab_size, -1, -1));
  for (const auto& [name, text] : data::Tokenizer::load(folder).hf_files()) {
    util::write_file_atomically((out / name).string(), text);
  }
  model::save_safetensors(
      (out / "remat_logits.safetensors").string(),
      {{"ids", ids}, {"logits", all_logits(*model, ids)}, {"loss", at::full({1}, loss_of(*model, ids), at::kDouble)}});
}

INSTANTIATE_TEST_SUITE_P(Architectures, HfModels,
                         ::testing::Values(Fixture{"gpt2", "gpt2", "model.safetensors"},
                                           Fixture{"llama", "llama", "model.safetensors"},
                                           Fixture{"llama3.2", "llama", "model.safetensors.index.json"}),
                         [](const auto& info) {
                           std::string name = info.param.folder;
                           std::replace(name.begin(), name.end(), '.', '_');
                           return name;
                         });

// The Llama 3.2-style fixture is what its name says: the head is the embedding, RoPE is
// scaled, and no file holds every weight.
TEST(HfModels, TheLlama32FixtureTiesScalesAndShards) {
  const std::string folder = kFixtures + "llama3.2";
  const ModelConfig cfg = hf_model_config(folder + "/config.json", ModelConfig{});
  EXPECT_TRUE(cfg.tie_embeddings);
  EXPECT_GT(cfg.rope_scaling.factor, 1.0);
  const std::vector<std::string> shards = model::safetensors_index_files(folder + "/model.safetensors.index.json");
  ASSERT_GE(shards.size(), 2u);
  for (const std::string& shard : shards) {
    const auto header = model::read_safetensors_header(shard);
    for (const auto& t : header.tensors) EXPECT_NE(t.name, "lm_head.weight");
    EXPECT_LT(header.tensors.size(), 2 + 9 * static_cast<size_t>(cfg.n_layer));
  }
}

// What remat's blocks cannot be is refused with the file and the key named.
TEST(HfConfig, RefusesWhatRematsBlocksDoNotHave) {
  const testing::TempDir dir;
  const std::string path = (dir / "config.json").string();
  // What follows "The model config PATH " in the refusal; empty when there is none.
  const auto error = [&](const std::string& json) {
    util::write_file_atomically(path, json);
    const std::string what = testing::error_of<std::invalid_argument>([&] { hf_model_config(path, ModelConfig{}); });
    const std::string head = "The model config " + path + " ";
    return what.rfind(head, 0) == 0 ? what.substr(head.size()) : what;
  };
  const std::string llama =
      R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 128)";
  EXPECT_EQ(error(llama + R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})"),
            "asks for RoPE of type \"yarn\" in \"rope_scaling\", but remat builds the default RoPE and Llama 3.1's "
            "\"llama3\" scaling alone.");
  EXPECT_EQ(error(llama + R"(, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}})"),
            "The model config " + path +
                "'s \"rope_scaling\" has no \"low_freq_factor\", which gives the model's "
                "shape.");
  EXPECT_EQ(error(llama + R"(, "hidden_act": "gelu"})"),
            "sets \"hidden_act\" to \"gelu\", but remat's Llama MLP is SwiGLU, with SiLU.");
  EXPECT_EQ(error(R"({"model_type": "mistral"})"), "is of model_type \"mistral\"; remat builds gpt2 and llama.");
  EXPECT_EQ(error(R"({"model_type": "gpt2", "n_layer": 2, "n_head": 2})"),
            "has no \"n_embd\", which gives the model's shape.");
  EXPECT_EQ(error(R"({"model_type": "gpt2", "n_layer": 2.5})"),
            "holds 2.5 as \"n_layer\", not a whole number from 1 to 2^31.");
  EXPECT_EQ(error(llama + "}"), "");
}

// Llama 3.2 1B's own keys (its config.json, as transformers 4 wrote it) give its shape.
TEST(HfConfig, ReadsLlama32sScalingAndTiedHead) {
  const testing::TempDir dir;
  const std::string path = (dir / "config.json").string();
  util::write_file_atomically(
      path, R"({"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256, "head_dim": 64,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "tie_word_embeddings": true})");
  const ModelConfig m = hf_model_config(path, ModelConfig{});
  const ModelConfig want = model_preset("llama3.2-1b");
  EXPECT_EQ(m.n_layer, want.n_layer);
  EXPECT_EQ(m.d_model, want.d_model);
  EXPECT_EQ(m.d_ff, want.d_ff);
  EXPECT_EQ(m.n_kv_head, want.n_kv_head);
  EXPECT_EQ(m.max_seq, want.max_seq);
  EXPECT_EQ(m.rope_theta, want.rope_theta);
  EXPECT_EQ(m.rope_scaling.factor, want.rope_scaling.factor);
  EXPECT_EQ(m.rope_scaling.low_freq_factor, want.rope_scaling.low_freq_factor);
  EXPECT_EQ(m.rope_scaling.high_freq_factor, want.rope_scaling.high_freq_factor);
  EXPECT_EQ(m.rope_scaling.original_max_seq, want.rope_scaling.original_max_seq);
  EXPECT_TRUE(m.tie_embeddings && want.tie_embeddings);
  // And remat writes them back as it read them.
  util::write_file_atomically(path, hf_config_json(m, m.vocab_size, 128000, 128001));
  const ModelConfig again = hf_model_config(path, ModelConfig{});
  EXPECT_EQ(again.rope_scaling.factor, 32.0);
  EXPECT_EQ(again.rope_scaling.original_max_seq, 8192);
  EXPECT_TRUE(again.tie_embeddings);
}

// A sharded model's index is held to what save_pretrained writes.
TEST(HfModels, AShardIndexIsRefusedWithASentence) {
  const testing::TempDir dir;
  const std::string path = (dir / "model.safetensors.index.json").string();
  const auto error = [&](const std::string& json) {
    util::write_file_atomically(path, json);
    return testing::error_of<std::runtime_error>([&] { model::safetensors_index_files(path); });
  };
  const std::string tail =
      "; it should map each tensor's name to the file beside it that holds it, as transformers' save_pretrained "
      "writes it.";
  EXPECT_EQ(error("{\"metadata\": {}}"), "The safetensors index " + path + " has no \"weight_map\" object" + tail);
  EXPECT_EQ(
      error(R"({"weight_map": {"a": "../secret.safetensors"}})"),
      "The safetensors index " + path + " places 'a' in \"../secret.safetensors\", which is not a file name" + tail);
  EXPECT_EQ(error(R"({"weight_map": {}})"), "The safetensors index " + path + " names no tensors" + tail);
  EXPECT_NE(error("{").find(" is not JSON ("), std::string::npos);
  // Each file once, in the order the index first names it.
  util::write_file_atomically(path, R"({"weight_map": {"b": "two.safetensors", "a": "one.safetensors",
                                                       "c": "two.safetensors"}})");
  EXPECT_EQ(model::safetensors_index_files(path),
            (std::vector<std::string>{(dir / "two.safetensors").string(), (dir / "one.safetensors").string()}));
}

}  // namespace
}  // namespace remat
