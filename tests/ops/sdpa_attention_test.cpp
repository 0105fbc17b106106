// The sdpa op (ATen's fused CPU attention) against autograd of the plain math in float64,
// against the math and tiled ops, and what it keeps; where the build lacks the kernel, its
// refusal.
#include "remat/ops/sdpa_attention.h"

#include "remat/memory.h"

#include "ops/testing.h"
#include "util/openblas.h"
#include "util/sdpa.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

namespace {

using namespace remat::ops;
using namespace remat::testing;

const DropoutKey kKey{11, 2, 0, 3, DropoutSite::attn_probs};  // the math and tiled ops' (no dropout drawn)

struct Case {
  int64_t B, T, Hq, Hkv, D;
  std::string name() const { return fmt::format("B{} T{} Hq{} Hkv{} D{}", B, T, Hq, Hkv, D); }
};
// GQA (8 query heads over 2, 4 over 1), T = 1, one key block, several query blocks (32
// queries each below 192 positions, 64 from there), T not a multiple of a block.
const Case kCases[] = {{2, 9, 8, 2, 4},  {1, 1, 2, 1, 2},   {2, 5, 4, 2, 3}, {1, 45, 3, 3, 4},
                       {2, 70, 4, 1, 5}, {1, 200, 2, 2, 4}, {3, 16, 4, 4, 2}};

// q, k and v as slices of one fused projection output, as the models produce them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_qkv(const Case& c, at::ScalarType dt, uint64_t seed) {
  auto gen = seeded(seed);
  at::Tensor qkv = at::randn({c.B, c.T, c.Hq + 2 * c.Hkv, c.D}, gen).to(dt);
  return {qkv.narrow(2, 0, c.Hq), qkv.narrow(2, c.Hq, c.Hkv), qkv.narrow(2, c.Hq + c.Hkv, c.Hkv)};
}

TEST(SdpaAttentionOp, MatchesAutogradOfExplicitAttention) {
  REMAT_SKIP_WITHOUT_SDPA();
  for (const Case& c : kCases) {
    for (const bool strided : {true, false}) {
      auto [q, k, v] = fused_qkv(c, at::kDouble, 5);
      if (!strided) std::tie(q, k, v) = std::make_tuple(q.contiguous(), k.contiguous(), v.contiguous());
      const std::string what = c.name() + (strided ? " strided" : "");
      Fwd<SdpaAttentionSaved> f = sdpa_attention_forward(q, k, v);
      EXPECT_TRUE(f.out.is_contiguous()) << what;
      at::Tensor ql = leaf(q), kl = leaf(k), vl = leaf(v);
      at::Tensor ref = attention_reference(ql, kl, vl, 0.0, at::Tensor());
      EXPECT_LT(rel_err(f.out, ref.detach()), 1e-12) << what;
      at::Tensor dout = at::randn(ref.sizes(), seeded(6), f64());
      auto want = grads(ref, dout, {ql, kl, vl});
      AttentionGrads g = sdpa_attention_backward(dout, f.saved);
      EXPECT_TRUE(g.dq.is_contiguous() && g.dk.is_contiguous() && g.dv.is_contiguous()) << what;
      EXPECT_LT(rel_err(g.dq, want[0]), 1e-10) << what;
      EXPECT_LT(rel_err(g.dk, want[1]), 1e-10) << what;
      EXPECT_LT(rel_err(g.dv, want[2]), 1e-10) << what;
    }
  }
}

TEST(SdpaAttentionOp, LogSumExpIsThatOfTheScaledMaskedScores) {
  REMAT_SKIP_WITHOUT_SDPA();
  const Case c{2, 9, 4, 2, 3};
  auto [q, k, v] = fused_qkv(c, at::kDouble, 7);
  auto f = sdpa_attention_forward(q, k, v);
  at::Tensor kh = k.repeat_interleave(2, 2).transpose(1, 2);
  at::Tensor scores = at::matmul(q.transpose(1, 2), kh.transpose(-1, -2)) / std::sqrt(3.0);
  scores.masked_fill_(at::ones({c.T, c.T}, at::kBool).triu(1), -std::numeric_limits<double>::infinity());
  EXPECT_LT(rel_err(f.saved.lse, at::logsumexp(scores, -1).transpose(1, 2)), 1e-13);
}

TEST(SdpaAttentionOp, AgreesWithTheMathAndTiledOps) {
  // Without dropout the three ops compute one function: in float64 to rounding, in float32
  // to float32 rounding, in bfloat16 to its.
  REMAT_SKIP_WITHOUT_SDPA();
  for (const Case& c : kCases) {
    for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16}) {
      const std::string what = fmt::format("{} {}", c.name(), c10::toString(dt));
      auto [q, k, v] = fused_qkv(c, dt, 8);
      auto sdpa = sdpa_attention_forward(q, k, v);
      auto math = attention_forward(q, k, v, 0.0, kKey);
      auto tiled = tiled_attention_forward(q, k, v, 0.0, kKey, {8, 8});
      const double tol = dt == at::kDouble ? 1e-12 : dt == at::kFloat ? 1e-5 : 3e-2;
      EXPECT_EQ(sdpa.out.scalar_type(), dt) << what;
      EXPECT_LT(rel_err(sdpa.out, math.out), tol) << what;
      EXPECT_LT(rel_err(sdpa.saved.lse, tiled.saved.lse.transpose(1, 2)), tol) << what;
      at::Tensor dout = at::randn(q.sizes(), seeded(9)).to(dt);
      AttentionGrads gs = sdpa_attention_backward(dout, sdpa.saved), gm = attention_backward(dout, math.saved);
      EXPECT_EQ(gs.dq.scalar_type(), dt) << what;
      EXPECT_LT(rel_err(gs.dq, gm.dq), 10 * tol) << what;
      EXPECT_LT(rel_err(gs.dk, gm.dk), 10 * tol) << what;
      EXPECT_LT(rel_err(gs.dv, gm.dv), 10 * tol) << what;
    }
  }
}

TEST(SdpaAttentionOp, ARecomputeIsBitwiseTheForward) {
  // What a recompute in the backward regenerates: the same output and log-sum-exp, bit for
  // bit, whatever the thread count; and the backward is as deterministic.
  REMAT_SKIP_WITHOUT_SDPA();
  const Case c{2, 37, 4, 2, 8};
  auto [q, k, v] = fused_qkv(c, at::kFloat, 10);
  const at::Tensor dout = at::randn(q.sizes(), seeded(11));
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  auto a = sdpa_attention_forward(q, k, v);
  AttentionGrads ga = sdpa_attention_backward(dout, a.saved);
  at::set_num_threads(1);
  auto b = sdpa_attention_forward(q, k, v);
  AttentionGrads gb = sdpa_attention_backward(dout, b.saved);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(a.out, b.out));
  EXPECT_TRUE(at::equal(a.saved.lse, b.saved.lse));
  EXPECT_TRUE(at::equal(ga.dq, gb.dq) && at::equal(ga.dk, gb.dk) && at::equal(ga.dv, gb.dv));
}

TEST(SdpaAttentionOp, RunsOnTwoThreadsWithTheBlasAsItWas) {
  // The kernel multiplies its blocks inside its own parallel region; OpenBLAS's OpenMP
  // build, left on several threads there, hangs. The op holds it to one and restores it.
  REMAT_SKIP_WITHOUT_SDPA();
  const Case c{2, 512, 4, 2, 32};
  auto [q, k, v] = fused_qkv(c, at::kFloat, 13);
  // The reference first: a multiply after the thread counts are set back mid-process
  // (which no run does) hangs OpenBLAS 0.3.34's OpenMP build under LibTorch 2.14.
  const at::Tensor expected = attention_forward(q, k, v, 0.0, kKey).out;
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const remat::util::OpenBlas& blas = remat::util::openblas();
  const int blas_threads = blas.get_threads != nullptr ? blas.get_threads() : 0;
  if (blas.set_threads != nullptr) blas.set_threads(2);
  auto f = sdpa_attention_forward(q, k, v);
  const AttentionGrads g = sdpa_attention_backward(at::randn(q.sizes(), seeded(14)), f.saved);
  if (blas.get_threads != nullptr) {
    EXPECT_EQ(blas.get_threads(), 2);
  }
  // A multiply after the op, on its two threads, runs as one before it would.
  const at::Tensor a = at::randn({512, 512}, seeded(15));
  EXPECT_TRUE(at::mm(a, a).isfinite().all().item<bool>());
  if (blas.set_threads != nullptr) blas.set_threads(blas_threads);
  at::set_num_threads(threads);
  EXPECT_LT(rel_err(f.out, expected), 1e-5);
  EXPECT_TRUE(g.dq.isfinite().all().item<bool>());
}

TEST(SdpaAttentionOp, LeavesTheBlasNoMoreThreadsThanAtensPool) {
  // OpenBLAS's OpenMP build splits a multiply for the count it was given and runs it in
  // ATen's pool: given 2 threads beside a pool of 1, its next large multiply never ends.
  REMAT_SKIP_WITHOUT_SDPA();
  const remat::util::OpenBlas& blas = remat::util::openblas();
  if (blas.threading() != remat::util::BlasThreading::openmp)
    GTEST_SKIP() << "ATen's BLAS is not OpenBLAS's OpenMP build";
  const Case c{2, 64, 4, 2, 32};
  auto [q, k, v] = fused_qkv(c, at::kFloat, 15);
  const int threads = at::get_num_threads();
  const int blas_threads = blas.get_threads();
  at::set_num_threads(1);
  blas.set_threads(2);
  auto f = sdpa_attention_forward(q, k, v);
  sdpa_attention_backward(at::randn(q.sizes(), seeded(16)), f.saved);
  EXPECT_EQ(blas.get_threads(), 1);
  blas.set_threads(blas_threads);
  at::set_num_threads(threads);
}

TEST(SdpaAttentionOp, KeepsWhatTiledKeeps) {
  REMAT_SKIP_WITHOUT_SDPA();
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  for (const Case& c : kCases) {
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      auto [q, k, v] = fused_qkv(c, dt, 12);
      const int64_t before = remat::memory::stats(cpu).current;
      auto f = sdpa_attention_forward(q, k, v);
      const int64_t retained = remat::memory::stats(cpu).current - before;
      EXPECT_EQ(tiled_attention_saved_bytes({c.B, c.T, c.Hq, c.Hkv, c.D}, dt), tensors_bytes(f.saved.tensors()));
      EXPECT_TRUE(f.saved.q.is_same(q) && f.saved.k.is_same(k) && f.saved.v.is_same(v) && f.saved.out.is_same(f.out));
      EXPECT_EQ(f.saved.lse.scalar_type(), at::kFloat);
      EXPECT_EQ(retained, tensors_bytes({f.out, f.saved.lse})) << c.name();
    }
  }
}

TEST(SdpaAttentionOp, BlocksAreThoseAtenChoosesAndItsFlopsCountThem) {
  // ATen's blocks: 32, 64 or 256 queries by length and 512 keys, never more than T.
  EXPECT_EQ(sdpa_attention_blocks(9).q, 9);
  EXPECT_EQ(sdpa_attention_blocks(9).k, 9);
  EXPECT_EQ(sdpa_attention_blocks(191).q, 32);
  EXPECT_EQ(sdpa_attention_blocks(192).q, 64);
  EXPECT_EQ(sdpa_attention_blocks(767).q, 64);
  EXPECT_EQ(sdpa_attention_blocks(768).q, 256);
  EXPECT_EQ(sdpa_attention_blocks(768).k, 512);
  // At 1024 positions: four query blocks of 256, each against the key blocks of 512 up to
  // the diagonal (1 + 1 + 2 + 2 blocks), 4 D + 5 FLOPs per score.
  const AttentionShape s{1, 1024, 1, 1, 8};
  EXPECT_EQ(tiled_attention_flops(s, 0.0, sdpa_attention_blocks(1024)), 256.0 * 512 * 6 * (4 * 8 + 5));
}

TEST(SdpaAttentionOp, FlashKeySplitsFollowAtensHeuristic) {
  // Worked by hand on 132 multiprocessors: 1 x 8 heads x 16 query blocks are 128 tiles, under
  // 0.8 of 264 waves, and 8 key blocks of 128; two parts fill 0.97 of a wave (one 0.48), as
  // the best does. Before 2.10 the 128 tiles fill 0.8 of 132 and nothing is split.
  EXPECT_EQ(flash_key_splits(1, 1024, 8, 128, 132), kFlashStateOnDevice ? 2 : 1);
  // One key block (256 positions at head size 64) cannot be split; enough tiles are not.
  EXPECT_EQ(flash_key_splits(1, 256, 8, 64, 132), 1);
  EXPECT_EQ(flash_key_splits(16, 1024, 16, 64, 132), 1);
  // 1 x 2 heads x 32 query blocks = 64 tiles against 264 waves: 16 key blocks of 128; 4 parts
  // fill 0.97, the first within 0.85 of the best.
  EXPECT_EQ(flash_key_splits(1, 2048, 2, 128, 132), kFlashStateOnDevice ? 4 : 2);
}

TEST(SdpaAttentionOp, RefusesWhatItCannotRun) {
  at::Tensor q = at::zeros({2, 4, 6, 8}), kv = at::zeros({2, 4, 4, 8});
  expect_error([&] { sdpa_attention_forward(q, kv, kv); },
               {"[sdpa_attention]", "multiple", "[2, 4, 6, 8]", "[2, 4, 4, 8]"});
  if (!remat::kSdpaBuilt) {
    at::Tensor x = at::zeros({1, 3, 2, 4});
    expect_error([&] { sdpa_attention_forward(x, x, x); },
                 {"model.attention = sdpa needs LibTorch 2.9 or later", "use model.attention = math or tiled"});
  }
}

TEST(SdpaAttentionOp, OnAGpuAgreesWithTheMathOpAndRefusesWhatTheKernelCannotRun) {
  // The flash kernel in bfloat16 against the math op on the same GPU, to bfloat16's rounding
  // as on the CPU; a second forward bit for bit the first. A second backward only to
  // bfloat16's rounding: the kernel adds dq over key blocks atomically, in an order that
  // varies (seen at 1024 positions), so each element may round the other way once.
  REMAT_SKIP_WITHOUT_SDPA();
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU here; scripts/gpu-check.sh runs this where one is";
  const at::Device gpu(at::kCUDA, 0);
  // Heads of a multiple of 8 values, as the kernel takes them; GQA, one position, several
  // key blocks (whose dq the kernel accumulates block by block).
  for (const Case& c : {Case{2, 9, 8, 2, 8}, Case{1, 1, 2, 1, 8}, Case{2, 70, 4, 1, 16}, Case{1, 200, 2, 2, 64},
                        Case{2, 1024, 8, 2, 64}, Case{1, 300, 4, 4, 128}}) {
    const std::string what = c.name();
    auto [qc, kc, vc] = fused_qkv(c, at::kBFloat16, 8);
    const at::Tensor q = qc.to(gpu), k = kc.to(gpu), v = vc.to(gpu);
    auto sdpa = sdpa_attention_forward(q, k, v);
    auto math = attention_forward(q, k, v, 0.0, kKey);
    EXPECT_TRUE(sdpa.out.is_cuda() && sdpa.out.is_contiguous()) << what;
    EXPECT_LT(rel_err(sdpa.out.cpu(), math.out.cpu()), 3e-2) << what;
    EXPECT_EQ(sdpa.saved.lse.scalar_type(), at::kFloat) << what;
    const at::Tensor dout = at::randn(q.sizes(), seeded(9)).to(gpu, at::kBFloat16);
    AttentionGrads gs = sdpa_attention_backward(dout, sdpa.saved), gm = attention_backward(dout, math.saved);
    EXPECT_LT(rel_err(gs.dq.cpu(), gm.dq.cpu()), 3e-1) << what;
    EXPECT_LT(rel_err(gs.dk.cpu(), gm.dk.cpu()), 3e-1) << what;
    EXPECT_LT(rel_err(gs.dv.cpu(), gm.dv.cpu()), 3e-1) << what;
    auto again = sdpa_attention_forward(q, k, v);
    EXPECT_TRUE(at::equal(again.out, sdpa.out) && at::equal(again.saved.lse, sdpa.saved.lse)) << what;
    AttentionGrads g2 = sdpa_attention_backward(dout, again.saved);
    EXPECT_LT(rel_err(g2.dq.cpu(), gs.dq.cpu()), 1e-2) << what;
    EXPECT_TRUE(at::equal(g2.dk, gs.dk) && at::equal(g2.dv, gs.dv)) << what;
  }
  const at::Tensor x = at::zeros({1, 3, 2, 8}, at::TensorOptions(gpu));
  expect_error([&] { sdpa_attention_forward(x, x, x); },
               {"[sdpa_attention]", "flash kernel", "run.dtype is float32", "set run.dtype = bfloat16"});
  const at::Tensor odd = at::zeros({1, 3, 2, 4}, at::TensorOptions(gpu).dtype(at::kBFloat16));
  expect_error([&] { sdpa_attention_forward(odd, odd, odd); },
               {"[sdpa_attention]", "a multiple of 8 values", "model.n_head = 4"});
}

}  // namespace
