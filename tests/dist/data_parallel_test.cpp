// Data parallelism against one process: ranks run as threads of this test, joined through
// a real TCPStore and Gloo group on the loopback, each training on its rows of one batch.
#include "cli/launch.h"
#include "remat/dist.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "train/data_parallel.h"
#include "train/step.h"
#include "util/gloo_ranks.h"
#include "util/seeded.h"

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

// Rank r's rows, its dropout keyed by their global position, its loss scaled by 1 / n.
double rank_part(Model& model, int r, int n, const at::Tensor& tok, const at::Tensor& tgt) {
  StepContext ctx = kStep;
  ctx.first_row = r * kRows;
  return model.forward_backward(tok.narrow(0, r * kRows, kRows), tgt.narrow(0, r * kRows, kRows), ctx, 1.0 / n, 64) / n;
}

// One process computing each rank's part from zeroed gradients.
std::vector<Grads> one_process_parts(const char* preset, int n, double dropout, const std::string& policy) {
  auto model = make_model(preset, dropout, policy);
  const auto [tok, tgt] = batch(model->config(), n * kRows);
  std::vector<Grads> parts(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    model->zero_grad();
    parts[static_cast<size_t>(r)].loss = rank_part(*model, r, n, tok, tgt);
    for (const auto& p : model->params()) parts[static_cast<size_t>(r)].grads.push_back(p.grad.clone());
  }
  return parts;
}

// Every rank's gradients after the all-reduce, and each rank's own part before it (none
// when the reduction overlapped the backward, which sums the parts in place as they come).
struct Distributed {
  std::vector<Grads> reduced, parts;
  std::vector<int64_t> buckets, early;  ///< per rank
};
Distributed ranks(const char* preset, int n, double dropout, const std::string& policy, bool overlap = false) {
  Distributed d;
  d.reduced.resize(static_cast<size_t>(n));
  d.parts.resize(static_cast<size_t>(n));
  d.buckets.resize(static_cast<size_t>(n));
  d.early.resize(static_cast<size_t>(n));
  testing::on_gloo_ranks(n, 1, [&](dist::Comm& comm) {
    auto model = make_model(preset, dropout, policy);
    const auto [tok, tgt] = batch(model->config(), n * kRows);
    model->zero_grad();
    // Buckets of 4 KiB: the tiny models' gradients fill several.
    GradientReduction reduction(*model, comm.data(), overlap, "the test's all-reduce", 4 << 10);
    Grads& part = d.parts[static_cast<size_t>(comm.rank())];
    part.loss = rank_part(*model, comm.rank(), n, tok, tgt);
    if (!overlap) {
      for (const auto& p : model->params()) part.grads.push_back(p.grad.clone());
    }
    Grads& out = d.reduced[static_cast<size_t>(comm.rank())];
    out.loss = part.loss;
    reduction.finish(out.loss);
    d.buckets[static_cast<size_t>(comm.rank())] = reduction.bucket_count();
    d.early[static_cast<size_t>(comm.rank())] = reduction.started_early();
    for (const auto& p : model->params()) out.grads.push_back(p.grad.clone());
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
      const Distributed early = ranks(preset, 2, 0.1, policy, true);
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
  for (int r = 0; r < kRanks; ++r) {
    expect_bitwise(d.parts[static_cast<size_t>(r)], reference[static_cast<size_t>(r)], "part " + std::to_string(r));
    const Grads& got = d.reduced[static_cast<size_t>(r)];
    EXPECT_LE(std::abs(got.loss - loss), 2 * gamma3(0x1p-53) * abs_loss) << "rank " << r;
    for (size_t i = 0; i < reference[0].grads.size(); ++i) {
      at::Tensor exact = at::zeros_like(reference[0].grads[i], at::kDouble);
      at::Tensor bound = at::zeros_like(exact);
      for (const Grads& p : reference) {
        exact += p.grads[i].to(at::kDouble);
        bound += p.grads[i].to(at::kDouble).abs();
      }
      bound *= 2 * gamma3(0x1p-24);
      const at::Tensor excess = (got.grads[i].to(at::kDouble) - exact).abs() - bound;
      EXPECT_LE(excess.max().item<double>(), 0.0) << "rank " << r << " grad " << i;
    }
  }
  // And every rank holds the same sums: they update their weights alike.
  for (int r = 1; r < kRanks; ++r) expect_bitwise(d.reduced[static_cast<size_t>(r)], d.reduced[0], "rank vs rank 0");
}

}  // namespace
}  // namespace remat
