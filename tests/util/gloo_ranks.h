// Ranks as threads of one test process joined through a real c10d store and Gloo groups on
// the loopback (dist::Comm), for the code paths a LocalGroup does not reach (the trainer's
// step, checkpoints, the data-parallel reduction, transfers between pipeline stages).
#pragma once

#include "cli/launch.h"
#include "remat/dist.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace remat::testing {

/// Runs `body` on `n` ranks, one thread each, joined as one job of `pp` pipeline stages of
/// `tp`-rank tensor-parallel groups whose collectives and transfers give up after
/// `timeout`, each on `device`; each rank's error (empty when it finished), by rank.
inline std::vector<std::string> gloo_rank_errors(int n, int tp, int pp, std::chrono::milliseconds timeout,
                                                 const std::function<void(dist::Comm&)>& body,
                                                 const dist::RankDevice& device = {}) {
  const int port = cli::free_port();
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        dist::LaunchEnv env;
        env.rank = r;
        env.world_size = n;
        env.master_port = port;
        auto comm = dist::Comm::connect(env, timeout, tp, pp, device);
        body(*comm);
        comm->finish();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// Runs `body` on `n` ranks, one thread each, joined as one job of `pp` pipeline stages of
/// `tp`-rank tensor-parallel groups; each rank's error fails the test, naming the rank.
inline void on_gloo_ranks(int n, int tp, const std::function<void(dist::Comm&)>& body, int pp = 1) {
  const std::vector<std::string> errors = gloo_rank_errors(n, tp, pp, std::chrono::seconds(60), body);
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

}  // namespace remat::testing
