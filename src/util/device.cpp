#include "util/device.h"

#include "util/openblas.h"

#include <ATen/Parallel.h>
#include <ATen/Context.h>
#include <fmt/format.h>

#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <chrono>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <thread>

namespace remat {

at::Device available_device(at::Device device, DeviceAsk ask) {
  if (!device.is_cuda()) return device;
  const char* setting = ask == DeviceAsk::sample ? "--device " : "run.device=";
  if (!at::hasCUDA()) {
    const std::string asked = fmt::format("{}{}", setting, device.str());
    switch (ask) {
      case DeviceAsk::config:
        throw std::invalid_argument(fmt::format(
            "{} was asked for, but this LibTorch has no CUDA device available; use run.device=cpu.", asked));
      case DeviceAsk::resumed:
        throw std::invalid_argument(fmt::format(
            "The run trained on {}, but this LibTorch has no CUDA device available; a run resumes on the device it "
            "trained on (its plan and its numbers are that device's): resume it on a machine with a GPU, or start a "
            "new run with run.device=cpu.",
            asked));
      case DeviceAsk::sample:
        throw std::invalid_argument(fmt::format(
            "{} (the run's device where --device is not given) was asked for, but this LibTorch has no CUDA device "
            "available; sample on the CPU with --device cpu.",
            asked));
    }
  }
  const int64_t n = static_cast<int64_t>(at::getNumGPUs());
  const int64_t index = device.has_index() ? device.index() : 0;
  if (index >= n) {
    throw std::invalid_argument(fmt::format("{}{} names no GPU here; this machine has {} (cuda:0 to cuda:{}).", setting,
                                            device.str(), n, n - 1));
  }
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

at::ScalarType device_dtype(at::ScalarType dtype, at::Device device) {
  if (dtype == at::kBFloat16 && !device.is_cuda()) {
    throw std::invalid_argument(
        "run.dtype=bfloat16 needs a CUDA device: CPU matmuls in bfloat16 are emulated and slower than float32 "
        "here; use run.dtype=float32 on CPU.");
  }
  return dtype;
}

namespace {

using util::BlasThreading;
using util::openblas;

// The thread count OpenBLAS is given beside `threads` ATen threads. The OpenMP build runs in
// ATen's own pool, so it takes them all (a kernel calling it inside ATen's parallel regions
// holds it to one: util::SerialBlas).
// The pthread build keeps a pool of its own whose workers spin after every call while
// OpenMP's spin in turn (over half the CPU time of a step on 2 cores): it is held to one.
int blas_threads(int threads) { return openblas().threading() == BlasThreading::pthreads ? 1 : threads; }

}  // namespace

int set_threads(int64_t requested) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(requested > 0 ? static_cast<int>(requested) : cores);
  const int threads = at::get_num_threads();
  if (openblas().set_threads) openblas().set_threads(blas_threads(threads));
  return threads;
}

std::string blas_name() {
  // Read once: OpenBLAS builds the description in one static buffer (strcpy, then strcat of
  // the core's name) on every call, so ranks calling at once (threads of one process) could
  // read it half-written, name different profile files and wait for each other forever.
  static const std::string name = [] {
    const util::OpenBlas& b = openblas();
    if (!b.config) return std::string("ATen's BLAS (not OpenBLAS)");
    std::string config = b.config();
    while (!config.empty() && config.back() == ' ') config.pop_back();
    switch (b.threading()) {
      case BlasThreading::openmp:
        return config + " (OpenMP: ATen's thread pool)";
      case BlasThreading::pthreads:
        return config + " (pthreads: held to 1 thread)";
      case BlasThreading::none:
        break;
    }
    return config + " (single-threaded)";
  }();
  return name;
}

namespace {

// The number after `key` in a /proc-style "key value" file, times `unit`; -1 if absent.
int64_t read_field(const char* path, const std::string& key, int64_t unit) {
  std::ifstream in(path);
  std::string k;
  int64_t v = 0;
  while (in >> k) {
    if (k == key && in >> v) return v * unit;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return -1;
}

// cgroup v2's limit minus its usage; -1 without a limit ("max") or a cgroup file.
int64_t cgroup_available() {
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), current_file("/sys/fs/cgroup/memory.current");
  int64_t limit = 0, used = 0;
  if (!(max_file >> limit) || !(current_file >> used)) return -1;
  return std::max<int64_t>(0, limit - used);
}

}  // namespace

int64_t memory_available(at::Device device) {
  if (device.is_cuda()) {
#ifdef REMAT_WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(free);
#else
    return -1;
#endif
  }
  const int64_t meminfo = read_field("/proc/meminfo", "MemAvailable:", 1024);
  const int64_t cgroup = cgroup_available();
  if (meminfo < 0 || cgroup < 0) return std::max(meminfo, cgroup);
  return std::min(meminfo, cgroup);
}

void synchronize(at::Device device) {
  if (device.is_cuda()) {
    // A blocking copy of one element waits for every kernel queued before it.
    at::zeros({1}, at::TensorOptions().device(device)).cpu();
  }
}

double measure_matmul_flops(at::Device device, at::ScalarType dtype, int64_t rows, int64_t k, int64_t n) {
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  // The denominator is what this process's cores sustain: a BLAS held to one thread (the
  // pthread build) is let use them all while measuring, so its throttle shows as lost efficiency.
  const util::OpenBlas& blas = openblas();
  const int threads = at::get_num_threads();
  if (blas.set_threads) blas.set_threads(threads);
  double best = 0.0;
  // The model's own GEMM shape and a square one: the best of them is "what this machine
  // sustains", the denominator of the efficiency figure.
  // Rows past 16384 add nothing to the rate but bytes: a batch of a million sequences
  // allocated 61 GiB here before its plan was refused.
  const int64_t shapes[2][3] = {{std::min<int64_t>(rows, 16384), k, n}, {1024, 1024, 1024}};
  for (const auto& s : shapes) {
    at::Tensor a = at::randn({s[0], s[1]}, opts), b = at::randn({s[1], s[2]}, opts);
    at::Tensor c = at::mm(a, b);  // warm-up
    synchronize(device);
    const double flops = 2.0 * s[0] * s[1] * s[2];
    int reps = std::max<int>(1, static_cast<int>(1e9 / flops));
    for (int trial = 0; trial < 3; ++trial) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) at::mm_out(c, a, b);
      synchronize(device);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, reps * flops / dt);
    }
  }
  if (blas.set_threads) blas.set_threads(blas_threads(threads));
  return best;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace remat
