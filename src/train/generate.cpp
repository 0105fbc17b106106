#include "train/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace remat {

void check_temperature(double temperature) {
  // NaN fails both comparisons: ATen's sampler would refuse it with a message of its own.
  if (!(temperature >= 0 && temperature <= 100)) {
    throw std::invalid_argument(
        fmt::format("The sampling temperature must be a number from 0 (greedy) to 100, got "
                    "{}; 0.8 is usual.",
                    temperature));
  }
}

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD, what an incomplete character decodes to

bool ends_in_replacement(const std::string& text) {
  return text.size() >= kReplacement.size() &&
         text.compare(text.size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0;
}

}  // namespace

std::string sample_text(Model& model, const data::Tokenizer& tok, const std::string& prompt, int64_t tokens,
                        double temperature, int64_t top_k, uint64_t seed, const TextSink& on_text, int64_t* generated,
                        const std::function<bool(int64_t)>& go_on) {
  check_temperature(temperature);
  std::vector<int32_t> ids = tok.encode(prompt);
  if (ids.empty()) ids.push_back(tok.bos_id() >= 0 ? tok.bos_id() : 0);
  // The text is decoded from `settled`, the first token after the last point where the
  // text ended in a whole character: with identity normalisation and no dummy prefix the
  // decoding of ids[0, settled) and of the rest add up to the whole one, so each token costs
  // the decoding of a few tokens, not of the whole text. `text` is that of ids[0, settled);
  // `shown` how much of the rest on_text has been given.
  std::string text;
  size_t settled = 0, shown = 0;
  const auto advance = [&](bool last) {
    const std::string tail = tok.decode(ids.data() + settled, ids.size() - settled);
    // A character whose bytes are still coming decodes as U+FFFD for now: held back until
    // its last byte comes, since text once streamed cannot be taken back.
    size_t ready = tail.size();
    while (!last && ready >= kReplacement.size() &&
           tail.compare(ready - kReplacement.size(), kReplacement.size(), kReplacement) == 0) {
      ready -= kReplacement.size();
    }
    if (on_text && ready > shown) on_text(std::string_view(tail).substr(shown, ready - shown));
    shown = std::max(shown, ready);
    if (last || !ends_in_replacement(tail)) {
      text += tail;
      settled = ids.size();
      shown = 0;
    }
  };
  auto gen = at::detail::createCPUGenerator(seed);
  const int64_t ctx = model.config().max_seq;
  int64_t made = 0;
  for (; made < tokens && (!go_on || go_on(made)); ++made) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - ctx);
    std::vector<int64_t> window(ids.begin() + start, ids.end());
    at::Tensor input = at::tensor(window, at::kLong).view({1, -1}).to(model.device());
    // A model.vocab_size above the tokenizer's has rows no piece decodes; never sample them.
    at::Tensor logits = model.last_logits(input)[0].to(at::kCPU).narrow(0, 0, tok.vocab_size());
    if (!at::isfinite(logits).all().item<bool>()) {
      throw std::runtime_error(fmt::format(
          "The model's logits for generated token {} are not finite although its weights are: the forward overflows "
          "on this prompt; try a shorter prompt, or train the model again with a lower train.lr.",
          made + 1));
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
    advance(false);
  }
  advance(true);
  if (generated != nullptr) *generated = made;
  return text;
}

}  // namespace remat

#include "remat/trainer.h"
#include "util/device.h"
#include "remat/safetensors.h"
#include "train/checkpoints.h"
#include "train/step.h"
#include "util/stop_signals.h"

#include <filesystem>

namespace remat {

std::string generate_from_run(const std::string& run_dir, const std::string& prompt, int64_t tokens, double temperature,
                              int64_t top_k, uint64_t seed, const std::string& device, const TextSink& on_text,
                              int64_t* generated) {
  namespace fs = std::filesystem;
  const util::Phase phase("generating");
  check_temperature(temperature);
  for (const char* f : {"config.toml", "model.safetensors", "tokenizer.model"}) {
    if (!fs::exists(fs::path(run_dir) / f)) {
      // A run stopped after its last checkpoint but before its final files can write them.
      const bool finishable = std::string(f) == "model.safetensors" && !list_checkpoints(run_dir).empty();
      throw std::invalid_argument(fmt::format(
          "{} has no {}; {}", run_dir, f,
          finishable ? fmt::format("the run stopped before writing its final weights: `remat train --resume {}` "
                                   "writes them (from its last checkpoint, training the steps it had left first).",
                                   run_dir)
                     : "pass the directory of a finished `remat train` run."));
    }
  }
  const std::string weights = (fs::path(run_dir) / "model.safetensors").string();
  const Config cfg = load_config((fs::path(run_dir) / "config.toml").string(), {});
  // An edited config.toml must not reserve memory for a model far larger than the weights
  // (a lower bound: two MLP matrices per layer, at 2 bytes an element).
  const model::SafeTensorsHeader header = model::read_safetensors_header(weights);
  const int64_t file_bytes = header.tensors.empty() ? 0 : header.tensors.back().end;
  const double mlp_bytes = 2.0 * 2.0 * static_cast<double>(cfg.model.n_layer) * static_cast<double>(cfg.model.d_model) *
                           static_cast<double>(cfg.model.d_ff);
  if (mlp_bytes > 1.01 * static_cast<double>(file_bytes)) {
    throw std::invalid_argument(fmt::format(
        "{} describes a model of at least {:.3g} bytes of weights ({} layers, d_model {}, d_ff {}), but {} holds {} "
        "bytes: the config was changed after the run; restore the config.toml the run wrote.",
        (fs::path(run_dir) / "config.toml").string(), mlp_bytes, cfg.model.n_layer, cfg.model.d_model, cfg.model.d_ff,
        weights, file_bytes));
  }
  const at::Device dev = available_device(device.empty() ? cfg.run.device : device_of(device), DeviceAsk::sample);
  auto model =
      Model::create(cfg.model, dev, dev.is_cuda() ? device_dtype(dtype_of(cfg.run.dtype), dev) : at::kFloat, 0);
  model->load(weights);
  if (const std::string bad = first_non_finite(*model); !bad.empty()) {
    throw std::invalid_argument(fmt::format(
        "The weights in {} hold non-finite values (first: {}), so every sample would be noise; the run that wrote "
        "them diverged: train again with a lower train.lr.",
        (fs::path(run_dir) / "model.safetensors").string(), bad));
  }
  const auto tok = data::Tokenizer::load((fs::path(run_dir) / "tokenizer.model").string());
  return sample_text(*model, tok, prompt, tokens, temperature, top_k, seed, on_text, generated);
}

}  // namespace remat
