#include "remat/ops/attention.h"

#include "remat/memory.h"

#include "ops/testing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace {

using namespace remat::ops;
using namespace remat::testing;

const DropoutKey kKey{11, 2, 0, 3, DropoutSite::attn_probs};

struct Case {
  int64_t B, T, Hq, Hkv, D;
};
const Case kCases[] = {{2, 5, 4, 2, 3}, {1, 7, 3, 3, 4}, {3, 4, 6, 1, 5}, {1, 1, 2, 1, 2}, {2, 9, 8, 2, 8}};

// q, k and v as slices of one fused projection output, as the models produce them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_qkv(const Case& c, at::ScalarType dt, at::Generator& gen) {
  at::Tensor qkv = at::randn({c.B, c.T, c.Hq + 2 * c.Hkv, c.D}, gen).to(dt);
  return {qkv.narrow(2, 0, c.Hq), qkv.narrow(2, c.Hq, c.Hkv), qkv.narrow(2, c.Hq + c.Hkv, c.Hkv)};
}

// Positions per block: one (every block on the diagonal), a few (the last one short), and
// the default (one block at these lengths).
const int64_t kBlocks[] = {1, 2, 3, kAttentionBlock};

std::string describe(const Case& c, double p, int64_t block) {
  return "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " Hq" + std::to_string(c.Hq) + " Hkv" +
         std::to_string(c.Hkv) + " p" + std::to_string(p) + " block" + std::to_string(block);
}

TEST(AttentionOp, MatchesAutogradOfExplicitAttention) {
  at::Generator gen = seeded(1);
  for (const Case& c : kCases) {
    for (double p : {0.0, 0.3}) {
      for (int64_t block : kBlocks) {
        auto [q, k, v] = fused_qkv(c, at::kDouble, gen);
        Fwd<AttentionSaved> f = attention_forward(q, k, v, p, kKey, block);
        at::Tensor mask = p > 0 ? dropout_mask({c.B, c.Hq, c.T, c.T}, p, kKey, at::kCPU) : at::Tensor();
        if (p > 0) {
          EXPECT_TRUE(at::equal(f.saved.mask, mask));
        }
        at::Tensor ql = leaf(q), kl = leaf(k), vl = leaf(v);
        at::Tensor ref = attention_reference(ql, kl, vl, p, mask);
        const std::string what = describe(c, p, block);
        EXPECT_LT(rel_err(f.out, ref.detach()), 1e-12) << what;
        at::Tensor dout = at::randn(ref.sizes(), gen, ref.options());
        auto want = grads(ref, dout, {ql, kl, vl});
        AttentionGrads g = attention_backward(dout, f.saved, block);
        EXPECT_LT(rel_err(g.dq, want[0]), 1e-10) << what;
        EXPECT_LT(rel_err(g.dk, want[1]), 1e-10) << what;
        EXPECT_LT(rel_err(g.dv, want[2]), 1e-10) << what;
      }
    }
  }
}

// probs holds whole rows in the grouped order [B, Hkv, T, G, T]: each query's softmax over
// the keys up to it, zeros after, whatever the block (the blocks above the diagonal are
// never computed, so they must be written as zeros).
TEST(AttentionOp, ProbsAreTheCausalSoftmaxInGroupedRows) {
  at::Generator gen = seeded(4);
  for (const Case& c : kCases) {
    for (int64_t block : kBlocks) {
      auto [q, k, v] = fused_qkv(c, at::kDouble, gen);
      const at::Tensor probs = attention_forward(q, k, v, 0.0, kKey, block).saved.probs;
      const int64_t G = c.Hq / c.Hkv;
      ASSERT_EQ(probs.sizes(), (std::vector<int64_t>{c.B, c.Hkv, c.T, G, c.T})) << describe(c, 0.0, block);
      // The reference in the heads' order [B, Hq, T, T], then grouped: [B, Hkv, G, T, T] -> [B, Hkv, T, G, T].
      at::Tensor scores = at::matmul(q.transpose(1, 2), k.repeat_interleave(G, 2).permute({0, 2, 3, 1})) /
                          std::sqrt(static_cast<double>(c.D));
      scores.masked_fill_(at::ones({c.T, c.T}, at::kBool).triu(1), -std::numeric_limits<double>::infinity());
      const at::Tensor want = scores.softmax(-1).view({c.B, c.Hkv, G, c.T, c.T}).permute({0, 1, 3, 2, 4});
      EXPECT_LT((probs - want).abs().max().item<double>(), 1e-14) << describe(c, 0.0, block);
      EXPECT_EQ(probs.masked_select(want == 0).abs().sum().item<double>(), 0.0) << describe(c, 0.0, block);
    }
  }
}

TEST(AttentionOp, SavesInputsAsGivenAndNoScores) {
  remat::memory::install_cpu_tracking();
  const at::Device cpu(at::kCPU);
  at::Generator gen = seeded(1);
  for (const Case& c : kCases) {
    for (double p : {0.0, 0.1}) {
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        auto [q, k, v] = fused_qkv(c, dt, gen);
        const int64_t before = remat::memory::stats(cpu).current;
        Fwd<AttentionSaved> f = attention_forward(q, k, v, p, kKey);
        const int64_t retained = remat::memory::stats(cpu).current - before;
        const AttentionShape shape{c.B, c.T, c.Hq, c.Hkv, c.D};
        EXPECT_EQ(attention_saved_bytes(shape, p, dt), tensors_bytes(f.saved.tensors()));
        EXPECT_TRUE(f.saved.q.is_same(q) && f.saved.k.is_same(k) && f.saved.v.is_same(v));
        EXPECT_EQ(f.saved.probs.sizes(), (std::vector<int64_t>{c.B, c.Hkv, c.T, c.Hq / c.Hkv, c.T}));
        // Rows of probs sum to one: it is the softmax output, not the scores.
        EXPECT_LT((f.saved.probs.to(at::kDouble).sum(-1) - 1).abs().max().item<double>(), 1e-2);
        EXPECT_EQ(f.saved.mask.defined(), p > 0);
        EXPECT_EQ(f.saved.probs_d.defined(), p > 0);
        // Nothing beyond the output and the new Saved tensors stays allocated: the scores
        // and the working copies of q, k, v are gone.
        const int64_t inputs = tensors_bytes({q, k, v});
        EXPECT_EQ(retained, tensors_bytes({f.out}) + tensors_bytes(f.saved.tensors()) - inputs);
        EXPECT_FALSE(same_storage(f.saved.probs, f.saved.probs_d));
      }
    }
  }
}

TEST(AttentionOp, FlopsMatchTheMatmulsItRuns) {
  at::Generator gen = seeded(1);
  for (const Case& c : kCases) {
    for (double p : {0.0, 0.2}) {
      for (int64_t block : kBlocks) {
        auto [q, k, v] = fused_qkv(c, at::kFloat, gen);
        MatmulFlopCounter counter;
        attention_forward(q, k, v, p, kKey, block);
        const AttentionShape shape{c.B, c.T, c.Hq, c.Hkv, c.D};
        // Counted here: query positions [t0, t0 + n) of each block read keys [0, t0 + n).
        double scores = 0;
        for (int64_t t0 = 0; t0 < c.T; t0 += block) {
          const int64_t n = std::min(block, c.T - t0);
          scores += double(c.B) * c.Hq * n * (t0 + n);
        }
        EXPECT_EQ(attention_causal_scores(shape, block), scores) << describe(c, p, block);
        // Beyond the matmuls: 5 FLOPs per score for the softmax, 1 for dropout.
        const double rest = 5 * scores + (p > 0 ? scores : 0.0);
        EXPECT_EQ(attention_flops(shape, p, block) - rest, counter.flops()) << describe(c, p, block);
        EXPECT_EQ(counter.flops(), 4.0 * scores * c.D) << describe(c, p, block);
      }
    }
  }
  // One position per block computes the lower triangle and the diagonal only.
  EXPECT_EQ(attention_causal_scores({1, 64, 1, 1, 8}, 1), 64.0 * 65 / 2);
  EXPECT_EQ(attention_causal_scores({1, 64, 1, 1, 8}, 64), 64.0 * 64);
}

TEST(AttentionOp, BFloat16IsCloseToFloat64) {
  const Case c{2, 16, 4, 2, 8};
  at::Generator gen = seeded(1);
  auto [q, k, v] = fused_qkv(c, at::kBFloat16, gen);
  auto f = attention_forward(q, k, v, 0.0, kKey);
  auto f64r = attention_forward(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), 0.0, kKey);
  EXPECT_EQ(f.out.scalar_type(), at::kBFloat16);
  EXPECT_LT(rel_err(f.out, f64r.out), 3e-2);
  at::Tensor dout = at::randn({c.B, c.T, c.Hq, c.D}, gen).to(at::kBFloat16);
  AttentionGrads g = attention_backward(dout, f.saved);
  AttentionGrads g64 = attention_backward(dout.to(at::kDouble), f64r.saved);
  EXPECT_LT(rel_err(g.dq, g64.dq), 5e-2);
  EXPECT_LT(rel_err(g.dk, g64.dk), 5e-2);
  EXPECT_LT(rel_err(g.dv, g64.dv), 5e-2);
}

TEST(AttentionOp, RefusesMismatchedShapes) {
  at::Generator gen = seeded(1);
  at::Tensor q = at::randn({2, 4, 6, 8}, gen), kv = at::randn({2, 4, 4, 8}, gen);
  expect_error([&] { attention_forward(q, kv, kv, 0.0, kKey); },
               {"[attention]", "multiple", "[2, 4, 6, 8]", "[2, 4, 4, 8]"});
  at::Tensor k5 = at::randn({2, 5, 3, 8}, gen);
  expect_error([&] { attention_forward(q, k5, k5, 0.0, kKey); }, {"[attention]", "B, T and D", "[2, 5, 3, 8]"});
  at::Tensor k3 = at::randn({2, 4, 3, 8}, gen);
  expect_error(
      [&] {
        attention_forward(q, k3, at::randn({2, 4, 3, 7}, gen), 0.0, kKey);
      },
      {"[attention]", "same shape", "[2, 4, 3, 7]"});
  expect_error([&] { attention_forward(at::randn({4, 6, 8}, gen), k3, k3, 0.0, kKey); }, {"[attention]", "[4, 6, 8]"});
  expect_error([&] { attention_forward(q, k3, k3, 1.0, kKey); }, {"[dropout]"});
  auto f = attention_forward(q, k3, k3, 0.0, kKey);
  expect_error([&] { attention_backward(at::randn({2, 4, 6, 7}, gen), f.saved); }, {"[attention]", "[2, 4, 6, 7]"});
}

}  // namespace
