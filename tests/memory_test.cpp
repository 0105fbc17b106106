#include "remat/memory.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

namespace {

TEST(TrackingAllocator, CountsTensorBytesAndPeak) {
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  remat::memory::reset_peak(cpu);
  const int64_t before = remat::memory::stats(cpu).current;
  {
    at::Tensor a = at::empty({1024, 256}, at::kFloat);  // 1 MiB
    EXPECT_EQ(remat::memory::stats(cpu).current - before, 1 << 20);
    at::Tensor b = at::empty({512, 256}, at::kFloat);  // 0.5 MiB
    EXPECT_EQ(remat::memory::stats(cpu).current - before, (1 << 20) + (1 << 19));
  }
  EXPECT_EQ(remat::memory::stats(cpu).current, before);
  EXPECT_EQ(remat::memory::stats(cpu).peak - before, (1 << 20) + (1 << 19));
  remat::memory::reset_peak(cpu);
  EXPECT_EQ(remat::memory::stats(cpu).peak, before);
}

TEST(TrackingAllocator, RawAllocateRoundTrips) {
  // oneDNN allocates its scratch memory this way (e.g. inside gelu on CPU).
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  c10::Allocator* allocator = c10::GetCPUAllocator();
  const int64_t before = remat::memory::stats(cpu).current;
  void* p = allocator->raw_allocate(4096);
  EXPECT_EQ(remat::memory::stats(cpu).current - before, 4096);
  allocator->raw_deallocate(p);
  EXPECT_EQ(remat::memory::stats(cpu).current, before);
  void* empty = allocator->raw_allocate(0);
  allocator->raw_deallocate(empty);
  {
    at::Tensor y = at::gelu(at::randn({64, 64}));
    EXPECT_EQ(y.sizes(), at::IntArrayRef({64, 64}));
  }
  EXPECT_EQ(remat::memory::stats(cpu).current, before);
}

TEST(FormatBytes, UsesBinaryUnits) {
  EXPECT_EQ(remat::memory::format_bytes(512), "512 B");
  EXPECT_EQ(remat::memory::format_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
}

}  // namespace
