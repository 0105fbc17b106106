// Shared by the cost-model and planner tests.
#pragma once

#include "remat/config.h"
#include "remat/cost.h"

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

/// A step of `B` x `T` tokens in `dtype`, `microbatches` of them, the loss head in chunks
/// of 100 positions.
inline cost::StepShape plan_shape(int64_t B, int64_t T, at::ScalarType dtype = at::kFloat, int64_t microbatches = 1) {
  cost::StepShape s;
  s.batch = B;
  s.seq = T;
  s.ce_chunk = 100;
  s.dtype = dtype;
  s.grad_accum = microbatches;
  return s;
}

}  // namespace remat::testing
