// How a job of ranks tells a rank that stopped early from one that is lost.
#include "dist/ranks.h"
#include "util/gloo_ranks.h"

#include <fmt/format.h>

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

// A rank that starts before rank 0 finds no store listening yet: it waits for it and joins,
// and the two then reduce together; one whose rank 0 never comes says so once its timeout
// has passed, not twice it.
TEST(Comm, ARankStartedBeforeRankZerosStoreJoinsIt) {
  dist::LaunchEnv env;
  env.world_size = 2;
  env.master_port = cli::free_port();
  std::vector<double> sums(2, 0.0);
  std::vector<std::string> errors(2);
  const auto rank = [&](int r) {
    try {
      dist::LaunchEnv mine = env;
      mine.rank = r;
      auto comm = dist::Comm::connect(mine, std::chrono::seconds(30), 1, 1);
      std::vector<at::Tensor> t{at::full({1}, static_cast<double>(r + 1), at::kDouble)};
      comm->world().all_reduce(t, dist::Reduce::sum, "the test's sum");
      sums[static_cast<size_t>(r)] = t[0].item<double>();
      comm->finish();
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  };
  std::thread early(rank, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::thread late(rank, 0);
  early.join();
  late.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(sums[static_cast<size_t>(r)], 3.0) << "rank " << r;
  }

  env.rank = 1;
  const auto start = std::chrono::steady_clock::now();
  try {
    dist::Comm::connect(env, std::chrono::seconds(1), 1, 1);
    ADD_FAILURE() << "a rank joined a store nobody hosts";
  } catch (const std::exception& e) {
    const std::string text = e.what();
    EXPECT_EQ(text.rfind(fmt::format("Rank 1 could not reach the rendezvous store at 127.0.0.1:{} within "
                                     "parallel.timeout = 1 s (every connection was refused: nothing listens there)",
                                     env.master_port),
                         0),
              0u)
        << text;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.9);
}

}  // namespace
}  // namespace remat
