#include "util/openblas.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>

#include <algorithm>

#include <mutex>

namespace remat::util {

const OpenBlas& openblas() {
  static const OpenBlas blas = [] {
    OpenBlas b;
    b.set_threads = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    b.get_threads = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
    b.parallel = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
    b.config = reinterpret_cast<char* (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
    return b;
  }();
  return blas;
}

namespace {

// The holders alive and the thread count the first of them found.
struct Held {
  std::mutex mutex;
  int holders = 0;
  int threads = 1;
};
Held& held() {
  static Held h;
  return h;
}

}  // namespace

SerialBlas::SerialBlas() {
  const OpenBlas& b = openblas();
  if (b.set_threads == nullptr || b.get_threads == nullptr) return;
  Held& h = held();
  const std::lock_guard<std::mutex> lock(h.mutex);
  if (h.holders++ > 0) return;
  // The OpenMP build must not be given more threads than ATen's pool has: its level-3 kernels
  // split work for that many and wait for each share, so a smaller team never finishes.
  h.threads =
      b.threading() == BlasThreading::openmp ? std::min(b.get_threads(), at::get_num_threads()) : b.get_threads();
  b.set_threads(1);
}

SerialBlas::~SerialBlas() {
  const OpenBlas& b = openblas();
  if (b.set_threads == nullptr || b.get_threads == nullptr) return;
  Held& h = held();
  const std::lock_guard<std::mutex> lock(h.mutex);
  if (--h.holders == 0) b.set_threads(h.threads);
}

}  // namespace remat::util
