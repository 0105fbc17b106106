#include "remat/caching_allocator.h"
#include "util/paths.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using remat::memory::AllocationTraceEntry;
using remat::memory::AllocatorEvent;
using remat::memory::AllocatorRules;
using remat::memory::AllocatorState;
using remat::memory::CachingAllocatorModel;

constexpr int64_t KiB = int64_t{1} << 10;
constexpr int64_t MiB = int64_t{1} << 20;
constexpr AllocatorRules kExpandable{.expandable_segments = true};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A request's size as the allocator rounds it (0 takes no block).
int64_t rounded(int64_t bytes) { return bytes == 0 ? 0 : (std::max<int64_t>(bytes, 512) + 511) / 512 * 512; }

TEST(CachingAllocatorModel, RoundsRequestsUpToMultiplesOfFiveHundredTwelveBytes) {
  CachingAllocatorModel m;
  m.malloc(1, 1);  // 1 B -> 512 B
  EXPECT_EQ(m.allocated(), 512);
  m.malloc(2, 513);  // 513 B -> 1024 B
  EXPECT_EQ(m.block_bytes(2), 1024);
  m.malloc(3, 1024);  // already a multiple: 1024 B
  EXPECT_EQ(m.allocated(), 512 + 1024 + 1024);
  m.malloc(4, 0);  // no block: PyTorch hands out a null pointer
  EXPECT_EQ(m.block_bytes(4), 0);
  EXPECT_EQ(m.state(), (AllocatorState{2560, 2 * MiB}));
  m.free(4);
  EXPECT_EQ(m.allocated(), 2560);
}

TEST(CachingAllocatorModel, SmallRequestsShareATwoMebibyteSegment) {
  CachingAllocatorModel m;
  m.malloc(1, MiB);  // small (<= 1 MiB): a 2 MiB segment
  EXPECT_EQ(m.state(), (AllocatorState{MiB, 2 * MiB}));
  m.malloc(2, MiB);  // the segment's other half
  EXPECT_EQ(m.state(), (AllocatorState{2 * MiB, 2 * MiB}));
  m.malloc(3, 512);  // full: a second 2 MiB segment
  EXPECT_EQ(m.state(), (AllocatorState{2 * MiB + 512, 4 * MiB}));
}

TEST(CachingAllocatorModel, RequestsUnderTenMebibytesGetATwentyMebibyteSegment) {
  CachingAllocatorModel m;
  m.malloc(1, MiB + 1);  // 1 MiB + 512 B: large pool, under 10 MiB -> 20 MiB segment
  EXPECT_EQ(m.state(), (AllocatorState{MiB + 512, 20 * MiB}));
  m.malloc(2, 9 * MiB);  // fits the 19 MiB - 512 B rest
  EXPECT_EQ(m.state(), (AllocatorState{10 * MiB + 512, 20 * MiB}));
  m.malloc(3, 10 * MiB);  // the 10 MiB - 512 B rest is too small; 10 MiB is a 2 MiB multiple
  EXPECT_EQ(m.state(), (AllocatorState{20 * MiB + 512, 30 * MiB}));
}

TEST(CachingAllocatorModel, LargerRequestsGetASegmentRoundedUpToTwoMebibytes) {
  CachingAllocatorModel m;
  m.malloc(1, 10 * MiB + 1);  // 10 MiB + 512 B -> a 12 MiB segment, split (rest 2 MiB - 512 B)
  EXPECT_EQ(m.state(), (AllocatorState{10 * MiB + 512, 12 * MiB}));
  m.malloc(2, 64 * MiB);  // a 64 MiB segment of its own
  EXPECT_EQ(m.state(), (AllocatorState{74 * MiB + 512, 76 * MiB}));
}

TEST(CachingAllocatorModel, BestFitTakesTheSmallestFreeBlockAndTiesGoToTheLowerAddress) {
  CachingAllocatorModel m;
  m.malloc(1, 16 * MiB);  // a 16 MiB segment
  m.malloc(2, 12 * MiB);  // a 12 MiB segment
  m.free(1);
  m.free(2);
  m.malloc(3, 11 * MiB);  // the 12 MiB block fits best; its 1 MiB rest is not split off
  EXPECT_EQ(m.state(), (AllocatorState{12 * MiB, 28 * MiB}));

  CachingAllocatorModel ties;
  ties.malloc(1, 12 * MiB);  // segment A: 12 MiB at the lower address
  ties.malloc(2, 8 * MiB);   // segment B: 20 MiB, 12 MiB of it left free
  ties.free(1);
  ties.malloc(3, 12 * MiB);  // two free 12 MiB blocks: A's (lower) is taken
  ties.empty_cache();        // neither segment is wholly free, so both stay: 12 + 20 MiB
  EXPECT_EQ(ties.state(), (AllocatorState{20 * MiB, 32 * MiB}));
}

TEST(CachingAllocatorModel, BlocksFreedOnOneStreamAreNotReusedByAnother) {
  CachingAllocatorModel m;
  m.malloc(1, 512, /*stream=*/0);
  m.free(1);
  m.malloc(2, 512, /*stream=*/1);  // stream 0's free segment is not for stream 1
  EXPECT_EQ(m.state(), (AllocatorState{512, 4 * MiB}));
  m.malloc(3, 512, /*stream=*/0);  // stream 0 reuses its own
  EXPECT_EQ(m.state(), (AllocatorState{1024, 4 * MiB}));
}

TEST(CachingAllocatorModel, TheSmallPoolSplitsOffAnyRestOfFiveHundredTwelveBytes) {
  CachingAllocatorModel m;
  m.malloc(1, MiB);
  m.malloc(2, MiB - 512);  // rest 512 B: split off, so only the request is counted
  EXPECT_EQ(m.block_bytes(2), MiB - 512);
  m.malloc(3, 1);  // 512 B: takes the rest, no new segment
  EXPECT_EQ(m.state(), (AllocatorState{2 * MiB, 2 * MiB}));
}

TEST(CachingAllocatorModel, TheLargePoolSplitsOnlyWhenMoreThanOneMebibyteRemains) {
  CachingAllocatorModel m;
  m.malloc(1, 9 * MiB);  // 20 MiB segment, rest 11 MiB split off
  EXPECT_EQ(m.state(), (AllocatorState{9 * MiB, 20 * MiB}));
  m.malloc(2, 10 * MiB);  // rest would be exactly 1 MiB: the whole 11 MiB block is counted
  EXPECT_EQ(m.block_bytes(2), 11 * MiB);
  EXPECT_EQ(m.state(), (AllocatorState{20 * MiB, 20 * MiB}));
  m.free(2);  // and the whole block is given back
  EXPECT_EQ(m.allocated(), 9 * MiB);

  CachingAllocatorModel over;
  over.malloc(1, 9 * MiB);
  over.malloc(2, 10 * MiB - 512);  // rest 1 MiB + 512 B: split off
  EXPECT_EQ(over.block_bytes(2), 10 * MiB - 512);
  EXPECT_EQ(over.state(), (AllocatorState{19 * MiB - 512, 20 * MiB}));
}

TEST(CachingAllocatorModel, FreedBlocksMergeWithFreeNeighboursInTheirSegment) {
  CachingAllocatorModel m;
  for (int64_t id = 1; id <= 4; ++id) m.malloc(id, 512 * KiB);  // four quarters of one 2 MiB segment
  m.free(1);
  m.free(3);
  m.malloc(5, MiB);  // two free quarters that do not touch: 1 MiB fits neither, a new segment
  EXPECT_EQ(m.state(), (AllocatorState{2 * MiB, 4 * MiB}));
  m.free(2);  // merges quarters 1 to 3
  m.free(4);  // and the last: the first segment is one free block again
  m.empty_cache();
  EXPECT_EQ(m.state(), (AllocatorState{MiB, 2 * MiB}));
}

TEST(CachingAllocatorModel, SegmentsGoBackOnlyOnEmptyCacheAndOnlyWhenWhollyFree) {
  CachingAllocatorModel m;
  m.malloc(1, 12 * MiB);  // segment A: 12 MiB
  m.malloc(2, 8 * MiB);   // segment B: 20 MiB
  m.free(1);              // A is free but kept
  EXPECT_EQ(m.state(), (AllocatorState{8 * MiB, 32 * MiB}));
  m.empty_cache();  // A goes; B's free 12 MiB stays with it
  EXPECT_EQ(m.state(), (AllocatorState{8 * MiB, 20 * MiB}));
  m.free(2);
  EXPECT_EQ(m.reserved(), 20 * MiB);
  m.empty_cache();
  EXPECT_EQ(m.state(), (AllocatorState{0, 0}));
}

TEST(CachingAllocatorModel, ExpandableSegmentsGrowTheLargePoolByTwentyMebibytePages) {
  CachingAllocatorModel m(kExpandable);
  m.malloc(1, 30 * MiB);  // two 20 MiB pages mapped; the 10 MiB rest is split off
  EXPECT_EQ(m.state(), (AllocatorState{30 * MiB, 40 * MiB}));
  m.malloc(2, 5 * MiB);  // from the free end
  EXPECT_EQ(m.state(), (AllocatorState{35 * MiB, 40 * MiB}));
  m.malloc(3, 22 * MiB);  // the 5 MiB end grows by one page (17 MiB more are needed) into 25 MiB
  EXPECT_EQ(m.state(), (AllocatorState{57 * MiB, 60 * MiB}));
  m.malloc(4, 2 * MiB);  // fits the 3 MiB end
  EXPECT_EQ(m.state(), (AllocatorState{59 * MiB, 60 * MiB}));
}

TEST(CachingAllocatorModel, ExpandableSegmentsSplitLargeBlocksLikeTheSmallPool) {
  CachingAllocatorModel m(kExpandable);
  m.malloc(1, 19 * MiB + 512 * KiB);  // one page; the 512 KiB rest is split off
  EXPECT_EQ(m.state(), (AllocatorState{19 * MiB + 512 * KiB, 20 * MiB}));
  CachingAllocatorModel fixed;
  fixed.malloc(1, 19 * MiB + 512 * KiB);  // a 20 MiB segment handed out whole
  EXPECT_EQ(fixed.state(), (AllocatorState{20 * MiB, 20 * MiB}));
}

TEST(CachingAllocatorModel, ExpandableSegmentsGrowTheSmallPoolByTwoMebibytePages) {
  CachingAllocatorModel m(kExpandable);
  CachingAllocatorModel fixed;
  m.malloc(1, 768 * KiB);
  EXPECT_EQ(m.reserved(), 2 * MiB);  // one small page, not a 20 MiB one
  fixed.malloc(1, 768 * KiB);
  for (int64_t id = 2; id <= 5; ++id) {
    m.malloc(id, 768 * KiB);
    fixed.malloc(id, 768 * KiB);
  }
  // Expandable: the 512 KiB end left by the second request grows by a page, which holds
  // the other three (5 x 768 KiB = 3.75 MiB in 4 MiB). Fixed 2 MiB segments hold two each.
  EXPECT_EQ(m.state(), (AllocatorState{3840 * KiB, 4 * MiB}));
  EXPECT_EQ(fixed.state(), (AllocatorState{3840 * KiB, 6 * MiB}));
}

TEST(CachingAllocatorModel, ExpandableSegmentsUseTheirFreeEndOnlyWhenNoInnerBlockFits) {
  CachingAllocatorModel m(kExpandable);
  m.malloc(1, 6 * MiB);  // [0, 6) of one 20 MiB page
  m.malloc(2, 2 * MiB);  // [6, 8)
  m.malloc(3, 8 * MiB);  // [8, 16); the free end is [16, 20)
  m.free(1);             // [0, 6) free inside the segment
  m.malloc(4, 4 * MiB);  // the 4 MiB end fits exactly but could grow: [0, 4) is taken instead
  EXPECT_EQ(m.state(), (AllocatorState{14 * MiB, 20 * MiB}));
  m.malloc(5, 6 * MiB);  // free are [4, 6) and the end [16, 20): the end grows by a page
  EXPECT_EQ(m.state(), (AllocatorState{20 * MiB, 40 * MiB}));
}

TEST(CachingAllocatorModel, EmptyCacheUnmapsEveryUnusedPageOfAnExpandableSegment) {
  CachingAllocatorModel m(kExpandable);
  m.malloc(1, 30 * MiB);  // [0, 30) of two pages
  m.malloc(2, 10 * MiB);  // [30, 40)
  m.free(1);
  m.empty_cache();  // page [0, 20) is unused and unmapped; [20, 30) shares a page with 2
  EXPECT_EQ(m.state(), (AllocatorState{10 * MiB, 20 * MiB}));
  m.malloc(3, 25 * MiB);  // the hole is mapped again, joining [20, 30): [0, 25)
  EXPECT_EQ(m.state(), (AllocatorState{35 * MiB, 40 * MiB}));
  m.free(2);
  m.free(3);
  m.empty_cache();  // every page unused: the segment goes
  EXPECT_EQ(m.state(), (AllocatorState{0, 0}));
  m.malloc(4, 2 * MiB);  // a fresh segment, one page
  EXPECT_EQ(m.state(), (AllocatorState{2 * MiB, 20 * MiB}));
}

TEST(CachingAllocatorModel, CublasWorkspaceIsThirtyTwoMebibytesFromHopperOn) {
  using remat::memory::cublas_workspace_bytes;
  const int64_t ampere = 4 * MiB * 2 + 16 * KiB * 8;  // ":4096:2:16:8"
  EXPECT_EQ(cublas_workspace_bytes(7, 0), ampere);
  EXPECT_EQ(cublas_workspace_bytes(8, 0), ampere);
  EXPECT_EQ(cublas_workspace_bytes(8, 9), ampere);
  EXPECT_EQ(cublas_workspace_bytes(9, 0), 32 * MiB);
  EXPECT_EQ(cublas_workspace_bytes(10, 0), 32 * MiB);
  EXPECT_EQ(cublas_workspace_bytes(12, 0), 32 * MiB);

  CachingAllocatorModel h100;
  h100.malloc(1, cublas_workspace_bytes(9, 0));  // 32 MiB: a segment of its own
  EXPECT_EQ(h100.state(), (AllocatorState{32 * MiB, 32 * MiB}));
  CachingAllocatorModel a100;
  a100.malloc(1, cublas_workspace_bytes(8, 0));  // 8 MiB + 128 KiB: a 20 MiB segment
  EXPECT_EQ(a100.state(), (AllocatorState{ampere, 20 * MiB}));
}

TEST(CachingAllocatorModel, PeaksHoldTheHighestStateUntilReset) {
  CachingAllocatorModel m;
  m.malloc(1, 12 * MiB);
  m.free(1);
  EXPECT_EQ(m.peak_allocated(), 12 * MiB);
  m.reset_peaks();  // reserved is still 12 MiB
  EXPECT_EQ(m.peak_allocated(), 0);
  EXPECT_EQ(m.peak_reserved(), 12 * MiB);
  m.empty_cache();
  EXPECT_EQ(m.peak_reserved(), 12 * MiB);
  m.reset_peaks();
  EXPECT_EQ(m.peak_reserved(), 0);
}

TEST(CachingAllocatorModel, MisuseFailsWithASentence) {
  CachingAllocatorModel m;
  EXPECT_TRUE(contains(error_of([&] { m.malloc(1, -1); }), "cannot be negative"));
  m.malloc(1, 10);
  EXPECT_TRUE(contains(error_of([&] { m.malloc(1, 10); }), "Allocation 1 is already live"));
  EXPECT_TRUE(contains(error_of([&] { m.free(2); }), "Free of allocation 2, which is not live"));
  m.free(1);
  EXPECT_TRUE(contains(error_of([&] { m.free(1); }), "Free of allocation 1, which is not live"));
}

TEST(CachingAllocatorModel, RandomSequencesKeepTheInvariants) {
  for (const AllocatorRules rules : {AllocatorRules{}, kExpandable}) {
    std::mt19937 rng(20240611);
    CachingAllocatorModel m(rules);
    std::vector<std::pair<int64_t, int64_t>> live;  // id, bytes requested
    int64_t next_id = 0;
    for (int step = 0; step < 3000; ++step) {
      const int64_t reserved_before = m.reserved();
      const unsigned choice = rng() % 20;
      if (choice < 10 || live.empty()) {
        const int64_t limit[] = {0, MiB, 10 * MiB, 48 * MiB};  // none, small, mid, large
        const int64_t bytes = static_cast<int64_t>(rng() % (limit[rng() % 4] + 1));
        m.malloc(next_id, bytes, static_cast<int>(rng() % 3));
        live.emplace_back(next_id++, bytes);
      } else if (choice < 19) {
        const size_t i = rng() % live.size();
        m.free(live[i].first);
        live[i] = live.back();
        live.pop_back();
      } else {
        m.empty_cache();
      }
      if (choice != 19) {
        ASSERT_GE(m.reserved(), reserved_before) << "step " << step;
      }
      int64_t blocks = 0;
      for (const auto& [id, bytes] : live) {
        const int64_t block = m.block_bytes(id);
        // A large block handed out whole keeps a rest of at most 1 MiB.
        const int64_t slack = rounded(bytes) > MiB && !rules.expandable_segments ? MiB : 0;
        ASSERT_GE(block, rounded(bytes));
        ASSERT_LE(block, rounded(bytes) + slack);
        blocks += block;
      }
      ASSERT_EQ(m.allocated(), blocks) << "step " << step;
      ASSERT_LE(m.allocated(), m.reserved()) << "step " << step;
      ASSERT_GE(m.peak_reserved(), m.reserved());
    }
    for (const auto& [id, bytes] : live) m.free(id);
    m.empty_cache();
    EXPECT_EQ(m.state(), (AllocatorState{0, 0}));
  }
}

TEST(CachingAllocatorModel, TracesRoundTripAndReplayToTheirRecordedStates) {
  using Kind = AllocatorEvent::Kind;
  const std::vector<AllocatorEvent> events = {
      {Kind::malloc, 1, 1000, 0}, {Kind::malloc, 2, 12 * MiB, 1}, {Kind::malloc, 3, 0, 0},
      {Kind::free, 1, 0, 0},      {Kind::malloc, 4, 3 * MiB, 0},  {Kind::free, 2, 0, 1},
  };
  for (const AllocatorRules rules : {AllocatorRules{}, kExpandable}) {
    const std::vector<AllocatorState> states = remat::memory::replay(events, rules);
    std::vector<AllocationTraceEntry> entries;
    for (size_t i = 0; i < events.size(); ++i) entries.push_back({events[i], states[i]});
    std::stringstream text;
    remat::memory::write_allocation_trace(text, entries);
    const std::vector<AllocationTraceEntry> read = remat::memory::read_allocation_trace(text);
    EXPECT_EQ(read, entries);
  }

  // As a GPU would record it; by the rules 1000 B rounds to 1024 B in a 2 MiB segment and
  // 4 MiB takes a 20 MiB one.
  std::istringstream recorded(
      "# recorded trace\n"
      "malloc 1 1000 0 1024 2097152\n"
      "\n"
      "malloc 2 4194304 0 4195328 23068672\n"
      "free 1 0 0 4194304 23068672\n");
  const std::vector<AllocationTraceEntry> trace = remat::memory::read_allocation_trace(recorded);
  ASSERT_EQ(trace.size(), 3u);
  std::vector<AllocatorEvent> trace_events;
  std::vector<AllocatorState> trace_states;
  for (const auto& [e, state] : trace) {
    trace_events.push_back(e);
    trace_states.push_back(state);
  }
  EXPECT_EQ(remat::memory::replay(trace_events), trace_states);
}

TEST(CachingAllocatorModel, BadTraceLinesFailNamingTheLineAndWhatWasExpected) {
  const std::pair<std::string, std::string> cases[] = {
      {"malloc 1 512 0 512\n", "line 1: expected 6 fields"},
      {"# header\n\nalloc 1 512 0 512 2097152\n", "line 3: expected `malloc` or `free` as the kind, found `alloc`"},
      {"malloc 1 12x 0 512 2097152\n", "line 1: expected an integer for the bytes, found `12x`"},
      {"malloc 1 512 0 512 2097152\nfree 1 512 0 0 2097152\n", "line 2: expected 0 bytes for a free"},
      {"malloc 1 -512 0 0 0\n", "line 1: expected bytes of 0 or more"},
      {"malloc 1 512 0 -1 0\n", "line 1: expected allocated and reserved bytes of 0 or more"},
  };
  for (const auto& [text, expected] : cases) {
    const std::string error = error_of([&] {
      std::istringstream in(text);
      remat::memory::read_allocation_trace(in);
    });
    EXPECT_TRUE(contains(error, expected)) << "for " << text << "got: " << error;
  }
}

// The traces recorded on GPUs (scripts/gpu-check.sh, `remat train --record-allocations`),
// each replayed from an empty allocator under the setting its first line names: the
// model must give the real allocator's bytes after every event.
TEST(CachingAllocatorModel, ReplaysEveryTraceRecordedOnAGpuExactly) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(remat::testing::kSourceDir) / "tests" / "memory" / "traces";
  std::vector<fs::path> traces;
  if (fs::is_directory(dir)) {
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() == ".txt") traces.push_back(e.path());
    }
  }
  if (traces.empty()) GTEST_SKIP() << "no trace recorded on a GPU in " << dir << " yet";
  for (const fs::path& path : traces) {
    std::ifstream in(path);
    std::string first;
    std::getline(in, first);
    in.seekg(0);
    AllocatorRules rules;
    rules.expandable_segments = contains(first, "expandable_segments on");
    const auto entries = remat::memory::read_allocation_trace(in);
    std::vector<AllocatorEvent> events;
    for (const auto& e : entries) events.push_back(e.event);
    const auto states = remat::memory::replay(events, rules);
    size_t same = 0;
    while (same < entries.size() && states[same] == entries[same].state) ++same;
    EXPECT_EQ(same, entries.size()) << path.filename() << ": event " << same + 1 << " of " << entries.size()
                                    << " is the first the model replays differently (recorded allocated "
                                    << entries[std::min(same, entries.size() - 1)].state.allocated << ", reserved "
                                    << entries[std::min(same, entries.size() - 1)].state.reserved << "; model "
                                    << states[std::min(same, entries.size() - 1)].allocated << ", "
                                    << states[std::min(same, entries.size() - 1)].reserved << ")";
  }
}

}  // namespace
