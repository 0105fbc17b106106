// Random test inputs drawn from a generator of the test's own.
#pragma once

#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>

namespace remat::testing {

/// A CPU generator seeded with `seed`. Drawing a test's inputs from it instead of the
/// global generator makes them the same whether the test runs alone, repeated, shuffled
/// or after any other test, so a tolerance that holds once holds every time.
inline at::Generator seeded(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

}  // namespace remat::testing
