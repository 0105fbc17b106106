// Device selection, thread count and the machine's measured matmul rate.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace remat {

/// "cpu", "cuda" or "cuda:N" -> a device that exists here; a sentence otherwise.
at::Device parse_device(const std::string& spec);
/// "float32" / "bfloat16" -> dtype, refusing bfloat16 where the device lacks it.
at::ScalarType parse_dtype(const std::string& name, at::Device device);
/// Sets the intra-op thread count (0: all cores) and returns the count in effect. An OpenBLAS
/// backend is set to one thread: ATen's intra-op pool is the only one that uses the cores.
int set_threads(int64_t requested);

/// Best sustained FLOP/s of a float `dtype` matmul on `device`, measured over shapes
/// like the model's GEMMs (rows x k x n); takes about half a second.
double measure_matmul_flops(at::Device device, at::ScalarType dtype, int64_t rows, int64_t k, int64_t n);

/// Waits for the device's queued work (CUDA); no-op on CPU.
void synchronize(at::Device device);

}  // namespace remat
