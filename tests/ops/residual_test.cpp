#include "remat/ops/residual.h"

#include "ops/testing.h"

namespace {

using namespace remat::ops;
using namespace remat::testing;

TEST(ResidualOp, MatchesAutogradOfAdd) {
  at::Generator gen = seeded(1);
  at::Tensor a = at::randn({2, 5, 3}, gen, f64()), b = at::randn({2, 5, 3}, gen, f64());
  Fwd<ResidualSaved> f = residual_forward(a, b);
  EXPECT_TRUE(f.saved.tensors().empty());
  at::Tensor al = leaf(a), bl = leaf(b);
  at::Tensor ref = al + bl;
  EXPECT_LT(rel_err(f.out, ref.detach()), 1e-16);
  at::Tensor dy = at::randn(a.sizes(), gen, a.options());
  auto want = grads(ref, dy, {al, bl});
  at::Tensor d = residual_backward(dy, f.saved);
  EXPECT_TRUE(at::equal(d, want[0]));
  EXPECT_TRUE(at::equal(d, want[1]));
}

TEST(ResidualOp, BroadcastsBOverLeadingDims) {
  at::Generator gen = seeded(1);
  // Token embeddings [B, T, C] plus position embeddings [T, C].
  at::Tensor a = at::randn({3, 4, 2}, gen), b = at::randn({4, 2}, gen);
  EXPECT_TRUE(at::equal(residual_forward(a, b).out, a + b));
}

TEST(ResidualOp, FlopsAndRefusals) {
  EXPECT_EQ(residual_flops(200), 2 * residual_flops(100));
  EXPECT_EQ(residual_flops(100), 100.0);
  at::Generator gen = seeded(1);
  expect_error(
      [&] {
        residual_forward(at::randn({2, 3}, gen), at::randn({2, 4}, gen));
      },
      {"[residual]", "[2, 3]", "[2, 4]"});
  expect_error([&] { residual_forward(at::randn({3}, gen), at::randn({2, 3}, gen)); }, {"[residual]"});
}

}  // namespace
