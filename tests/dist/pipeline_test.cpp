// Pipeline groups and transfers between stages: ranks as threads of this test, joined
// through a real TCPStore and Gloo groups on the loopback.
#include "remat/dist.h"
#include "util/gloo_ranks.h"
#include "util/seeded.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace remat {
namespace {

// Where world rank `r` of pp x dp x tp ranks stands, in Megatron's order (tp innermost).
struct Place {
  int stage, replica, tp_rank;
};
Place place_of(int r, int dp, int tp) { return {r / (dp * tp), r / tp % dp, r % tp}; }

// Eight ranks as 2 stages x 2 replicas x 2 tensor-parallel ranks: each group holds the
// ranks sharing what it should, ranked as it should, and sums over exactly them.
TEST(Pipeline, EightRanksAreTwoStagesOfTwoReplicasOfTwoTensorRanks) {
  constexpr int kRanks = 8, kDp = 2, kTp = 2, kPp = 2;
  testing::on_gloo_ranks(
      kRanks, kTp,
      [&](dist::Comm& comm) {
        const Place me = place_of(comm.rank(), kDp, kTp);
        struct Expected {
          dist::Group& group;
          const char* name;
          int rank, size;
          bool (*shares)(const Place&, const Place&);
        };
        const Expected groups[] = {
            {comm.pipeline(), "pipeline", me.stage, kPp,
             [](const Place& a, const Place& b) { return a.replica == b.replica && a.tp_rank == b.tp_rank; }},
            {comm.data(), "data", me.replica, kDp,
             [](const Place& a, const Place& b) { return a.stage == b.stage && a.tp_rank == b.tp_rank; }},
            {comm.tensor(), "tensor", me.tp_rank, kTp,
             [](const Place& a, const Place& b) { return a.stage == b.stage && a.replica == b.replica; }},
        };
        for (const Expected& e : groups) {
          EXPECT_EQ(e.group.rank(), e.rank) << e.name << " group, world rank " << comm.rank();
          EXPECT_EQ(e.group.size(), e.size) << e.name << " group, world rank " << comm.rank();
          // 2^r for each rank r: the sum names its members.
          std::vector<at::Tensor> bits{at::full({1}, int64_t{1} << comm.rank(), at::kLong)};
          e.group.all_reduce(bits, dist::Reduce::sum, std::string("the test's all-reduce over the ") + e.name);
          int64_t members = 0;
          for (int r = 0; r < kRanks; ++r) {
            if (e.shares(me, place_of(r, kDp, kTp))) members |= int64_t{1} << r;
          }
          EXPECT_EQ(bits[0].item<int64_t>(), members) << e.name << " group, world rank " << comm.rank();
        }
      },
      kPp);
}

// One pipeline stage's worth of every other group: without a pipeline, pipeline() is this
// rank alone, and the other groups are those of the two-argument connect.
TEST(Pipeline, OneStageLeavesTheOtherGroupsAsTheyWere) {
  testing::on_gloo_ranks(4, 2, [](dist::Comm& comm) {
    EXPECT_EQ(comm.pipeline().size(), 1);
    EXPECT_EQ(comm.pipeline().rank(), 0);
    EXPECT_EQ(comm.tensor().rank(), comm.rank() % 2);
    EXPECT_EQ(comm.data().rank(), comm.rank() / 2);
    EXPECT_EQ(comm.data().size(), 2);
  });
}

TEST(Pipeline, StagesThatDoNotDivideTheRanksAreASentenceBeforeAnyRankConnects) {
  dist::LaunchEnv env;
  env.world_size = 8;
  env.master_port = 1;  // never reached: the layout is checked first
  try {
    dist::Comm::connect(env, std::chrono::seconds(1), 2, 3);
    FAIL() << "connect accepted 3 stages of 8 ranks in pairs";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "pp = 3 pipeline stages must divide the 4 tensor-parallel groups of the 8 ranks started "
                 "(parallel.tp = 2): every stage holds as many of them.");
  }
}

// A transfer names another rank of its group and receives into a tensor Gloo can write
// in a row; anything else is the caller's mistake, told before any byte moves.
TEST(Pipeline, TransfersToNoPeerOrIntoAStridedTensorAreRefused) {
  testing::on_gloo_ranks(
      2, 1,
      [](dist::Comm& comm) {
        dist::Group& pipe = comm.pipeline();
        at::Tensor t = at::zeros({4, 4});
        for (const int peer : {-1, pipe.rank(), 2}) {
          EXPECT_THROW(pipe.send(t, peer, 0, "a stray send"), c10::Error) << "peer " << peer;
          EXPECT_THROW(pipe.recv(t, peer, 0, "a stray receive"), c10::Error) << "peer " << peer;
        }
        EXPECT_THROW(pipe.send(t, 1 - pipe.rank(), -1, "a send with no tag"), c10::Error);
        at::Tensor strided = t.t();
        EXPECT_THROW(pipe.recv(strided, 1 - pipe.rank(), 0, "a receive into a transposed tensor"), c10::Error);
      },
      2);
}

// The tensor stage `from` sends towards `to` under `tag`: distinct for every pair, tag,
// dtype and size, so that a transfer matched to the wrong send shows.
at::Tensor payload(int from, int to, int tag, at::ScalarType dtype, int64_t numel) {
  const int key = ((from * 8 + to) * 2 + tag) * 16 + static_cast<int>(dtype);
  auto gen = testing::seeded(static_cast<uint64_t>(key) * 4099 + static_cast<uint64_t>(numel));
  const std::vector<int64_t> shape{numel / 4, 4};
  if (dtype == at::kLong) return at::randint(-(int64_t{1} << 62), int64_t{1} << 62, shape, gen, at::kLong);
  return at::randn(shape, gen, at::kFloat).to(dtype);
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// Every stage sends to both neighbours on a ring at once (forward under tag 0, backward
// under tag 1, as 1F1B sends activations forward while the next stage sends gradients
// back), posts both receives only after both sends, and waits for its sends before its
// receives: the order a blocking send would deadlock. With two stages both neighbours are
// one peer, told apart by the tag. Received bits equal sent bits, for float32, bfloat16
// (which Gloo's collectives refuse) and int64, small and 4 MB (past a socket's buffer).
TEST(Pipeline, StagesExchangeWithBothNeighboursAtOnceBitExact) {
  struct Ranks {
    int ranks, tp, pp;
  };
  for (const Ranks l : {Ranks{4, 2, 2}, Ranks{4, 1, 4}}) {
    testing::on_gloo_ranks(
        l.ranks, l.tp,
        [&](dist::Comm& comm) {
          dist::Group& pipe = comm.pipeline();
          const int s = pipe.rank(), next = (s + 1) % l.pp, prev = (s + l.pp - 1) % l.pp;
          for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
            for (const int64_t numel : {int64_t{36}, int64_t{1} << 20}) {
              const std::string what = fmt::format("stage {}'s exchange of {} {}", s, numel, at::toString(dtype));
              // The payloads are temporaries: the transfers hold them.
              auto forward = pipe.send(payload(s, next, 0, dtype, numel), next, 0, what);
              auto backward = pipe.send(payload(s, prev, 1, dtype, numel), prev, 1, what);
              at::Tensor from_prev = at::empty({numel / 4, 4}, dtype);
              at::Tensor from_next = at::empty({numel / 4, 4}, dtype);
              auto got_forward = pipe.recv(from_prev, prev, 0, what);
              auto got_backward = pipe.recv(from_next, next, 1, what);
              forward->wait();
              backward->wait();
              got_forward->wait();
              got_backward->wait();
              EXPECT_TRUE(same_bits(from_prev, payload(prev, s, 0, dtype, numel))) << what << ", from " << prev;
              EXPECT_TRUE(same_bits(from_next, payload(next, s, 1, dtype, numel))) << what << ", from " << next;
            }
          }
        },
        l.pp);
  }
}

// A stage whose neighbour never sends: its receive gives up after the job's timeout and
// every rank ends with one sentence naming the operation, the neighbour (busy elsewhere,
// still beating) included, instead of waiting for ever or for Gloo's own wait (a minute
// longer, unless the receive's wait is cut short as it should).
TEST(Pipeline, AReceiveThatNothingAnswersEndsEveryRankWithinTheTimeout) {
  const std::string what = "the receive of stage 1's activations";
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> errors =
      testing::gloo_rank_errors(2, 1, 2, std::chrono::seconds(2), [&](dist::Comm& comm) {
        if (comm.pipeline().rank() == 1) {
          at::Tensor activations = at::empty({4, 4});
          comm.pipeline().recv(activations, 0, 0, what)->wait();
        } else {
          comm.await("never posted", "the test's wait for a key nobody posts");
        }
      });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < 2; ++r) {
    const std::string& error = errors[static_cast<size_t>(r)];
    EXPECT_NE(error.find(what + " failed on rank 1 (not finished after parallel.timeout = 2 s)"), std::string::npos)
        << "rank " << r << ": " << error;
  }
  // The timeout, then the few missed heartbeats that tell a slow rank from a lost one.
  EXPECT_GT(seconds, 2.0);
  EXPECT_LT(seconds, 10.0);
}

}  // namespace
}  // namespace remat
