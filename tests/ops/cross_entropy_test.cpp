#include "remat/ops/cross_entropy.h"

#include "remat/dist.h"
#include "remat/graph.h"
#include "remat/memory.h"

#include "ops/testing.h"
#include "util/local_group.h"

#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>

namespace {

using namespace remat::ops;
using namespace remat::testing;
using remat::graph::Attrs;
using remat::graph::OpDef;
using remat::graph::RunContext;
namespace op = remat::graph::op;

// Mean cross-entropy over the counted targets, on the full [N, V] logits.
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets) {
  at::Tensor logp = at::log_softmax(at::matmul(x, w.t()), -1);
  at::Tensor counted = targets.ne(kIgnoreIndex);
  at::Tensor picked = logp.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1);
  return -(picked * counted.to(at::kDouble)).sum() / counted.sum();
}

// Random targets in [0, V) with roughly a quarter of them ignored.
at::Tensor make_targets(int64_t N, int64_t V, at::Generator& gen) {
  at::Tensor t = at::randint(V, {N}, gen, at::kLong);
  return at::where(at::rand({N}, gen) < 0.25, at::full({N}, kIgnoreIndex, at::kLong), t);
}

// A head's forward gives the loss and its backward: from dloss and a dw to accumulate
// into, dx.
using Backward = std::function<at::Tensor(double, at::Tensor&)>;
using Head =
    std::function<std::pair<at::Tensor, Backward>(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>;

// Against autograd of log-softmax over the whole logits, in float64. For a head whose
// vocabulary `ranks` split, each case's vocabulary is rounded up to a multiple of them and
// the targets include each share's first row and an ignored one.
void expect_matches_autograd(const Head& head, uint64_t seed, int64_t ranks = 1) {
  struct Case {
    int64_t N, C, V;
  };
  at::Generator gen = seeded(seed);
  for (Case c : {Case{7, 5, 11}, Case{13, 4, 6}, Case{1, 3, 2}, Case{32, 6, 17}}) {
    const int64_t V = (c.V + ranks - 1) / ranks * ranks;
    for (int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{5}, c.N, c.N + 9}) {
      at::Tensor x = at::randn({c.N, c.C}, gen, f64()), w = at::randn({V, c.C}, gen, f64());
      at::Tensor targets = make_targets(c.N, V, gen);
      targets[0] = V - 1;  // at least one counted target
      if (ranks > 1) {
        for (int64_t r = 0; r < ranks && r + 1 < c.N; ++r) targets[r + 1] = r * (V / ranks);
        if (c.N > ranks + 1) targets[c.N - 1] = kIgnoreIndex;
      }
      auto [loss, backward] = head(x, w, targets, chunk);
      at::Tensor xl = leaf(x), wl = leaf(w);
      at::Tensor ref = reference(xl, wl, targets);
      const std::string what = "N" + std::to_string(c.N) + " V" + std::to_string(V) + " chunk" + std::to_string(chunk) +
                               " ranks" + std::to_string(ranks);
      EXPECT_EQ(loss.dim(), 0);
      EXPECT_EQ(loss.scalar_type(), at::kDouble);
      const at::Tensor counted = targets.ne(kIgnoreIndex);
      const double n = counted.sum().item<double>();
      // The loss (log-sum-exp minus the target's logit) and its gradients (softmax minus
      // one-hot) cancel as far as a token is well predicted, so they are held to the size of
      // the terms that cancel: a logit is at most |x_i| . |w_j|, its log-sum-exp within
      // log V of the largest.
      const at::Tensor terms =
          (at::matmul(x.abs(), w.abs().t()).amax(1) + std::log(static_cast<double>(V))).masked_select(counted);
      const double loss_scale = 2 * terms.mean().item<double>();
      const double grad_scale = 2 * (1 + terms.max().item<double>());
      EXPECT_LT(err_over(loss, ref.detach(), loss_scale), 1e-13) << what;
      const double dloss = 0.7;
      auto want = grads(ref, at::scalar_tensor(dloss, f64()), {xl, wl});
      // Accumulates onto existing values; kept small so that subtracting them again does not
      // cancel away digits of the (1/N-scaled) gradient being checked.
      at::Tensor dw0 = at::randn({V, c.C}, gen, f64()) * 1e-3;
      at::Tensor dw = dw0.clone();
      at::Tensor dx = backward(dloss, dw);
      EXPECT_LT(err_over(dx, want[0], dloss / n * grad_scale * w.abs().max().item<double>()), 1e-13) << what;
      EXPECT_LT(err_over(dw - dw0, want[1], dloss * grad_scale * x.abs().max().item<double>()), 1e-13) << what;
    }
  }
}

TEST(CrossEntropyOp, MatchesAutogradOfLogSoftmaxOnFullLogits) {
  expect_matches_autograd(
      [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets, int64_t chunk) {
        Fwd<CrossEntropySaved> f = cross_entropy_forward(x, w, targets, chunk);
        return std::pair<at::Tensor, Backward>(f.out, [saved = f.saved, w](double dloss, at::Tensor& dw) {
          return cross_entropy_backward(dloss, saved, w, dw);
        });
      },
      1);
}

TEST(CrossEntropyOp, AllTargetsIgnoredGivesZeroLossAndGradients) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({4, 3}, gen, f64()), w = at::randn({5, 3}, gen, f64());
  Fwd<CrossEntropySaved> f = cross_entropy_forward(x, w, at::full({4}, kIgnoreIndex, at::kLong), 2);
  EXPECT_EQ(f.out.item<double>(), 0.0);
  at::Tensor dw = at::ones({5, 3}, f64());
  EXPECT_TRUE(at::equal(cross_entropy_backward(1.0, f.saved, w, dw), at::zeros({4, 3}, f64())));
  EXPECT_TRUE(at::equal(dw, at::ones({5, 3}, f64())));
}

TEST(CrossEntropyOp, SavesInputsAndPerTokenLogSumExpOnly) {
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  at::Generator gen = seeded(1);
  for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16}) {
    for (int64_t N : {1, 10, 33}) {
      for (int64_t chunk : {4, 64}) {
        at::Tensor x = at::randn({N, 8}, gen).to(dt), w = at::randn({50, 8}, gen).to(dt);
        at::Tensor targets = make_targets(N, 50, gen);
        const int64_t before = remat::memory::stats(cpu).current;
        Fwd<CrossEntropySaved> f = cross_entropy_forward(x, w, targets, chunk);
        const int64_t retained = remat::memory::stats(cpu).current - before;
        EXPECT_EQ(cross_entropy_saved_bytes(N, 8, dt), tensors_bytes(f.saved.tensors()));
        EXPECT_TRUE(f.saved.x.is_same(x) && f.saved.targets.is_same(targets));
        EXPECT_EQ(f.saved.lse.scalar_type(), stats_dtype(dt));
        EXPECT_EQ(f.out.scalar_type(), stats_dtype(dt));
        // Only the loss and the log-sum-exp outlive the forward: no logits are kept.
        EXPECT_EQ(retained, tensors_bytes({f.out, f.saved.lse}));
      }
    }
  }
}

TEST(CrossEntropyOp, PeakStaysWithinOneChunkOfLogits) {
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  const int64_t N = 96, C = 8, V = 2000, chunk = 16;
  at::Generator gen = seeded(1);
  // Float types only: on CPU, oneDNN's bfloat16 matmul allocates scratch copies of its
  // operands, which no formula of ours can own.
  for (auto dt : {at::kFloat, at::kDouble}) {
    at::Tensor x = at::randn({N, C}, gen).to(dt), w = at::randn({V, C}, gen).to(dt);
    at::Tensor targets = make_targets(N, V, gen);
    at::Tensor dw = at::zeros({V, C}, dt);
    const int64_t workspace = cross_entropy_workspace_bytes(chunk, V, dt);
    // Row vectors per chunk (max, targets, scales) and the [N, C] dx are small next to it.
    const int64_t slack = 16 * N * 8 + 2 * N * C * 8;
    ASSERT_LT(slack, workspace / 4);
    ASSERT_LT(workspace, nbytes(N * V, at::kFloat) / 2);  // whole float32 logits would not fit

    remat::memory::reset_peak(cpu);
    int64_t base = remat::memory::stats(cpu).current;
    Fwd<CrossEntropySaved> f = cross_entropy_forward(x, w, targets, chunk);
    int64_t peak = remat::memory::stats(cpu).peak - base;
    EXPECT_LE(peak, workspace + slack) << dt;
    EXPECT_GE(peak, workspace) << dt;  // the workspace figure is not an overstatement

    remat::memory::reset_peak(cpu);
    base = remat::memory::stats(cpu).current;
    at::Tensor dx = cross_entropy_backward(1.0, f.saved, w, dw);
    peak = remat::memory::stats(cpu).peak - base;
    EXPECT_LE(peak, workspace + slack) << dt;
    EXPECT_GE(peak, workspace) << dt;
  }
}

TEST(CrossEntropyOp, FlopsMatchTheMatmulsItRuns) {
  at::Generator gen = seeded(1);
  for (auto [N, C, V, chunk] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{7, 5, 11, 3}, {40, 8, 33, 16}, {5, 2, 3, 100}}) {
    at::Tensor x = at::randn({N, C}, gen), w = at::randn({V, C}, gen);
    MatmulFlopCounter counter;
    cross_entropy_forward(x, w, make_targets(N, V, gen), chunk);
    // Beyond the matmuls: 4 FLOPs per logit for the log-sum-exp.
    EXPECT_EQ(cross_entropy_flops(N, C, V) - 4.0 * N * V, counter.flops());
    EXPECT_EQ(counter.flops(), 2.0 * N * C * V);
  }
}

TEST(CrossEntropyOp, BFloat16AccumulatesInFloat32) {
  const int64_t N = 64, C = 16, V = 300;
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({N, C}, gen).to(at::kBFloat16), w = (at::randn({V, C}, gen) * 0.3).to(at::kBFloat16);
  at::Tensor targets = make_targets(N, V, gen);
  Fwd<CrossEntropySaved> f = cross_entropy_forward(x, w, targets, 24);
  at::Tensor ref = reference(x.to(at::kDouble), w.to(at::kDouble), targets);
  EXPECT_EQ(f.out.scalar_type(), at::kFloat);
  EXPECT_LT(rel_err(f.out, ref), 1e-2);
  for (auto acc : {at::kFloat, at::kBFloat16}) {
    at::Tensor dw = at::zeros({V, C}, acc), dw64 = at::zeros({V, C}, f64());
    at::Tensor dx = cross_entropy_backward(1.0, f.saved, w, dw);
    auto f64r = cross_entropy_forward(x.to(at::kDouble), w.to(at::kDouble), targets, 24);
    at::Tensor dx64 = cross_entropy_backward(1.0, f64r.saved, w.to(at::kDouble), dw64);
    EXPECT_EQ(dx.scalar_type(), at::kBFloat16);
    EXPECT_LT(rel_err(dx, dx64), 3e-2);
    EXPECT_LT(rel_err(dw, dw64), 3e-2);
  }
}

TEST(FusedCrossEntropyOp, MatchesAutogradOfLogSoftmaxOnFullLogits) {
  expect_matches_autograd(
      [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets, int64_t chunk) {
        Fwd<FusedCrossEntropySaved> f = fused_cross_entropy_forward(x, w, targets, chunk, true);
        // The same loss as the recomputing head's, to the bit: the same reductions in the same order.
        EXPECT_TRUE(at::equal(f.out, cross_entropy_forward(x, w, targets, chunk).out));
        return std::pair<at::Tensor, Backward>(f.out, [saved = f.saved](double dloss, at::Tensor& dw) {
          return fused_cross_entropy_backward(dloss, saved, dw);
        });
      },
      2);
}

TEST(FusedCrossEntropyOp, GradientsEqualTheRecomputingHeadsToFloatRounding) {
  // float32, the training dtype: the two heads differ only in how the softmax is rounded
  // (exp(l - max) / sum against exp(l - lse)) and in scaling dw once at the end, so each
  // gradient element agrees to a few units of float32 rounding of its largest term.
  const int64_t N = 96, C = 24, V = 500;
  at::Generator gen = seeded(3);
  at::Tensor x = at::randn({N, C}, gen), w = at::randn({V, C}, gen) * 0.2;
  at::Tensor targets = make_targets(N, V, gen);
  for (double dloss : {1.0, 0.25}) {
    auto r = cross_entropy_forward(x, w, targets, 40);
    at::Tensor dw_r = at::zeros({V, C}), dw_f = at::zeros({V, C});
    at::Tensor dx_r = cross_entropy_backward(dloss, r.saved, w, dw_r);
    auto f = fused_cross_entropy_forward(x, w, targets, 40, true);
    at::Tensor dx_f = fused_cross_entropy_backward(dloss, f.saved, dw_f);
    EXPECT_TRUE(at::equal(f.out, r.out));
    const double eps = std::numeric_limits<float>::epsilon();
    EXPECT_LT(err_over(dx_f, dx_r, dx_r.abs().max().item<double>()), 64 * eps) << dloss;
    EXPECT_LT(err_over(dw_f, dw_r, dw_r.abs().max().item<double>()), 64 * eps) << dloss;
  }
}

TEST(FusedCrossEntropyOp, RunsOneProductFewerThanTheRecomputingHead) {
  const int64_t N = 40, C = 8, V = 33, chunk = 16;
  at::Generator gen = seeded(4);
  at::Tensor x = at::randn({N, C}, gen), w = at::randn({V, C}, gen), targets = make_targets(N, V, gen);
  at::Tensor dw = at::zeros({V, C});
  double recompute = 0, fused = 0;
  {
    MatmulFlopCounter counter;
    cross_entropy_backward(1.0, cross_entropy_forward(x, w, targets, chunk).saved, w, dw);
    recompute = counter.flops();
  }
  {
    MatmulFlopCounter counter;
    fused_cross_entropy_backward(1.0, fused_cross_entropy_forward(x, w, targets, chunk, true).saved, dw);
    fused = counter.flops();
  }
  const double product = 2.0 * N * C * V;  // one [N, C] x [C, V] product, over every chunk
  EXPECT_EQ(recompute, 4 * product);       // logits; logits again, dx, dw
  EXPECT_EQ(fused, 3 * product);           // logits, dx, dw
}

TEST(FusedCrossEntropyOp, KeepsTheGradientsOnlyAndEvaluationKeepsNothing) {
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  at::Generator gen = seeded(5);
  for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16}) {
    for (int64_t N : {1, 10, 33}) {
      at::Tensor x = at::randn({N, 8}, gen).to(dt), w = at::randn({50, 8}, gen).to(dt);
      at::Tensor targets = make_targets(N, 50, gen);
      int64_t before = remat::memory::stats(cpu).current;
      Fwd<FusedCrossEntropySaved> f = fused_cross_entropy_forward(x, w, targets, 4, true);
      EXPECT_EQ(remat::memory::stats(cpu).current - before, tensors_bytes({f.out}) + tensors_bytes(f.saved.tensors()));
      EXPECT_EQ(fused_cross_entropy_saved_bytes(N, 8, 50, dt), tensors_bytes(f.saved.tensors()));
      EXPECT_EQ(f.saved.dx.scalar_type(), dt);
      EXPECT_EQ(f.saved.dw.scalar_type(), stats_dtype(dt));
      before = remat::memory::stats(cpu).current;
      Fwd<FusedCrossEntropySaved> eval = fused_cross_entropy_forward(x, w, targets, 4, false);
      EXPECT_EQ(remat::memory::stats(cpu).current - before, tensors_bytes({eval.out}));
      EXPECT_FALSE(eval.saved.dx.defined() || eval.saved.dw.defined());
      EXPECT_TRUE(at::equal(eval.out, f.out));
    }
  }
}

TEST(FusedCrossEntropyOp, AllTargetsIgnoredGivesZeroLossAndGradients) {
  at::Generator gen = seeded(6);
  at::Tensor x = at::randn({4, 3}, gen, f64()), w = at::randn({5, 3}, gen, f64());
  auto f = fused_cross_entropy_forward(x, w, at::full({4}, kIgnoreIndex, at::kLong), 2, true);
  EXPECT_EQ(f.out.item<double>(), 0.0);
  at::Tensor dw = at::ones({5, 3}, f64());
  EXPECT_TRUE(at::equal(fused_cross_entropy_backward(1.0, f.saved, dw), at::zeros({4, 3}, f64())));
  EXPECT_TRUE(at::equal(dw, at::ones({5, 3}, f64())));
}

// A group of `size` ranks as rank `rank` sees it, for running one rank's part of a step
// that needs no collective (a backward) on its own: any collective or transfer fails the test.
class NoCollectives final : public remat::dist::Group {
 public:
  NoCollectives(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce(std::vector<at::Tensor>&, remat::dist::Reduce, const std::string& what) override { refuse(what); }
  std::unique_ptr<remat::dist::Transfer> start_all_reduce(std::vector<at::Tensor>, remat::dist::Reduce,
                                                          const std::string& what) override {
    refuse(what);
  }
  at::Tensor all_gather(const at::Tensor&, int64_t, const std::string& what) override { refuse(what); }
  std::unique_ptr<remat::dist::Transfer> send(const at::Tensor&, int, int, const std::string& what) override {
    refuse(what);
  }
  std::unique_ptr<remat::dist::Transfer> recv(at::Tensor&, int, int, const std::string& what) override { refuse(what); }

 private:
  [[noreturn]] static void refuse(const std::string& what) {
    throw std::logic_error("a collective or transfer ran where none should: " + what);
  }
  int rank_, size_;
};

// `op` (a loss definition) marked sharded, as the tensor-parallel transform runs it on
// `ranks` ranks: each rank's forward on a thread of its own with its [V/t, C] rows, then
// each rank's backward in turn with no collective allowed (the recomputing head saved the
// whole vocabulary's log-sum-exp; the fused one only scales its gradients). Every rank's
// loss must be the same to the bit; dx is the ranks' parts summed in rank order (what the
// copy node's all-reduce does), and each rank's dw accumulates into its rows of the caller's.
// Every rank's outputs of `op`'s sharded forward (attributes `a`), each rank a thread
// holding its rows of `w`.
std::vector<std::vector<at::Tensor>> sharded_forward(const OpDef& op, int ranks, const Attrs& a, bool train,
                                                     const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& targets) {
  const int64_t held = w.size(0) / ranks;
  std::vector<std::vector<at::Tensor>> out(static_cast<size_t>(ranks));
  on_local_ranks(ranks, [&](remat::dist::Group& group) {
    RunContext ctx;
    ctx.tp = &group;
    ctx.train = train;
    const int r = group.rank();
    out[static_cast<size_t>(r)] = op.forward({x, targets}, {w.narrow(0, r * held, held)}, a, ctx);
  });
  return out;
}

Head vocab_parallel(const OpDef& op, int ranks, bool train = true) {
  return [&op, ranks, train](const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets, int64_t chunk) {
    const int64_t held = w.size(0) / ranks;
    Attrs a;
    a.chunk = chunk;
    a.sharded = true;
    const std::vector<std::vector<at::Tensor>> out = sharded_forward(op, ranks, a, train, x, w, targets);
    for (int r = 1; r < ranks; ++r) {
      EXPECT_TRUE(at::equal(out[static_cast<size_t>(r)][0], out[0][0])) << "rank " << r << "'s loss differs";
    }
    Backward backward = [&op, ranks, held, a, x, w, targets, out](double dloss, at::Tensor& dw) {
      at::Tensor dx;
      for (int r = 0; r < ranks; ++r) {
        NoCollectives group(r, ranks);
        RunContext ctx;
        ctx.tp = &group;
        at::Tensor dw_r = dw.narrow(0, r * held, held);  // a view: it accumulates into dw
        std::vector<at::Tensor*> g{&dw_r};
        const at::Tensor part = op.backward({at::scalar_tensor(dloss, x.options())}, {x, targets},
                                            out[static_cast<size_t>(r)], {w.narrow(0, r * held, held)}, g, a, ctx)[0];
        dx = r == 0 ? part : dx + part;
      }
      return dx;
    };
    return std::pair<at::Tensor, Backward>(out[0][0], backward);
  };
}

// The bound of the unsplit check holds unchanged (1e-13 of the terms that cancel, some 450
// float64 eps): the split changes only the order a row's sum of exp is added in (a partial
// sum of V/t terms on each rank, then the t partial sums, against V terms in one sum),
// which either way is within V eps (V <= 20 here) of the exact sum, relatively.
TEST(CrossEntropyOp, VocabularyParallelMatchesAutogradOfLogSoftmaxOnFullLogits) {
  for (int ranks : {2, 4}) expect_matches_autograd(vocab_parallel(op::cross_entropy(), ranks), 11, ranks);
}

TEST(FusedCrossEntropyOp, VocabularyParallelMatchesAutogradOfLogSoftmaxOnFullLogits) {
  for (int ranks : {2, 4}) expect_matches_autograd(vocab_parallel(op::fused_cross_entropy(), ranks), 12, ranks);
}

// How far a float32 loss over a split vocabulary may lie from the whole vocabulary's, eps
// float32's and M = max_n,v |x_n| . |w_v| bounding every logit. Per counted row the term
// lse - z_t lies within eps (2 C M + V + 1 + 5 M + 3 log V) of its exact value, however the
// work is split: the logits (dot products of C terms, however the product blocks them)
// within C M eps each, which moves lse and z_t by as much; each exp(z - m) (its argument
// within 2 M) within (1 + 2 M) eps relatively, and their sum, V in one or V/t on each rank
// then the t partial sums, within V eps more, so log S within (1 + 2 M + V) eps; the log
// itself, adding m and subtracting z_t round once each, at most log V, M + log V and
// 2 M + log V. The mean over the counted rows (chunk sums, their total, the division) adds
// (N + 1) eps (2 M + log V). Both losses lie that close to the exact one: twice that apart.
double split_loss_bound(const at::Tensor& x, const at::Tensor& w) {
  const double eps = std::numeric_limits<float>::epsilon();
  const double N = static_cast<double>(x.size(0)), C = static_cast<double>(x.size(1));
  const double V = static_cast<double>(w.size(0));
  const double M = at::matmul(x.abs().to(at::kDouble), w.abs().to(at::kDouble).t()).max().item<double>();
  const double logV = std::log(V);
  return 2 * eps * (2 * C * M + V + 1 + 5 * M + 3 * logV + (N + 1) * (2 * M + logV));
}

TEST(CrossEntropyOp, VocabularyParallelFloat32LossIsTheWholeVocabularysWithinItsRounding) {
  const int64_t N = 50, C = 16, V = 512, chunk = 16;  // N is no multiple of the chunk
  at::Generator gen = seeded(13);
  at::Tensor x = at::randn({N, C}, gen), w = at::randn({V, C}, gen) * 0.3;
  at::Tensor targets = make_targets(N, V, gen);
  for (int64_t r = 0; r < 4; ++r) targets[r] = r * (V / 4) + 1;  // on every share of 2 or 4
  const double bound = split_loss_bound(x, w);
  for (const OpDef* head : {&op::cross_entropy(), &op::fused_cross_entropy()}) {
    Attrs a;
    a.chunk = chunk;
    const at::Tensor whole = head->forward({x, targets}, {w}, a, RunContext{})[0];
    for (int ranks : {2, 4}) {
      const at::Tensor split = vocab_parallel(*head, ranks)(x, w, targets, chunk).first;
      EXPECT_EQ(split.scalar_type(), at::kFloat);
      EXPECT_LE(std::abs(split.item<double>() - whole.item<double>()), bound)
          << head->kind() << " on " << ranks << " ranks (bound " << bound << ")";
    }
  }
  // Not an empty bound: the loss is several nats, the bound a small fraction of one.
  EXPECT_LT(bound, 1e-2);
}

TEST(FusedCrossEntropyOp, VocabularyParallelEvaluationComputesTheLossOnly) {
  const int64_t N = 21, C = 6, V = 24, chunk = 8;
  at::Generator gen = seeded(14);
  at::Tensor x = at::randn({N, C}, gen), w = at::randn({V, C}, gen);
  at::Tensor targets = make_targets(N, V, gen);
  for (int ranks : {2, 4}) {
    Attrs a;
    a.chunk = chunk;
    a.sharded = true;
    const auto eval = sharded_forward(op::fused_cross_entropy(), ranks, a, /*train=*/false, x, w, targets);
    const at::Tensor trained = vocab_parallel(op::fused_cross_entropy(), ranks)(x, w, targets, chunk).first;
    for (const auto& out : eval) {
      EXPECT_TRUE(at::equal(out[0], trained)) << ranks << " ranks";
      EXPECT_FALSE(out[1].defined() || out[2].defined()) << ranks << " ranks";
    }
  }
}

TEST(CrossEntropyOp, VocabularyShareChecksTargetsAgainstTheWholeVocabulary) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({3, 4}, gen), w = at::randn({5, 4}, gen);
  const at::Tensor beyond = at::tensor({0, 10, -1}, at::kLong);
  expect_error(
      [&] {
        cross_entropy_forward(x, w, beyond, 2, VocabShard{0, 5});
      },
      {"[cross_entropy]", "[0, 5)", "[-1, 10]"});
  expect_error(
      [&] {
        fused_cross_entropy_forward(x, w, beyond, 2, true, VocabShard{0, 5});
      },
      {"[cross_entropy]", "[0, 5)", "[-1, 10]"});
  expect_error(
      [&] {
        cross_entropy_forward(x, w, at::tensor({0, 1, 2}, at::kLong), 2, VocabShard{6, 10});
      },
      {"[cross_entropy]", "5 vocabulary rows from row 6", "vocabulary of 10"});
  // Half a vocabulary with no group to hold the other half, and a group with no share.
  expect_error(
      [&] {
        cross_entropy_forward(x, w, at::tensor({0, 1, 2}, at::kLong), 2, VocabShard{0, 10});
      },
      {"[cross_entropy]", "1 rank(s) holding 5", "vocabulary of 10"});
  NoCollectives group(0, 2);
  expect_error(
      [&] {
        cross_entropy_forward(x, w, at::tensor({0, 1, 2}, at::kLong), 2, std::nullopt, &group);
      },
      {"[cross_entropy]", "share"});
}

TEST(CrossEntropyOp, RefusesBadTargetsAndShapes) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({3, 4}, gen), w = at::randn({5, 4}, gen);
  expect_error(
      [&] {
        cross_entropy_forward(x, w, at::tensor({0, 5, 1}, at::kLong), 2);
      },
      {"[cross_entropy]", "[0, 5)", "[0, 5]"});
  expect_error(
      [&] {
        cross_entropy_forward(x, w, at::tensor({0, -2, 1}, at::kLong), 2);
      },
      {"[cross_entropy]", "[-2, 1]"});
  expect_error(
      [&] {
        cross_entropy_forward(x, w, at::tensor({0, 1}, at::kLong), 2);
      },
      {"[cross_entropy]", "[2]", "[3, 4]"});
  expect_error(
      [&] {
        cross_entropy_forward(x, at::randn({5, 3}, gen), at::tensor({0, 1, 2}, at::kLong), 2);
      },
      {"[cross_entropy]", "[3, 4]", "[5, 3]"});
  expect_error(
      [&] {
        cross_entropy_forward(x, w, at::tensor({0, 1, 2}, at::kLong), 0);
      },
      {"[cross_entropy]", "chunk_tokens"});
}

}  // namespace
