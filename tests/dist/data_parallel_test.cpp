// Data parallelism against one process: ranks run as threads of this test, joined through
// a real TCPStore and Gloo group on the loopback, each training on its rows of one batch.
#include "cli/launch.h"
#include "remat/cost.h"
#include "remat/dist.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "train/data_parallel.h"
#include "train/step.h"
#include "util/gloo_ranks.h"
#include "util/seeded.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <thread>

namespace remat {
namespace {

struct Grads {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

constexpr int64_t kRows = 2;  // per rank
constexpr uint64_t kSeed = 5;
const StepContext kStep{kSeed, 3, 0};

std::unique_ptr<Model> make_model(const char* preset, double dropout, const std::string& policy) {
  ModelConfig cfg = model_preset(preset);
  cfg.dropout = dropout;
  auto model = Model::create(cfg, at::kCPU, at::kFloat, 1);
  AcConfig ac;
  ac.policy = policy;
  ac.allow_rng_mismatch = true;
  apply_plan(*model, compile_policy(ac, cfg.n_layer, cfg.dropout), ac);
  return model;
}

std::pair<at::Tensor, at::Tensor> batch(const ModelConfig& cfg, int64_t rows) {
  auto gen = testing::seeded(9);
  return {at::randint(cfg.vocab_size, {rows, 8}, gen, at::kLong),
          at::randint(cfg.vocab_size, {rows, 8}, gen, at::kLong)};
}

// Rank r's rows of microbatch `m`, its dropout keyed by their global position, its loss
// scaled by 1 / n.
double rank_part(Model& model, int r, int n, const at::Tensor& tok, const at::Tensor& tgt, uint64_t m = 0) {
  StepContext ctx = kStep;
  ctx.first_row = r * kRows;
  ctx.microbatch = m;
  return model.forward_backward(tok.narrow(0, r * kRows, kRows), tgt.narrow(0, r * kRows, kRows), ctx, 1.0 / n, 64) / n;
}

// One process computing each rank's part of microbatch `m` from zeroed gradients.
std::vector<Grads> one_process_parts(const char* preset, int n, double dropout, const std::string& policy,
                                     uint64_t m = 0) {
  auto model = make_model(preset, dropout, policy);
  const auto [tok, tgt] = batch(model->config(), n * kRows);
  std::vector<Grads> parts(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    model->zero_grad();
    parts[static_cast<size_t>(r)].loss = rank_part(*model, r, n, tok, tgt, m);
    for (const auto& p : model->params()) parts[static_cast<size_t>(r)].grads.push_back(p.grad.clone());
  }
  return parts;
}

// How the ranks reduce their gradients: GradientReduction after the backward or during
// it, or sharded (Model::shard_gradients: each part summed as its backward ends, each rank
// keeping its own parameters', over `microbatches` backwards).
struct Reduction {
  bool overlap = false;
  bool sharded = false;
  int microbatches = 1;
};

// Whether rank `rank` of `n` keeps each parameter's gradient under sharding.
std::vector<bool> owned_by(const Model& model, int n, int rank) {
  std::vector<int64_t> numels;
  for (const Param& p : model.params()) numels.push_back(p.value.numel());
  std::vector<bool> owned;
  for (const int o : cost::zero_owners(numels, n)) owned.push_back(o == rank);
  return owned;
}

// Every rank's gradients after the all-reduce (sharded: the kept ones, undefined for the
// rest), and each rank's own part before it (none when the reduction ran during the
// backward, which sums the parts in place as they come).
struct Distributed {
  std::vector<Grads> reduced, parts;
  std::vector<int64_t> buckets, early;  ///< per rank
};
Distributed ranks(const char* preset, int n, double dropout, const std::string& policy, Reduction how = {}) {
  Distributed d;
  d.reduced.resize(static_cast<size_t>(n));
  d.parts.resize(static_cast<size_t>(n));
  d.buckets.resize(static_cast<size_t>(n));
  d.early.resize(static_cast<size_t>(n));
  testing::on_gloo_ranks(n, 1, [&](dist::Comm& comm) {
    auto model = make_model(preset, dropout, policy);
    const auto [tok, tgt] = batch(model->config(), n * kRows);
    if (how.sharded) model->shard_gradients(owned_by(*model, n, comm.rank()), comm.data());
    model->zero_grad();
    Grads& part = d.parts[static_cast<size_t>(comm.rank())];
    Grads& out = d.reduced[static_cast<size_t>(comm.rank())];
    if (how.sharded) {
      for (int m = 0; m < how.microbatches; ++m) {
        out.loss += rank_part(*model, comm.rank(), n, tok, tgt, static_cast<uint64_t>(m));
      }
    } else {
      // Buckets of 4 KiB: the tiny models' gradients fill several.
      GradientReduction reduction(*model, comm.data(), how.overlap, "the test's all-reduce", 4 << 10);
      part.loss = rank_part(*model, comm.rank(), n, tok, tgt);
      if (!how.overlap) {
        for (const auto& p : model->params()) part.grads.push_back(p.grad.clone());
      }
      out.loss = part.loss;
      reduction.finish(out.loss);
      d.buckets[static_cast<size_t>(comm.rank())] = reduction.bucket_count();
      d.early[static_cast<size_t>(comm.rank())] = reduction.started_early();
    }
    for (const auto& p : model->params()) out.grads.push_back(p.grad.defined() ? p.grad.clone() : at::Tensor());
  });
  return d;
}

void expect_bitwise(const Grads& a, const Grads& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(at::equal(a.grads[i], b.grads[i])) << what << " grad " << i;
}

// Each rank's part is bitwise one process's over the same rows (with dropout, a rank draws
// the elements of its global rows; any recompute policy changes nothing), and two ranks
// sum two terms, which float addition does the same in either order. (Accumulating into
// one gradient, as one process does, is not that sum: the embedding scatter-adds row by
// row into what is there; the four-rank test bounds that.)
TEST(DataParallel, TwoRanksSumOneProcesssPartsBitwise) {
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    const std::vector<Grads> reference = one_process_parts(preset, 2, 0.1, "none");
    Grads sum;
    sum.loss = reference[0].loss + reference[1].loss;
    for (size_t i = 0; i < reference[0].grads.size(); ++i) {
      sum.grads.push_back(reference[0].grads[i] + reference[1].grads[i]);
    }
    for (const char* policy : {"none", "full", "modules:[core_attn]"}) {
      const Distributed d = ranks(preset, 2, 0.1, policy);
      // Overlapped with the backward, the same buckets sum the same terms: the same bits,
      // the head's and the top layers' buckets started before the backward's end.
      const Distributed early = ranks(preset, 2, 0.1, policy, {.overlap = true});
      for (int r = 0; r < 2; ++r) {
        const std::string what = std::string(preset) + " " + policy + " rank " + std::to_string(r);
        expect_bitwise(d.parts[static_cast<size_t>(r)], reference[static_cast<size_t>(r)], what + " part");
        expect_bitwise(d.reduced[static_cast<size_t>(r)], sum, what);
        expect_bitwise(early.reduced[static_cast<size_t>(r)], sum, what + " overlapped");
        EXPECT_EQ(d.early[static_cast<size_t>(r)], 0) << what;
        EXPECT_GT(early.buckets[static_cast<size_t>(r)], 2) << what;
        EXPECT_GT(early.early[static_cast<size_t>(r)], 0) << what;
        EXPECT_LT(early.early[static_cast<size_t>(r)], early.buckets[static_cast<size_t>(r)]) << what;
      }
    }
  }
}

// Sharded, each rank keeps the sums of its own parameters' gradients, the same bits as the
// two ranks' whole sums above, whatever the plan recomputes or offloads; over two
// microbatches it adds the second's sums to the first's (each microbatch's parts summed
// over the ranks first). Every gradient is kept by exactly one rank.
TEST(DataParallel, ShardedGradientsKeepTheirOwnersSumsBitwise) {
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    const std::vector<Grads> first = one_process_parts(preset, 2, 0.1, "full", 0),
                             second = one_process_parts(preset, 2, 0.1, "full", 1);
    for (const char* policy : {"none", "full", "modules:[core_attn]", "uniform:2", "full+offload:[input]"}) {
      for (const int microbatches : {1, 2}) {
        const Distributed d = ranks(preset, 2, 0.1, policy, {.sharded = true, .microbatches = microbatches});
        const auto model = make_model(preset, 0.1, policy);
        std::vector<int> keepers(first[0].grads.size());
        for (int r = 0; r < 2; ++r) {
          const std::string what = fmt::format("{} {} {} microbatch(es) rank {}", preset, policy, microbatches, r);
          const std::vector<bool> owned = owned_by(*model, 2, r);
          const Grads& got = d.reduced[static_cast<size_t>(r)];
          ASSERT_EQ(got.grads.size(), first[0].grads.size()) << what;
          for (size_t i = 0; i < got.grads.size(); ++i) {
            EXPECT_EQ(got.grads[i].defined(), owned[i]) << what << " grad " << i;
            if (!got.grads[i].defined()) continue;
            ++keepers[i];
            at::Tensor sum = first[0].grads[i] + first[1].grads[i];
            if (microbatches == 2) sum = sum + (second[0].grads[i] + second[1].grads[i]);
            EXPECT_TRUE(at::equal(got.grads[i], sum)) << what << " grad " << i;
          }
        }
        for (const int k : keepers) EXPECT_EQ(k, 1) << preset << " " << policy;
      }
    }
  }
}

// Four ranks add their parts in Gloo's order. The parts are bitwise one process's (as
// with two ranks); a sum of four float terms a_r is within gamma_3 sum |a_r| of the exact
// sum (gamma_k = k u / (1 - k u), u the unit roundoff: Higham, Accuracy and Stability of
// Numerical Algorithms, 4.2). The reference sums in float64, whose own error is far below
// that, hence the factor 2.
TEST(DataParallel, FourRanksSumWithinTheSummationBound) {
  constexpr int kRanks = 4;
  const std::vector<Grads> reference = one_process_parts("tiny-llama", kRanks, 0.1, "none");
  const Distributed d = ranks("tiny-llama", kRanks, 0.1, "none");
  const auto gamma3 = [](double u) { return 3 * u / (1 - 3 * u); };
  double loss = 0, abs_loss = 0;
  for (const Grads& p : reference) loss += p.loss, abs_loss += std::abs(p.loss);
  // How far gradient i's sum `got` lies beyond the bound of the exact one (<= 0 within it).
  const auto excess = [&](const at::Tensor& got, size_t i) {
    at::Tensor exact = at::zeros_like(reference[0].grads[i], at::kDouble);
    at::Tensor bound = at::zeros_like(exact);
    for (const Grads& p : reference) {
      exact += p.grads[i].to(at::kDouble);
      bound += p.grads[i].to(at::kDouble).abs();
    }
    return ((got.to(at::kDouble) - exact).abs() - 2 * gamma3(0x1p-24) * bound).max().item<double>();
  };
  for (int r = 0; r < kRanks; ++r) {
    expect_bitwise(d.parts[static_cast<size_t>(r)], reference[static_cast<size_t>(r)], "part " + std::to_string(r));
    const Grads& got = d.reduced[static_cast<size_t>(r)];
    EXPECT_LE(std::abs(got.loss - loss), 2 * gamma3(0x1p-53) * abs_loss) << "rank " << r;
    for (size_t i = 0; i < reference[0].grads.size(); ++i) {
      EXPECT_LE(excess(got.grads[i], i), 0.0) << "rank " << r << " grad " << i;
    }
  }
  // And every rank holds the same sums: they update their weights alike.
  for (int r = 1; r < kRanks; ++r) expect_bitwise(d.reduced[static_cast<size_t>(r)], d.reduced[0], "rank vs rank 0");
  // Sharded, each part's sums are Gloo's over a buffer of that part alone: within the same
  // bound, each kept by its owner.
  const Distributed sharded = ranks("tiny-llama", kRanks, 0.1, "none", {.sharded = true});
  for (int r = 0; r < kRanks; ++r) {
    const Grads& got = sharded.reduced[static_cast<size_t>(r)];
    for (size_t i = 0; i < reference[0].grads.size(); ++i) {
      if (got.grads[i].defined()) {
        EXPECT_LE(excess(got.grads[i], i), 0.0) << "sharded rank " << r << " grad " << i;
      }
    }
  }
}

}  // namespace
}  // namespace remat
