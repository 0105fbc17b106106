// Autoregressive sampling from a model. No KV cache: each token re-runs its context (at
// most model.max_seq tokens), which is what the demo sizes need; past the context every
// token costs the same, so a long generation takes time linear in its length.
#pragma once

#include "remat/model.h"
#include "remat/trainer.h"
#include "remat/tokenizer.h"

#include <cstdint>
#include <functional>
#include <string>

namespace remat {

/// Throws a sentence unless `temperature` is a number from 0 to 100.
void check_temperature(double temperature);

/// Continues `prompt` by `tokens` tokens, sampling with `temperature` (0: greedy) from the
/// `top_k` most likely tokens (0: all). Deterministic for a seed. `on_text`, when given,
/// receives the text as it grows (the prompt first), so a long generation shows at once;
/// the pieces add up to the returned text. `temperature` must be finite, from 0 to 100.
/// Sampling stops early at the end-of-text token, or when `go_on`, asked before each token
/// with the number sampled so far, says false; `generated`, when given, receives the
/// number of tokens sampled (`tokens` when nothing stopped it).
std::string sample_text(Model& model, const data::Tokenizer& tok, const std::string& prompt, int64_t tokens,
                        double temperature, int64_t top_k, uint64_t seed, const TextSink& on_text = {},
                        int64_t* generated = nullptr, const std::function<bool(int64_t)>& go_on = {});

}  // namespace remat
