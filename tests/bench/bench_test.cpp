// The sweep's pieces that need no training: entries from the option lists, the refusal of
// an unknown key or of an entry regrouping the ranks, and the table's ratios and per-rank
// peaks (fixed rows, so no timing is asserted).
#include "remat/bench.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace remat {
namespace {

TEST(Bench, EntriesSetThePolicyOrTheBudget) {
  const auto entries = bench_entries({"none", "ops:[matmul,attention]"}, {"96MiB"});
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[1].label, "ops:[matmul,attention]");
  EXPECT_EQ(entries[1].overrides, std::vector<std::string>{"ac.policy=ops:[matmul,attention]"});
  EXPECT_EQ(entries[2].label, "budget=96MiB");
  EXPECT_EQ(entries[2].overrides, std::vector<std::string>{"ac.budget=96MiB"});
}

TEST(Bench, AnUnknownKeyIsNamedAsSuchWithItsEntry) {
  BenchOptions o;
  o.entries = {{"odd", {"ac.no_such_key=1"}}};
  try {
    run_bench(o);
    FAIL() << "an unknown key ran";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("Bench entry 'odd' sets ac.no_such_key, which is an unknown config key"),
              std::string::npos)
        << e.what();
  }
}

TEST(Bench, AnEntryCannotRegroupTheRanks) {
  BenchOptions o;
  o.entries = {{"none", {"ac.policy=none"}}, {"split", {"ac.policy=none", "parallel.tp=2"}}};
  try {
    run_bench(o);
    FAIL() << "an entry set parallel.tp";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("Bench entry 'split' sets parallel.tp, but every entry of a sweep runs on "
                                         "the same ranks, joined once; set parallel.tp for the whole sweep"),
              std::string::npos)
        << e.what();
  }
}

BenchRow row(const std::string& name, int64_t peak, double seconds) {
  BenchRow r;
  r.entry = r.policy = name;
  r.peak_bytes = peak;
  r.median_step_seconds = seconds;
  r.tokens_per_second = 2048 / seconds;
  return r;
}

TEST(Bench, TableRatiosAreToNoneOrElseToTheFirstEntry) {
  BenchResult with_none;
  with_none.rows = {row("full", 50 << 20, 0.3), row("none", 100 << 20, 0.2)};
  with_none.reference = 1;
  const std::string a = format_bench_table(with_none);
  EXPECT_NE(a.find("x none"), std::string::npos) << a;
  EXPECT_NE(a.find("0.50"), std::string::npos) << a;  // full's peak over none's
  EXPECT_NE(a.find("1.50"), std::string::npos) << a;  // full's step over none's
  EXPECT_EQ(a.find("first"), std::string::npos) << a;

  BenchResult without;
  without.rows = {row("every:2", 80 << 20, 0.25), row("full", 40 << 20, 0.3)};
  const std::string b = format_bench_table(without);
  EXPECT_EQ(b.rfind("ratios are to the first entry, every:2", 0), 0u) << b;
  EXPECT_NE(b.find("x first"), std::string::npos) << b;
  EXPECT_NE(b.find("1.20"), std::string::npos) << b;
}

TEST(Bench, TableGivesEveryRanksPeakBesideThePrediction) {
  BenchResult two;
  two.rows = {row("none", 100 << 20, 0.2), row("full", 50 << 20, 0.3)};
  two.rows[0].rank_peak_bytes = {100 << 20, 99 << 20};
  two.rows[0].predicted_peak_bytes = 100 << 20;
  two.rows[0].predicted_rank_peak_bytes = {100 << 20, 100 << 20};
  const std::string t = format_bench_table(two);
  EXPECT_NE(t.find("\nnone peaks per rank: rank 0 100.00 MiB, rank 1 99.00 MiB (each predicted 100.00 MiB)\n"),
            std::string::npos)
      << t;
  EXPECT_EQ(t.find("full peaks"), std::string::npos) << "one process's row has no line: " << t;
  // Pipeline stages: each rank beside its own stage's prediction.
  two.rows[0].predicted_rank_peak_bytes = {101 << 20, 98 << 20};
  EXPECT_NE(format_bench_table(two).find("\nnone peaks per rank: rank 0 100.00 MiB (predicted 101.00 MiB), rank 1 "
                                         "99.00 MiB (predicted 98.00 MiB)\n"),
            std::string::npos)
      << format_bench_table(two);
}

TEST(Bench, TableGivesTheCudaAllocatorsPeaksBesideItsModel) {
  BenchResult run;
  run.rows = {row("none", 100 << 20, 0.2), row("full", 50 << 20, 0.3)};
  run.rows[1].reserved_peak_bytes = 62 << 20;
  run.rows[1].predicted_cuda_allocated_bytes = 51 << 20;
  run.rows[1].predicted_cuda_reserved_bytes = 60 << 20;
  const std::string t = format_bench_table(run);
  EXPECT_NE(t.find("\nfull on CUDA: allocated 50.00 MiB (model 51.00 MiB), reserved 62.00 MiB (model 60.00 MiB)\n"),
            std::string::npos)
      << t;
  EXPECT_EQ(t.find("none on CUDA"), std::string::npos) << "a row without the model's figures (CPU) has no line: " << t;
}

TEST(Bench, OnCudaABudgetHoldsTheReservedPeak) {
  const auto on_cuda = [](BenchRow r, int64_t reserved) {
    r.reserved_peak_bytes = reserved;
    r.predicted_cuda_allocated_bytes = r.peak_bytes;
    r.predicted_cuda_reserved_bytes = reserved;
    return r;
  };
  BenchResult run;
  // full's allocated peak fits 64 MiB but its reserved one does not; every:2 fits both.
  run.rows = {on_cuda(row("full", 50 << 20, 0.3), 70 << 20), on_cuda(row("every:2", 60 << 20, 0.4), 64 << 20),
              on_cuda(row("budget=64MiB", 55 << 20, 0.2), 66 << 20)};
  run.rows[2].budget_bytes = 64 << 20;
  const std::string t = format_bench_table(run);
  EXPECT_NE(t.find("\nbudget=64MiB (64.00 MiB): reserved peak OVER the budget; 0.50x the step time of every:2, the "
                   "fastest manual policy that fits\n"),
            std::string::npos)
      << t;
}

}  // namespace
}  // namespace remat
