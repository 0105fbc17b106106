#include "remat/trace.h"

#include "util/atomic_file.h"

#include "remat/memory.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace remat::trace {

namespace detail {
std::atomic<bool> g_recording{false};
}  // namespace detail

namespace {

struct Slice {
  const char* name;
  int64_t layer;
  Category category;
  int64_t begin_ns, end_ns;
  int tid;
};

struct Sample {
  int64_t ns;
  int64_t bytes;
};

struct Recorder {
  std::mutex mutex;
  at::Device device{at::kCPU};
  std::chrono::steady_clock::time_point origin;
  std::vector<Slice> slices;
  std::vector<Sample> samples;
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

// Inside a Recompute guard, forward ops are recompute.
thread_local bool t_recomputing = false;

// Small per-thread numbers, in order of first use, for the trace's "tid".
int thread_number() {
  static std::atomic<int> next{1};
  thread_local const int n = next.fetch_add(1);
  return n;
}

const char* category_name(Category c) {
  switch (c) {
    case Category::forward:
      return "forward";
    case Category::backward:
      return "backward";
    case Category::recompute:
      return "recompute";
    case Category::layer:
      return "layer";
    case Category::step:
      return "step";
  }
  return "";
}

// Nanoseconds since start(), after the device's queued work (CUDA) has finished, with a
// memory sample taken at that moment. Caller holds the recorder's mutex.
int64_t now_with_sample(Recorder& r) {
#ifdef REMAT_WITH_CUDA
  if (r.device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(r.device);
    c10::cuda::device_synchronize();
  }
#endif
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - r.origin).count();
  r.samples.push_back({ns, memory::stats(r.device).current});
  return ns;
}

// Microseconds with nanosecond digits: Perfetto reads them back to the exact nanosecond,
// so a child's end never passes its parent's.
double micros(int64_t ns) { return static_cast<double>(ns) / 1000.0; }

}  // namespace

void start(at::Device device) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda() && !device.has_index()) device = at::Device(at::kCUDA, c10::cuda::current_device());
#endif
  r.device = device;
  r.slices.clear();
  r.samples.clear();
  r.origin = std::chrono::steady_clock::now();
  detail::g_recording.store(true);
}

std::string stop() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  detail::g_recording.store(false);
  // Slices are recorded as they end (children first); viewers want parents first.
  std::sort(r.slices.begin(), r.slices.end(), [](const Slice& a, const Slice& b) {
    return std::make_tuple(a.begin_ns, -a.end_ns) < std::make_tuple(b.begin_ns, -b.end_ns);
  });
  const int pid = static_cast<int>(::getpid());
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", "remat"}}}});
  for (const Slice& s : r.slices) {
    events.push_back({{"ph", "X"},
                      {"name", s.layer >= 0 ? fmt::format("layer {} {}", s.layer + 1, s.name) : std::string(s.name)},
                      {"cat", category_name(s.category)},
                      {"ts", micros(s.begin_ns)},
                      {"dur", micros(s.end_ns - s.begin_ns)},
                      {"pid", pid},
                      {"tid", s.tid}});
  }
  for (const Sample& s : r.samples) {
    events.push_back(
        {{"ph", "C"}, {"name", "memory"}, {"ts", micros(s.ns)}, {"pid", pid}, {"args", {{"bytes", s.bytes}}}});
  }
  r.slices.clear();
  r.samples.clear();
  return nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

void check_writable(const std::string& path) { util::check_new_file(path, "the trace", "run.trace, --trace"); }

void Scope::begin(const char* name, Category category, int64_t layer) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  active_ = true;
  name_ = name;
  category_ = category == Category::forward && t_recomputing ? Category::recompute : category;
  layer_ = layer;
  begin_ns_ = now_with_sample(r);
}

void Scope::end() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  // A scope still open when the recording stopped is left out, not cut short.
  if (!recording()) return;
  const int64_t end_ns = now_with_sample(r);
  r.slices.push_back({name_, layer_, category_, begin_ns_, end_ns, thread_number()});
}

Recompute::Recompute(int64_t layer) {
  if (!recording() || t_recomputing) return;
  outermost_ = true;
  t_recomputing = true;
  slice_.begin("recompute", Category::layer, layer);
}

Recompute::~Recompute() {
  if (outermost_) t_recomputing = false;
}

}  // namespace remat::trace
