#include "checkpoint/rng_state.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <algorithm>
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

at::Generator cuda_generator(c10::DeviceIndex index) {
  return at::globalContext().defaultGenerator(at::Device(at::kCUDA, index));
}

std::vector<c10::DeviceIndex> devices_of(const RngStates& s) {
  std::vector<c10::DeviceIndex> devices;
  for (const auto& [d, state] : s.cuda) devices.push_back(d);
  return devices;
}

}  // namespace

RngStates RngStates::capture(at::TensorList inputs) {
  std::vector<c10::DeviceIndex> devices;
  for (const at::Tensor& x : inputs) {
    if (x.defined() && x.is_cuda() && std::find(devices.begin(), devices.end(), x.get_device()) == devices.end()) {
      devices.push_back(x.get_device());
    }
  }
  return capture_on(devices);
}

RngStates RngStates::capture_on(const std::vector<c10::DeviceIndex>& devices) {
  RngStates s;
  s.cpu = state_of(at::globalContext().defaultGenerator(at::kCPU));
  for (const c10::DeviceIndex d : devices) s.cuda.emplace_back(d, state_of(cuda_generator(d)));
  return s;
}

void RngStates::restore() const {
  set_state(at::globalContext().defaultGenerator(at::kCPU), cpu);
  for (const auto& [d, state] : cuda) set_state(cuda_generator(d), state);
}

RngFork::RngFork(const RngStates& replay) : resume_(RngStates::capture_on(devices_of(replay))) { replay.restore(); }

RngFork::~RngFork() { resume_.restore(); }

}  // namespace remat::detail
