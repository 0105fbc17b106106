// The OpenBLAS that serves ATen's CPU matrix multiplies, looked up among the loaded
// libraries (ATen's BLAS may be another: MKL, its own kernels), and how remat threads it.
#pragma once

namespace remat::util {

/// OpenBLAS's threading, as openblas_get_parallel() reports it.
enum class BlasThreading { none = 0, pthreads = 1, openmp = 2 };

/// OpenBLAS's entry points; null where ATen's BLAS is not OpenBLAS.
struct OpenBlas {
  void (*set_threads)(int) = nullptr;
  int (*get_threads)() = nullptr;
  int (*parallel)() = nullptr;
  char* (*config)() = nullptr;
  BlasThreading threading() const { return parallel ? static_cast<BlasThreading>(parallel()) : BlasThreading::none; }
};
const OpenBlas& openblas();

/// Holds OpenBLAS to one thread while it lives, for a kernel that calls it from inside its
/// own parallel region (ATen's fused attention: each thread multiplies its own blocks).
/// There OpenBLAS 0.3.34's OpenMP build, given more threads, starts a team per call and
/// hangs. Nested holders (ranks that are threads of one process) restore the count once,
/// when the last one ends; the OpenMP build gets at most ATen's thread count back. No-op
/// where ATen's BLAS is not OpenBLAS.
class SerialBlas {
 public:
  SerialBlas();
  ~SerialBlas();
  SerialBlas(const SerialBlas&) = delete;
  SerialBlas& operator=(const SerialBlas&) = delete;
};

}  // namespace remat::util
