// Hugging Face's config.json for GPT-2 and Llama, read into a model shape and written from
// one, key by key as transformers' GPT2Config and LlamaConfig name them.
#include "remat/config.h"
#include "util/atomic_file.h"
#include "util/utf8.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace remat {
namespace {

using nlohmann::json;

// A config.json is a few kilobytes; anything far larger is not one.
constexpr int64_t kMaxConfigJsonBytes = int64_t{1} << 20;

class HfConfig {
 public:
  HfConfig(json j, std::string path) : j_(std::move(j)), path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(fmt::format("The model config {} {}", path_, what));
  }
  const std::string& path() const { return path_; }
  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  const json& at(const char* key) const { return j_.at(key); }

  int64_t whole(const char* key) const {
    if (!has(key)) fail(fmt::format("has no \"{}\", which gives the model's shape.", key));
    return whole_value(key, j_.at(key));
  }
  int64_t whole_or(const char* key, int64_t fallback) const { return has(key) ? whole(key) : fallback; }
  double real(const char* key) const {
    if (!has(key)) fail(fmt::format("has no \"{}\", which gives the model's shape.", key));
    return real_or(key, 0.0);
  }
  double real_or(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_number()) fail(fmt::format("holds {} as \"{}\", not a number.", j_.at(key).dump(), key));
    return j_.at(key).get<double>();
  }
  std::string text_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_string()) fail(fmt::format("holds {} as \"{}\", not a string.", j_.at(key).dump(), key));
    return j_.at(key).get<std::string>();
  }
  bool flag_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_boolean()) fail(fmt::format("holds {} as \"{}\", not true or false.", j_.at(key).dump(), key));
    return j_.at(key).get<bool>();
  }
  // A key remat's blocks have only one value of: another is refused, naming what remat has.
  template <class T>
  void require(const char* key, const T& value, const T& given, const std::string& why) const {
    if (given != value) fail(fmt::format("sets \"{}\" to {}, but {}.", key, json(given).dump(), why));
  }

 private:
  int64_t whole_value(const char* key, const json& v) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (int64_t{1} << 31)) {
      fail(fmt::format("holds {} as \"{}\", not a whole number from 1 to 2^31.", v.dump(), key));
    }
    return v.get<int64_t>();
  }

  json j_;
  std::string path_;
};

void read_gpt2(const HfConfig& c, ModelConfig& m) {
  m.arch = Arch::gpt2;
  m.n_layer = c.whole("n_layer");
  m.n_head = m.n_kv_head = c.whole("n_head");
  m.d_model = c.whole("n_embd");
  m.d_ff = c.whole_or("n_inner", 4 * m.d_model);
  m.vocab_size = c.whole("vocab_size");
  m.max_seq = c.whole("n_positions");
  m.norm_eps = c.real_or("layer_norm_epsilon", 1e-5);
  m.dropout = c.real_or("resid_pdrop", 0.1);
  c.require("activation_function", std::string("gelu_new"), c.text_or("activation_function", "gelu_new"),
            "remat's GPT-2 block has GELU in its tanh form (gelu_new) alone");
  m.tie_embeddings = c.flag_or("tie_word_embeddings", true);
  c.require("scale_attn_weights", true, c.flag_or("scale_attn_weights", true),
            "remat's attention scales its scores by 1/sqrt(head size)");
  c.require("scale_attn_by_inverse_layer_idx", false, c.flag_or("scale_attn_by_inverse_layer_idx", false),
            "remat's attention scales every layer alike");
}

// transformers 5 writes RoPE's settings as rope_parameters, earlier ones as rope_theta and
// rope_scaling; remat builds the default RoPE and Llama 3.1's "llama3" scaling of it.
void read_llama_rope(const HfConfig& c, ModelConfig& m) {
  m.rope_theta = c.real_or("rope_theta", 10000.0);
  m.rope_scaling = RopeScaling{};
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!c.has(key)) continue;
    if (!c.at(key).is_object()) c.fail(fmt::format("holds {} as \"{}\", not an object.", c.at(key).dump(), key));
    const HfConfig p(c.at(key), fmt::format("{}'s \"{}\"", c.path(), key));
    const std::string type = p.text_or("rope_type", p.text_or("type", "default"));
    if (type == "llama3") {
      m.rope_scaling.factor = p.real("factor");
      m.rope_scaling.low_freq_factor = p.real("low_freq_factor");
      m.rope_scaling.high_freq_factor = p.real("high_freq_factor");
      m.rope_scaling.original_max_seq = p.whole("original_max_position_embeddings");
    } else if (type != "default") {
      c.fail(
          fmt::format("asks for RoPE of type \"{}\" in \"{}\", but remat builds the default RoPE and Llama "
                      "3.1's \"llama3\" scaling alone.",
                      util::printable(type), key));
    }
    m.rope_theta = p.real_or("rope_theta", m.rope_theta);
  }
}

void read_llama(const HfConfig& c, ModelConfig& m) {
  m.arch = Arch::llama;
  m.n_layer = c.whole("num_hidden_layers");
  m.n_head = c.whole("num_attention_heads");
  m.n_kv_head = c.whole_or("num_key_value_heads", m.n_head);
  m.d_model = c.whole("hidden_size");
  m.d_ff = c.whole("intermediate_size");
  m.vocab_size = c.whole("vocab_size");
  m.max_seq = c.whole("max_position_embeddings");
  m.norm_eps = c.real_or("rms_norm_eps", 1e-6);
  read_llama_rope(c, m);
  m.dropout = c.real_or("attention_dropout", 0.0);
  c.require("head_dim", m.d_model / m.n_head, c.whole_or("head_dim", m.d_model / m.n_head),
            "remat's heads are hidden_size / num_attention_heads wide");
  c.require("hidden_act", std::string("silu"), c.text_or("hidden_act", "silu"),
            "remat's Llama MLP is SwiGLU, with SiLU");
  c.require("attention_bias", false, c.flag_or("attention_bias", false), "remat's Llama projections have no bias");
  c.require("mlp_bias", false, c.flag_or("mlp_bias", false), "remat's Llama projections have no bias");
  m.tie_embeddings = c.flag_or("tie_word_embeddings", false);
}

}  // namespace

ModelConfig hf_model_config(const std::string& path, const ModelConfig& base) {
  json j;
  try {
    j = json::parse(util::read_file(path, "the model config", kMaxConfigJsonBytes));
  } catch (const json::exception& e) {
    throw std::invalid_argument(
        fmt::format("The model config {} is not JSON ({}).", util::printable(path), util::printable(e.what())));
  }
  if (!j.is_object()) throw std::invalid_argument(fmt::format("The model config {} is not a JSON object.", path));
  const HfConfig c(j, path);
  const std::string type = c.text_or("model_type", "");
  ModelConfig m = base;
  if (type == "gpt2") {
    read_gpt2(c, m);
  } else if (type == "llama") {
    read_llama(c, m);
  } else {
    c.fail(fmt::format("is of model_type \"{}\"; remat builds gpt2 and llama.", util::printable(type)));
  }
  return m;
}

std::string hf_config_json(const ModelConfig& m, int64_t vocab_size, int bos_id, int eos_id) {
  json j;
  if (m.arch == Arch::gpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"n_layer", m.n_layer},
         {"n_head", m.n_head},
         {"n_embd", m.d_model},
         {"n_inner", m.d_ff},
         {"n_positions", m.max_seq},
         {"vocab_size", vocab_size},
         {"layer_norm_epsilon", m.norm_eps},
         {"activation_function", "gelu_new"},
         {"resid_pdrop", m.dropout},
         {"embd_pdrop", m.dropout},
         {"attn_pdrop", m.dropout},
         {"tie_word_embeddings", m.tie_embeddings}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"num_hidden_layers", m.n_layer},
         {"num_attention_heads", m.n_head},
         {"num_key_value_heads", m.n_kv_head},
         {"hidden_size", m.d_model},
         {"head_dim", m.head_dim()},
         {"intermediate_size", m.d_ff},
         {"max_position_embeddings", m.max_seq},
         {"vocab_size", vocab_size},
         {"rms_norm_eps", m.norm_eps},
         {"rope_theta", m.rope_theta},
         {"hidden_act", "silu"},
         {"attention_bias", false},
         {"mlp_bias", false},
         {"attention_dropout", m.dropout},
         {"tie_word_embeddings", m.tie_embeddings}};
    if (m.rope_scaling.scaled()) {
      // The older spelling, which transformers 4 reads and 5 converts.
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", m.rope_scaling.factor},
                           {"low_freq_factor", m.rope_scaling.low_freq_factor},
                           {"high_freq_factor", m.rope_scaling.high_freq_factor},
                           {"original_max_position_embeddings", m.rope_scaling.original_max_seq}};
    }
  }
  j["bos_token_id"] = bos_id >= 0 ? json(bos_id) : json(nullptr);
  j["eos_token_id"] = eos_id >= 0 ? json(eos_id) : json(nullptr);
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

}  // namespace remat
