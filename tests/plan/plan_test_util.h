// Shared by the cost-model and planner tests.
#pragma once

#include "remat/config.h"

#include <string>

namespace remat::testing {

/// A preset with `layers` blocks and dropout `dropout`; presets that take the
/// tokenizer's vocabulary get 512.
inline ModelConfig plan_config(const std::string& preset, int64_t layers, double dropout) {
  ModelConfig c = model_preset(preset);
  c.n_layer = layers;
  c.dropout = dropout;
  if (c.vocab_size == 0) c.vocab_size = 512;
  return c;
}

}  // namespace remat::testing
