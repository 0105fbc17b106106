// How a job of ranks tells a rank that stopped early from one that is lost.
#include "dist/ranks.h"
#include "util/gloo_ranks.h"

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace remat {
namespace {

// A rank that finished the run stops beating like a lost one; a rank still waiting for it
// must say that the ranks took different paths (different settings or files, or a bug that
// made them disagree on a key), not send the user looking for a crash that never happened.
// Seen: ranks naming different profile files waited for each other, blamed as lost.
TEST(Comm, ARankStillWaitingForOneThatFinishedSaysTheRanksDiverged) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> errors =
      testing::gloo_rank_errors(2, 1, 1, std::chrono::seconds(30), [&](dist::Comm& comm) {
        if (comm.rank() == 1) comm.await("posted by nobody", "the test's wait for a key rank 0 never posts");
      });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("rank 0 finished the run while rank 1 still waited in the test's "
                                                  "wait for a key rank 0 never posts (no heartbeat): the ranks took "
                                                  "different paths"),
              std::string::npos)
        << "rank " << r << ": " << errors[static_cast<size_t>(r)];
  }
  // A few missed heartbeats, well before the 30 s timeout.
  EXPECT_LT(seconds, 15.0);
}

// Rank 0 failing in work the others wait for (rank0_first: preparing the corpus, measuring
// the profile) ends every rank with its sentence, a rank that looks only after rank 0 threw
// too: rank 0's store closes with it. Seen: rank 1 said only "error: Broken pipe", and the
// launcher stopped rank 0 before it said why.
TEST(Comm, RankZerosFailureInWorkTheOthersAwaitReachesThemAsItsSentence) {
  const std::vector<std::string> errors =
      testing::gloo_rank_errors(2, 1, 1, std::chrono::seconds(30), [&](dist::Comm& comm) {
        if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
        rank0_first(&comm, "the test's work", [] { throw std::runtime_error("The work failed."); });
      });
  EXPECT_EQ(errors[0], "The work failed.");
  EXPECT_EQ(errors[1], "Rank 0 failed in the test's work: The work failed.");
}

// Ranks that sample together stop at the same token: each caught its own signal (or none)
// and all act on the highest any caught; with none caught they go on; a rank alone keeps
// its own.
TEST(Comm, RanksAgreeOnTheSignalThatStopsThem) {
  const int caught[] = {0, SIGTERM, SIGINT};
  testing::on_gloo_ranks(3, 1, [&](dist::Comm& comm) {
    EXPECT_EQ(agreed_signal(&comm.world(), caught[comm.rank()]), SIGTERM) << "rank " << comm.rank();
    EXPECT_EQ(agreed_signal(&comm.world(), 0), 0) << "rank " << comm.rank();
  });
  EXPECT_EQ(agreed_signal(nullptr, SIGHUP), SIGHUP);
}

}  // namespace
}  // namespace remat
