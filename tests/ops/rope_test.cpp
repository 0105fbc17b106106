#include "remat/ops/rope.h"

#include "ops/testing.h"

#include <cmath>

namespace {

using namespace remat::ops;
using namespace remat::testing;

const at::Device kCPU(at::kCPU);

// Llama 3.1's frequency scaling, one frequency at a time in the branches of Meta's
// reference (llama-models' apply_scaling): kept, divided by the factor, or blended.
double scaled_frequency(double freq, const remat::RopeScaling& s) {
  const double old_len = static_cast<double>(s.original_max_seq);
  const double wavelen = 2 * M_PI / freq;
  if (wavelen < old_len / s.high_freq_factor) return freq;
  if (wavelen > old_len / s.low_freq_factor) return freq / s.factor;
  const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1 - smooth) * freq / s.factor + smooth * freq;
}

// Tables from the definition, element by element: angle(t, i) = t * theta^(-2i/D), its
// frequency scaled where `scaling` says.
RopeTables loop_tables(int64_t T, int64_t D, double theta, const remat::RopeScaling& scaling = {}) {
  at::Tensor c = at::empty({T, D / 2}, f64()), s = at::empty({T, D / 2}, f64());
  auto ca = c.accessor<double, 2>();
  auto sa = s.accessor<double, 2>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double freq = std::pow(theta, -2.0 * i / D);
      const double angle = t * (scaling.scaled() ? scaled_frequency(freq, scaling) : freq);
      ca[t][i] = std::cos(angle);
      sa[t][i] = std::sin(angle);
    }
  }
  return {c, s};
}

// The Hugging Face formulation: x * cos + rotate_half(x) * sin with [T, D] tables.
at::Tensor reference(const at::Tensor& x, const RopeTables& tab) {
  const int64_t T = x.size(1), half = x.size(3) / 2;
  at::Tensor cos = at::cat({tab.cos, tab.cos}, -1).slice(0, 0, T).view({1, T, 1, 2 * half});
  at::Tensor sin = at::cat({tab.sin, tab.sin}, -1).slice(0, 0, T).view({1, T, 1, 2 * half});
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

TEST(RopeOp, TablesMatchTheDefinition) {
  RopeTables t = rope_tables(9, 6, 10000.0, {}, at::kDouble, kCPU);
  RopeTables want = loop_tables(9, 6, 10000.0);
  EXPECT_LT(rel_err(t.cos, want.cos), 1e-14);
  EXPECT_LT(rel_err(t.sin, want.sin), 1e-14);
  EXPECT_EQ(rope_tables(4, 8, 500000.0, {}, at::kBFloat16, kCPU).cos.scalar_type(), at::kBFloat16);
}

// Llama 3.1 8B's scaling (factor 8, 1 and 4, 8192 positions) on a head of 64: its 32
// frequencies fall in all three of the formula's ranges, so each branch is held to it.
TEST(RopeOp, ScaledTablesFollowLlama3sFormula) {
  remat::RopeScaling llama31;
  llama31.factor = 8;
  int kept = 0, divided = 0;
  for (int64_t i = 0; i < 32; ++i) {
    const double freq = std::pow(500000.0, -2.0 * i / 64);
    kept += scaled_frequency(freq, llama31) == freq;
    divided += scaled_frequency(freq, llama31) == freq / 8;
  }
  ASSERT_GT(kept, 0);
  ASSERT_GT(divided, 0);
  ASSERT_LT(kept + divided, 32);
  const int64_t T = 20000;  // past the 8192 positions it was first trained at
  RopeTables t = rope_tables(T, 64, 500000.0, llama31, at::kDouble, kCPU);
  RopeTables want = loop_tables(T, 64, 500000.0, llama31);
  EXPECT_LT(rel_err(t.cos, want.cos), 1e-12);
  EXPECT_LT(rel_err(t.sin, want.sin), 1e-12);
  EXPECT_GT(rel_err(t.cos, rope_tables(T, 64, 500000.0, {}, at::kDouble, kCPU).cos), 0.1);
}

TEST(RopeOp, MatchesAutogradOfRotateHalf) {
  struct Case {
    int64_t B, T, H, D, table_len;
  };
  at::Generator gen = seeded(1);
  for (Case c : {Case{2, 5, 3, 8, 5}, Case{1, 7, 2, 2, 12}, Case{3, 1, 1, 6, 4}}) {
    RopeTables tab = rope_tables(c.table_len, c.D, 10000.0, {}, at::kDouble, kCPU);
    // A non-contiguous view, as q and k are slices of a fused qkv projection.
    at::Tensor fused = at::randn({c.B, c.T, 3 * c.H, c.D}, gen, f64());
    at::Tensor x = fused.narrow(2, c.H, c.H);
    Fwd<RopeSaved> f = rope_forward(x, tab);
    EXPECT_TRUE(f.saved.tensors().empty());
    at::Tensor xl = leaf(x);
    at::Tensor ref = reference(xl, loop_tables(c.table_len, c.D, 10000.0));
    EXPECT_LT(rel_err(f.out, ref.detach()), 1e-13);
    at::Tensor dy = at::randn(ref.sizes(), gen, ref.options());
    EXPECT_LT(rel_err(rope_backward(dy, f.saved, tab), grads(ref, dy, {xl})[0]), 1e-10);
  }
}

TEST(RopeOp, FlopsAreProportionalToNumel) {
  EXPECT_EQ(rope_flops(200), 2 * rope_flops(100));
  EXPECT_EQ(rope_flops(100), 300.0);
}

TEST(RopeOp, RefusesShortTablesAndOddHeads) {
  RopeTables tab = rope_tables(4, 8, 10000.0, {}, at::kFloat, kCPU);
  at::Generator gen = seeded(1);
  expect_error([&] { rope_forward(at::randn({1, 5, 2, 8}, gen), tab); }, {"[rope]", "[1, 5, 2, 8]", "[4, 4]"});
  expect_error([&] { rope_forward(at::randn({1, 4, 2, 6}, gen), tab); }, {"[rope]", "[1, 4, 2, 6]"});
  expect_error([&] { rope_forward(at::randn({4, 2, 8}, gen), tab); }, {"[rope]", "[B, T, H, D]"});
  expect_error([&] { rope_tables(4, 7, 10000.0, {}, at::kFloat, kCPU); }, {"[rope]", "head_dim 7"});
}

}  // namespace
