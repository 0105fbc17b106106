// Tiled attention against autograd of the plain math in float64, against the math op
// (same dropped elements), and its memory: nothing proportional to T^2 is kept or made.
#include "remat/ops/tiled_attention.h"

#include "remat/memory.h"

#include "ops/testing.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

namespace {

using namespace remat::ops;
using namespace remat::testing;

const DropoutKey kKey{11, 2, 0, 3, DropoutSite::attn_probs};

struct Case {
  int64_t B, T, Hq, Hkv, D;
  AttentionTiles tiles;
  std::string name() const {
    return fmt::format("B{} T{} Hq{} Hkv{} D{} tiles {}x{}", B, T, Hq, Hkv, D, tiles.q, tiles.k);
  }
};
// GQA (8 query heads over 2), T = 1, one tile, many tiles, T not a multiple of the tile,
// tiles of one position, unequal query and key tiles.
const Case kCases[] = {{2, 9, 8, 2, 4, {4, 4}},  {1, 1, 2, 1, 2, {4, 4}},  {2, 5, 4, 2, 3, {8, 8}},
                       {1, 13, 3, 3, 4, {3, 3}}, {2, 7, 4, 1, 5, {1, 1}},  {1, 11, 6, 2, 3, {4, 3}},
                       {1, 10, 2, 2, 4, {2, 5}}, {3, 16, 4, 4, 2, {16, 4}}};

// q, k and v as slices of one fused projection output, as the models produce them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_qkv(const Case& c, at::ScalarType dt, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  at::Tensor qkv = at::randn({c.B, c.T, c.Hq + 2 * c.Hkv, c.D}, gen).to(dt);
  return {qkv.narrow(2, 0, c.Hq), qkv.narrow(2, c.Hq, c.Hkv), qkv.narrow(2, c.Hq + c.Hkv, c.Hkv)};
}

TEST(TiledAttentionOp, MatchesAutogradOfExplicitAttention) {
  for (const Case& c : kCases) {
    for (double p : {0.0, 0.3}) {
      auto [q, k, v] = fused_qkv(c, at::kDouble, 5);
      Fwd<TiledAttentionSaved> f = tiled_attention_forward(q, k, v, p, kKey, c.tiles);
      at::Tensor mask = p > 0 ? dropout_mask({c.B, c.Hq, c.T, c.T}, p, kKey, at::kCPU) : at::Tensor();
      at::Tensor ql = leaf(q), kl = leaf(k), vl = leaf(v);
      at::Tensor ref = attention_reference(ql, kl, vl, p, mask);
      const std::string what = c.name() + fmt::format(" p{}", p);
      EXPECT_LT(rel_err(f.out, ref.detach()), 1e-10) << what;
      auto gen = at::detail::createCPUGenerator(6);
      at::Tensor dout = at::randn(ref.sizes(), gen, f64());
      auto want = grads(ref, dout, {ql, kl, vl});
      AttentionGrads g = tiled_attention_backward(dout, f.saved);
      EXPECT_LT(rel_err(g.dq, want[0]), 1e-10) << what;
      EXPECT_LT(rel_err(g.dk, want[1]), 1e-10) << what;
      EXPECT_LT(rel_err(g.dv, want[2]), 1e-10) << what;
    }
  }
}

TEST(TiledAttentionOp, LogSumExpIsThatOfTheScaledMaskedScores) {
  const Case c{2, 9, 4, 2, 3, {4, 2}};
  auto [q, k, v] = fused_qkv(c, at::kDouble, 7);
  auto f = tiled_attention_forward(q, k, v, 0.0, kKey, c.tiles);
  at::Tensor kh = k.repeat_interleave(2, 2).transpose(1, 2);
  at::Tensor scores = at::matmul(q.transpose(1, 2), kh.transpose(-1, -2)) / std::sqrt(3.0);
  scores.masked_fill_(at::ones({c.T, c.T}, at::kBool).triu(1), -std::numeric_limits<double>::infinity());
  EXPECT_LT(rel_err(f.saved.lse, at::logsumexp(scores, -1)), 1e-13);
}

TEST(TiledAttentionOp, DropsTheElementsTheMathOpDrops) {
  // Same key, same elements dropped: the outputs and gradients agree to rounding, in float64
  // tightly and in float32 to float32 rounding; any other mask would differ by O(1).
  for (const Case& c : kCases) {
    for (auto dt : {at::kDouble, at::kFloat}) {
      auto [q, k, v] = fused_qkv(c, dt, 8);
      auto tiled = tiled_attention_forward(q, k, v, 0.4, kKey, c.tiles);
      auto math = attention_forward(q, k, v, 0.4, kKey);
      const double tol = dt == at::kDouble ? 1e-12 : 1e-5;
      EXPECT_LT(rel_err(tiled.out, math.out), tol) << c.name();
      auto gen = at::detail::createCPUGenerator(9);
      at::Tensor dout = at::randn(q.sizes(), gen).to(dt);
      AttentionGrads gt = tiled_attention_backward(dout, tiled.saved), gm = attention_backward(dout, math.saved);
      EXPECT_LT(rel_err(gt.dq, gm.dq), 10 * tol) << c.name();
      EXPECT_LT(rel_err(gt.dk, gm.dk), 10 * tol) << c.name();
      EXPECT_LT(rel_err(gt.dv, gm.dv), 10 * tol) << c.name();
    }
  }
}

// Rows [1, 3) of a batch of 3, keyed as such (a data-parallel rank's share), drop the
// elements the whole batch drops there: both ops give those rows' outputs.
TEST(TiledAttentionOp, ARowShardDropsTheWholeBatchsElements) {
  const Case c{3, 9, 4, 2, 4, {4, 4}};
  auto [q, k, v] = fused_qkv(c, at::kDouble, 8);
  DropoutKey shard_key = kKey;
  shard_key.first_row = 1;
  const auto rows = [](const at::Tensor& t) { return t.narrow(0, 1, 2); };
  const at::Tensor whole = tiled_attention_forward(q, k, v, 0.4, kKey, c.tiles).out;
  const at::Tensor tiled = tiled_attention_forward(rows(q), rows(k), rows(v), 0.4, shard_key, c.tiles).out;
  const at::Tensor math = attention_forward(rows(q), rows(k), rows(v), 0.4, shard_key).out;
  EXPECT_LT(rel_err(tiled, rows(whole)), 1e-12);
  EXPECT_LT(rel_err(math, rows(whole)), 1e-12);
}

TEST(TiledAttentionOp, ARecomputeIsBitwiseTheForward) {
  // What a recompute in the backward regenerates: the same output and log-sum-exp, bit for
  // bit, whatever the thread count.
  const Case c{2, 37, 4, 2, 8, {8, 16}};
  auto [q, k, v] = fused_qkv(c, at::kFloat, 10);
  at::set_num_threads(2);
  auto a = tiled_attention_forward(q, k, v, 0.2, kKey, c.tiles);
  at::set_num_threads(1);
  auto b = tiled_attention_forward(q, k, v, 0.2, kKey, c.tiles);
  EXPECT_TRUE(at::equal(a.out, b.out));
  EXPECT_TRUE(at::equal(a.saved.lse, b.saved.lse));
  DropoutKey other = kKey;
  other.step += 1;
  auto d = tiled_attention_forward(q, k, v, 0.2, other, c.tiles);
  EXPECT_FALSE(at::equal(a.out, d.out)) << "another key must drop other elements";
}

TEST(TiledAttentionOp, KeepsTheOutputAndOneLogSumExpPerRowOnly) {
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  for (const Case& c : kCases) {
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      auto [q, k, v] = fused_qkv(c, dt, 11);
      const int64_t before = remat::memory::stats(cpu).current;
      auto f = tiled_attention_forward(q, k, v, 0.1, kKey, c.tiles);
      const int64_t retained = remat::memory::stats(cpu).current - before;
      EXPECT_EQ(tiled_attention_saved_bytes({c.B, c.T, c.Hq, c.Hkv, c.D}, dt), tensors_bytes(f.saved.tensors()));
      EXPECT_TRUE(f.saved.q.is_same(q) && f.saved.k.is_same(k) && f.saved.v.is_same(v) && f.saved.out.is_same(f.out));
      EXPECT_EQ(f.saved.lse.scalar_type(), at::kFloat);
      EXPECT_EQ(retained, tensors_bytes({f.out, f.saved.lse})) << c.name();
    }
  }
}

TEST(TiledAttentionOp, WorkingSetIsBoundedByTheTiles) {
  // At T = 1024 with 32-position tiles, the forward and the backward each make less than an
  // eighth of one [B, Hq, T, T] score tensor (the math op makes several).
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  const Case c{1, 1024, 4, 2, 8, {32, 32}};
  auto [q, k, v] = fused_qkv(c, at::kFloat, 12);
  const int64_t scores = c.B * c.Hq * c.T * c.T * 4;
  int64_t before = remat::memory::stats(cpu).current;
  remat::memory::reset_peak(cpu);
  auto f = tiled_attention_forward(q, k, v, 0.1, kKey, c.tiles);
  EXPECT_LT(remat::memory::stats(cpu).peak - before, scores / 8);
  at::Tensor dout = at::randn(q.sizes());
  before = remat::memory::stats(cpu).current;
  remat::memory::reset_peak(cpu);
  AttentionGrads g = tiled_attention_backward(dout, f.saved);
  EXPECT_LT(remat::memory::stats(cpu).peak - before, scores / 8);
}

TEST(TiledAttentionOp, FlopsMatchTheMatmulsItRuns) {
  for (const Case& c : kCases) {
    for (double p : {0.0, 0.2}) {
      auto [q, k, v] = fused_qkv(c, at::kFloat, 13);
      MatmulFlopCounter counter;
      tiled_attention_forward(q, k, v, p, kKey, c.tiles);
      const AttentionShape shape{c.B, c.T, c.Hq, c.Hkv, c.D};
      const double flops = tiled_attention_flops(shape, p, c.tiles);
      // flops = (4 D + 5 + [p > 0]) per computed score; the matmuls are the 4 D.
      const double per_score = 4.0 * c.D + 5 + (p > 0 ? 1 : 0);
      EXPECT_DOUBLE_EQ(counter.flops(), flops / per_score * 4.0 * c.D) << c.name();
    }
  }
  // Tiles above the diagonal are skipped: one-position tiles compute T (T + 1) / 2 scores
  // per head, a single tile all T^2.
  const AttentionShape s{1, 64, 1, 1, 1};
  EXPECT_EQ(tiled_attention_flops(s, 0.0, {1, 1}), 9.0 * 64 * 65 / 2);
  EXPECT_EQ(tiled_attention_flops(s, 0.0, {64, 64}), 9.0 * 64 * 64);
}

TEST(TiledAttentionOp, BFloat16IsCloseToFloat64) {
  const Case c{2, 16, 4, 2, 8, {4, 4}};
  auto [q, k, v] = fused_qkv(c, at::kBFloat16, 14);
  auto f = tiled_attention_forward(q, k, v, 0.0, kKey, c.tiles);
  auto f64r = tiled_attention_forward(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), 0.0, kKey, c.tiles);
  EXPECT_EQ(f.out.scalar_type(), at::kBFloat16);
  EXPECT_LT(rel_err(f.out, f64r.out), 3e-2);
  auto gen = at::detail::createCPUGenerator(15);
  at::Tensor dout = at::randn({c.B, c.T, c.Hq, c.D}, gen).to(at::kBFloat16);
  AttentionGrads g = tiled_attention_backward(dout, f.saved);
  AttentionGrads g64 = tiled_attention_backward(dout.to(at::kDouble), f64r.saved);
  EXPECT_EQ(g.dq.scalar_type(), at::kBFloat16);
  EXPECT_LT(rel_err(g.dq, g64.dq), 5e-2);
  EXPECT_LT(rel_err(g.dk, g64.dk), 5e-2);
  EXPECT_LT(rel_err(g.dv, g64.dv), 5e-2);
}

TEST(TiledAttentionOp, RefusesBadShapesAndTiles) {
  at::Tensor q = at::zeros({2, 4, 6, 8}), kv = at::zeros({2, 4, 4, 8});
  expect_error([&] { tiled_attention_forward(q, kv, kv, 0.0, kKey); },
               {"[tiled_attention]", "multiple", "[2, 4, 6, 8]", "[2, 4, 4, 8]"});
  at::Tensor k3 = at::zeros({2, 4, 3, 8});
  expect_error(
      [&] {
        tiled_attention_forward(q, k3, k3, 0.0, kKey, {0, 4});
      },
      {"[tiled_attention]", "at least one", "0 x 4"});
  expect_error([&] { tiled_attention_forward(q, k3, k3, 1.0, kKey); }, {"[dropout]"});
  auto f = tiled_attention_forward(q, k3, k3, 0.0, kKey);
  expect_error(
      [&] {
        tiled_attention_backward(at::zeros({2, 4, 6, 7}), f.saved);
      },
      {"[tiled_attention]", "[2, 4, 6, 7]"});
}

}  // namespace
