// The plan a run trained with, as its training checkpoints keep it: a resumed run runs it
// again, whatever planning would choose now (another machine's measured times, a cache
// measured again), so that its memory stays what was predicted and printed.
#pragma once

#include "remat/plan.h"

#include <cstdint>
#include <string>
#include <vector>

namespace remat {

struct SavedPlan {
  ActivationPlan plan;         ///< every layer's, of the whole model
  std::vector<int64_t> split;  ///< layers per pipeline stage
};

/// `plan` and `split` as one JSON text (a checkpoint's "plan" metadata).
std::string saved_plan_json(const ActivationPlan& plan, const std::vector<int64_t>& split);

/// The plan `json` holds, for a model of `n_layers` blocks on `stages` pipeline stages.
/// Throws std::invalid_argument with a sentence when it is damaged or was made for another
/// model (the layer count, the split, a slot no block has).
SavedPlan parse_saved_plan(const std::string& json, int64_t n_layers, int64_t stages);

}  // namespace remat
