#include "train/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace remat {

std::string sample_text(Model& model, const data::Tokenizer& tok, const std::string& prompt, int64_t tokens,
                        double temperature, int64_t top_k, uint64_t seed, const TextSink& on_text) {
  // What on_text has been given; the decoded text grows at its end, except while a
  // multi-byte character is still incomplete, which waits for the token that ends it.
  std::string shown;
  const auto show = [&](const std::string& text) {
    if (!on_text || text.size() <= shown.size() || text.compare(0, shown.size(), shown) != 0) return;
    on_text(std::string_view(text).substr(shown.size()));
    shown = text;
  };
  std::vector<int32_t> ids = tok.encode(prompt);
  if (ids.empty()) ids.push_back(tok.bos_id() >= 0 ? tok.bos_id() : 0);
  auto gen = at::detail::createCPUGenerator(seed);
  const int64_t ctx = model.config().max_seq;
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - ctx);
    std::vector<int64_t> window(ids.begin() + start, ids.end());
    at::Tensor input = at::tensor(window, at::kLong).view({1, -1}).to(model.device());
    // A model.vocab_size above the tokenizer's has rows no piece decodes; never sample them.
    at::Tensor logits = model.last_logits(input)[0].to(at::kCPU).narrow(0, 0, tok.vocab_size());
    if (!at::isfinite(logits).all().item<bool>()) {
      throw std::runtime_error(fmt::format(
          "The model's logits for generated token {} are not finite although its weights are: the forward overflows "
          "on this prompt; try a shorter prompt, or train the model again with a lower train.lr.", i + 1));
    }
    int64_t next = 0;
    if (temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      // Shifted by the maximum first, so even a tiny temperature cannot overflow.
      logits = (logits.to(at::kDouble) - logits.max().item<double>()) / temperature;
      if (top_k > 0 && top_k < logits.size(0)) {
        const double kth = std::get<0>(logits.topk(top_k)).min().item<double>();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
      }
      next = at::multinomial(at::softmax(logits, 0), 1, false, gen).item<int64_t>();
    }
    if (next == tok.eos_id()) break;
    ids.push_back(static_cast<int32_t>(next));
    show(tok.decode(ids));
  }
  const std::string text = tok.decode(ids);
  show(text);
  return text;
}

}  // namespace remat

#include "remat/trainer.h"
#include "train/device.h"
#include "train/step.h"

#include <filesystem>

namespace remat {

std::string generate_from_run(const std::string& run_dir, const std::string& prompt, int64_t tokens,
                              double temperature, int64_t top_k, uint64_t seed, const std::string& device,
                              const TextSink& on_text) {
  namespace fs = std::filesystem;
  for (const char* f : {"config.toml", "model.safetensors", "tokenizer.model"}) {
    if (!fs::exists(fs::path(run_dir) / f)) {
      throw std::invalid_argument(fmt::format("{} has no {}; pass the directory of a finished `remat train` run.",
                                              run_dir, f));
    }
  }
  const Config cfg = load_config((fs::path(run_dir) / "config.toml").string(), {});
  const at::Device dev = parse_device(device.empty() ? cfg.run.device : device);
  auto model = Model::create(cfg.model, dev, dev.is_cuda() ? parse_dtype(cfg.run.dtype, dev) : at::kFloat, 0);
  model->load((fs::path(run_dir) / "model.safetensors").string());
  if (const std::string bad = first_non_finite(*model); !bad.empty()) {
    throw std::invalid_argument(fmt::format(
        "The weights in {} hold non-finite values (first: {}), so every sample would be noise; the run that wrote "
        "them diverged: train again with a lower train.lr.", (fs::path(run_dir) / "model.safetensors").string(), bad));
  }
  const auto tok = data::Tokenizer::load((fs::path(run_dir) / "tokenizer.model").string());
  return sample_text(*model, tok, prompt, tokens, temperature, top_k, seed, on_text);
}

}  // namespace remat
