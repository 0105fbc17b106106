#include "remat/config.h"
#include "util/utf8.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace remat {
namespace {

struct Preset {
  const char* name;
  ModelConfig (*make)();
};

ModelConfig gpt2(int64_t layers, int64_t heads, int64_t d, int64_t vocab, int64_t ctx, double drop) {
  ModelConfig m;
  m.arch = Arch::gpt2;
  m.n_layer = layers;
  m.n_head = m.n_kv_head = heads;
  m.d_model = d;
  m.d_ff = 4 * d;
  m.vocab_size = vocab;
  m.max_seq = ctx;
  m.dropout = drop;
  m.norm_eps = 1e-5;
  return m;
}

ModelConfig llama(int64_t layers, int64_t heads, int64_t kv, int64_t d, int64_t ff, int64_t vocab, int64_t ctx,
                  double theta, double eps) {
  ModelConfig m;
  m.arch = Arch::llama;
  m.n_layer = layers;
  m.n_head = heads;
  m.n_kv_head = kv;
  m.d_model = d;
  m.d_ff = ff;
  m.vocab_size = vocab;
  m.max_seq = ctx;
  m.dropout = 0.0;
  m.rope_theta = theta;
  m.norm_eps = eps;
  m.tie_embeddings = false;
  return m;
}

// Llama 3.1's and 3.2's long context: RoPE stretched by `factor` past the 8192 positions
// Llama 3 was trained at; 3.2's small models also tie their head to the embedding.
ModelConfig llama3_scaled(ModelConfig m, double factor, bool tied) {
  m.rope_scaling.factor = factor;
  m.rope_scaling.low_freq_factor = 1.0;
  m.rope_scaling.high_freq_factor = 4.0;
  m.rope_scaling.original_max_seq = 8192;
  m.tie_embeddings = tied;
  return m;
}

// Smallest first. The tiny ones are for tests, the demo ones train in minutes on two
// cores, the real shapes are for planning (vocab_size 0: the prepared tokenizer's).
const Preset kPresets[] = {
    {"tiny-gpt2", [] { return gpt2(2, 2, 16, 64, 32, 0.1); }},
    {"tiny-llama", [] { return llama(2, 4, 2, 32, 48, 64, 32, 10000.0, 1e-5); }},
    {"gpt2-demo", [] { return gpt2(4, 4, 128, 0, 256, 0.1); }},
    {"llama-demo", [] { return llama(4, 4, 2, 128, 352, 0, 256, 10000.0, 1e-5); }},
    {"gpt2", [] { return gpt2(12, 12, 768, 50257, 1024, 0.1); }},
    {"gpt2-medium", [] { return gpt2(24, 16, 1024, 50257, 1024, 0.1); }},
    {"llama3.2-1b",
     [] { return llama3_scaled(llama(16, 32, 8, 2048, 8192, 128256, 131072, 500000.0, 1e-5), 32, true); }},
    {"llama3-8b", [] { return llama(32, 32, 8, 4096, 14336, 128256, 8192, 500000.0, 1e-5); }},
    {"llama3.1-8b",
     [] { return llama3_scaled(llama(32, 32, 8, 4096, 14336, 128256, 131072, 500000.0, 1e-5), 8, false); }},
    {"llama3.1-70b",
     [] { return llama3_scaled(llama(80, 64, 8, 8192, 28672, 128256, 131072, 500000.0, 1e-5), 8, false); }},
};

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

ModelConfig model_preset(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name == p.name) {
      ModelConfig m = p.make();
      m.preset = name;
      return m;
    }
  }
  throw std::invalid_argument(fmt::format("Unknown model preset '{}'; valid presets: {}.", util::printable(name),
                                          fmt::join(preset_names(), ", ")));
}

}  // namespace remat
