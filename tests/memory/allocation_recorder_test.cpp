// The allocation recorder: what LibTorch's allocators report on the recording thread, each
// event with the totals after it, as a trace the caching allocator's model can read.
#include "remat/caching_allocator.h"
#include "remat/memory.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>
#include <thread>

namespace remat {
namespace {

using memory::AllocatorEvent;

TEST(AllocationRecorder, RecordsTheThreadsAllocationsWithTheTotalsAfterEach) {
  const at::Tensor before = at::empty({500});
  memory::AllocationRecorder recorder(at::kCPU);
  at::Tensor a = at::empty({1000});  // 4000 bytes
  at::Tensor b = at::empty({3000});  // 12000 bytes
  a.reset();
  std::thread([] { at::empty({2000}); }).join();  // another thread's: not recorded
  at::Tensor(before).reset();                     // a handle of a tensor older than the recorder
  const auto entries = recorder.entries();
  ASSERT_EQ(entries.size(), 3U);
  EXPECT_EQ(entries[0].event, (AllocatorEvent{AllocatorEvent::Kind::malloc, 0, 4000, 0}));
  EXPECT_EQ(entries[1].event, (AllocatorEvent{AllocatorEvent::Kind::malloc, 1, 12000, 0}));
  EXPECT_EQ(entries[2].event, (AllocatorEvent{AllocatorEvent::Kind::free, 0, 0, 0}));
  // The CPU allocator has no pool: it reports what it hands out, and reserves nothing.
  EXPECT_EQ(entries[1].state.allocated - entries[0].state.allocated, 12000);
  EXPECT_EQ(entries[2].state.allocated - entries[1].state.allocated, -4000);
  for (const auto& e : entries) EXPECT_EQ(e.state.reserved, 0);
}

TEST(AllocationRecorder, AFreeOfAnOlderTensorIsLeftOut) {
  at::Tensor old = at::empty({100});
  memory::AllocationRecorder recorder(at::kCPU);
  old.reset();
  EXPECT_TRUE(recorder.entries().empty());
}

TEST(AllocationRecorder, ItsEntriesAreATraceThatReadsBack) {
  memory::AllocationRecorder recorder(at::kCPU);
  {
    const at::Tensor x = at::randn({64, 32});
    const at::Tensor y = at::matmul(x, x.t());
  }
  const auto entries = recorder.entries();
  ASSERT_GE(entries.size(), 4U);
  std::stringstream text;
  memory::write_allocation_trace(text, entries);
  EXPECT_EQ(memory::read_allocation_trace(text), entries);
}

}  // namespace
}  // namespace remat
