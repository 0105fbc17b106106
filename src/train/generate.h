// Autoregressive sampling from a model (no KV cache: each token re-runs the context,
// which is what the demo sizes need).
#pragma once

#include "remat/model.h"
#include "remat/trainer.h"
#include "remat/tokenizer.h"

#include <cstdint>
#include <string>

namespace remat {

/// Continues `prompt` by `tokens` tokens, sampling with `temperature` (0: greedy) from the
/// `top_k` most likely tokens (0: all). Deterministic for a seed. `on_text`, when given,
/// receives the text as it grows (the prompt first), so a long generation shows at once;
/// the pieces add up to the returned text.
std::string sample_text(Model& model, const data::Tokenizer& tok, const std::string& prompt, int64_t tokens,
                        double temperature, int64_t top_k, uint64_t seed, const TextSink& on_text = {});

}  // namespace remat
