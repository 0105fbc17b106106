#include "checkpoint/rng_state.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/util/irange.h>

#include <mutex>

namespace remat::detail {
namespace {

// Generators are shared process-wide; their own mutex guards state reads and writes.
at::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

at::Generator cuda_generator(size_t index) {
  return at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
}

}  // namespace

RngStates RngStates::capture() {
  RngStates s;
  s.cpu = state_of(at::globalContext().defaultGenerator(at::kCPU));
  if (at::hasCUDA()) {
    for (const auto i : c10::irange(at::getNumGPUs())) {
      s.cuda.push_back(state_of(cuda_generator(i)));
    }
  }
  return s;
}

void RngStates::restore() const {
  set_state(at::globalContext().defaultGenerator(at::kCPU), cpu);
  for (const auto i : c10::irange(cuda.size())) {
    set_state(cuda_generator(i), cuda[i]);
  }
}

RngFork::RngFork(const RngStates& replay) : resume_(RngStates::capture()) { replay.restore(); }

RngFork::~RngFork() { resume_.restore(); }

}  // namespace remat::detail
