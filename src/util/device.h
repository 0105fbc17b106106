// Device selection, thread count and the machine's measured matmul rate.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace remat {

/// Who asked for a device, which says what a user can do instead where it is missing.
enum class DeviceAsk {
  config,   ///< run.device of a new run or a bench
  resumed,  ///< a resumed run's run.device, which --resume does not change
  sample,   ///< remat generate's --device, or the run's device in its place
};

/// `device` where it exists here: "cuda" the first GPU; otherwise a sentence saying what
/// `ask`'s user can do instead.
at::Device available_device(at::Device device, DeviceAsk ask = DeviceAsk::config);
/// `dtype` (run.dtype's, remat/config.h's dtype_of), refusing bfloat16 where `device`
/// lacks it.
at::ScalarType device_dtype(at::ScalarType dtype, at::Device device);
/// Sets the intra-op thread count (0: all cores) and returns the count in effect. OpenBLAS's
/// OpenMP build runs its matrix multiplies on as many threads, in ATen's pool; its pthread
/// build, whose own pool would fight ATen's for the cores, is held to one thread.
int set_threads(int64_t requested);
/// The BLAS behind ATen's CPU matrix multiplies and how it threads, e.g. "OpenBLAS 0.3.21
/// DYNAMIC_ARCH NO_AFFINITY Zen MAX_THREADS=64 (OpenMP: ATen's thread pool)"; part of what a
/// measured time depends on.
std::string blas_name();

/// Best sustained FLOP/s of a float `dtype` matmul on `device` with every thread this process
/// has (also where the BLAS is otherwise held to one), measured over shapes like the model's
/// GEMMs (rows, at most 16384, x k x n); takes about half a second.
double measure_matmul_flops(at::Device device, at::ScalarType dtype, int64_t rows, int64_t k, int64_t n);

/// Bytes this process could still allocate on `device`: the GPU's free memory (CUDA); on
/// the CPU the kernel's MemAvailable, or less where the process's cgroup allows less. -1
/// where neither can be read.
int64_t memory_available(at::Device device);

/// Waits for the device's queued work (CUDA); no-op on CPU.
void synchronize(at::Device device);

/// The median of `v` (the upper one of an even count); 0 when empty.
double median(std::vector<double> v);

}  // namespace remat
