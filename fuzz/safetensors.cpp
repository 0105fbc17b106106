// Feeds the safetensors reader (load_safetensors, which validates the header with
// read_safetensors_header's checks first, then reads every tensor): the input is the file.
// The same bytes then go, as the JSON files beside a Hugging Face model's weights, to the
// shards' index reader and to the config.json reader. A finding: anything but their
// sentences (std::runtime_error; std::invalid_argument from the config reader) out of them:
// a crash, a sanitizer report, a hang, runaway memory, or a c10::Error (LibTorch refusing
// what the header checks let through).
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <string>

#include "harness.h"
#include "remat/config.h"
#include "remat/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const remat::fuzz::TempFile file(remat::fuzz::temp_path("safetensors"), data, size);
  try {
    const remat::model::SafeTensors loaded = remat::model::load_safetensors(file.path());
    for (const auto& [name, tensor] : loaded.tensors) {
      if (!tensor.is_contiguous() || loaded.find(name) == nullptr) {
        remat::fuzz::finding("tensor '" + name + "' is loaded but not contiguous or not found by name");
      }
    }
  } catch (const c10::Error& e) {
    remat::fuzz::finding(std::string("LibTorch refused a file the header checks passed: ") +
                         e.what_without_backtrace());
  } catch (const std::runtime_error&) {
  }
  try {
    remat::model::safetensors_index_files(file.path());
  } catch (const std::runtime_error&) {
  }
  try {
    remat::hf_model_config(file.path(), remat::ModelConfig{});
  } catch (const std::invalid_argument&) {
  } catch (const std::runtime_error&) {
  }
  return 0;
}
