#include "remat/memory.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <thread>

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
    at::Tensor y = at::gelu(at::randn({64, 64}, at::detail::createCPUGenerator(1)));
    EXPECT_EQ(y.sizes(), at::IntArrayRef({64, 64}));
  }
  EXPECT_EQ(remat::memory::stats(cpu).current, before);
}

TEST(RecomputePool, ReusesBuffersOfTheSameSizeInsideScopesOnly) {
  remat::memory::install_cpu_tracking();
  remat::memory::release_pool();
  const at::Device cpu(at::kCPU);
  remat::memory::reset_peak(cpu);
  const int64_t before = remat::memory::stats(cpu).current;
  { at::Tensor room = at::empty({4 << 20}, at::kByte); }  // a peak the pool may keep buffers under
  remat::memory::PoolCounts counts;
  void* first = nullptr;
  {
    const remat::memory::RecomputeScope scope(counts);
    first = at::empty({1024, 256}, at::kFloat).data_ptr();  // freed at once: idle, still held
  }
  EXPECT_EQ(remat::memory::stats(cpu).pool_idle, 1 << 20);
  EXPECT_EQ(remat::memory::stats(cpu).current - before, 1 << 20);
  {
    at::Tensor outside = at::empty({1024, 256}, at::kFloat);  // not a recompute: not pooled
    EXPECT_NE(outside.data_ptr(), first);
  }
  {
    const remat::memory::RecomputeScope scope(counts);
    at::Tensor other_size = at::empty({512, 256}, at::kFloat);
    at::Tensor same_size = at::empty({256, 1024}, at::kFloat);
    EXPECT_EQ(same_size.data_ptr(), first);
  }
  EXPECT_EQ(counts.hits, 1);
  EXPECT_EQ(counts.misses, 2);
  EXPECT_EQ(counts.bytes_served, 1 << 20);
  EXPECT_EQ(remat::memory::stats(cpu).pool_idle, (1 << 20) + (1 << 19));
  remat::memory::release_pool();
  EXPECT_EQ(remat::memory::stats(cpu).pool_idle, 0);
  EXPECT_EQ(remat::memory::stats(cpu).current, before);
}

TEST(RecomputePool, BuffersReturnWhenFreedOnAnyThreadAndLeaveOnRelease) {
  remat::memory::install_cpu_tracking();
  remat::memory::release_pool();
  const at::Device cpu(at::kCPU);
  const int64_t before = remat::memory::stats(cpu).current;
  remat::memory::PoolCounts counts;
  at::Tensor a, b;
  {
    const remat::memory::RecomputeScope scope(counts);
    a = at::empty({4096}, at::kFloat);
    b = at::empty({4096}, at::kFloat);
  }
  std::thread([t = std::move(a)]() mutable { t.reset(); }).join();
  EXPECT_EQ(remat::memory::stats(cpu).pool_idle, 16384);
  remat::memory::release_pool();
  EXPECT_EQ(remat::memory::stats(cpu).current - before, 16384);  // b, still in use
  b.reset();                                                     // released before it was freed: it goes to the system
  EXPECT_EQ(remat::memory::stats(cpu).pool_idle, 0);
  EXPECT_EQ(remat::memory::stats(cpu).current, before);
}

TEST(RecomputePool, IdleBuffersNeverRaiseThePeak) {
  remat::memory::install_cpu_tracking();
  remat::memory::release_pool();
  const at::Device cpu(at::kCPU);
  remat::memory::reset_peak(cpu);
  const int64_t before = remat::memory::stats(cpu).current;
  remat::memory::PoolCounts counts;
  {
    const remat::memory::RecomputeScope scope(counts);
    at::Tensor a = at::empty({1 << 18}, at::kFloat);
    at::Tensor b = at::empty({1 << 18}, at::kFloat);
  }
  EXPECT_EQ(remat::memory::stats(cpu).peak - before, 2 << 20);
  {
    // 2 MiB idle plus 1 MiB new would exceed the 2 MiB peak: one idle buffer, the
    // smallest that covers the excess, goes back to the system; the other stays.
    at::Tensor c = at::empty({1 << 18}, at::kFloat);
    EXPECT_EQ(remat::memory::stats(cpu).pool_idle, 1 << 20);
    EXPECT_EQ(remat::memory::stats(cpu).peak - before, 2 << 20);
    at::Tensor d = at::empty({1 << 10}, at::kFloat);  // over again: the last one goes too
    EXPECT_EQ(remat::memory::stats(cpu).pool_idle, 0);
    EXPECT_EQ(remat::memory::stats(cpu).peak - before, 2 << 20);
  }
  {
    const remat::memory::RecomputeScope scope(counts);
    at::Tensor e = at::empty({1 << 18}, at::kFloat);  // all was given back: a miss
  }
  EXPECT_EQ(counts.hits, 0);
  EXPECT_EQ(counts.misses, 3);
  remat::memory::release_pool();
  EXPECT_EQ(remat::memory::stats(cpu).current, before);
}

TEST(FormatBytes, UsesBinaryUnits) {
  EXPECT_EQ(remat::memory::format_bytes(512), "512 B");
  EXPECT_EQ(remat::memory::format_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
}

}  // namespace
