// Editing a training checkpoint the way a test needs (another plan, a damaged field),
// written back with a fresh checksum so that only the edit is wrong with it.
#pragma once

#include "remat/safetensors.h"

#include <algorithm>
#include <functional>
#include <string>

namespace remat::testing {

inline void rewrite_checkpoint(const std::string& path, const std::function<void(model::SafeTensors&)>& edit) {
  model::SafeTensors file = model::load_safetensors(path);
  auto& tensors = file.tensors;
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const auto& named) { return named.first == model::kChecksumTensor; }),
                tensors.end());
  edit(file);
  model::save_safetensors(path, file.tensors, file.metadata, /*checksum=*/true);
}

}  // namespace remat::testing
