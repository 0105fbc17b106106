#include "remat/ops/swiglu.h"

#include "ops/testing.h"

namespace {

using namespace remat::ops;
using namespace remat::testing;

at::Tensor reference(const at::Tensor& gate, const at::Tensor& up) { return gate / (1 + at::exp(-gate)) * up; }

TEST(SwiGLUOp, MatchesAutogradOfTheMath) {
  at::Generator gen = seeded(1);
  for (auto shape : {std::vector<int64_t>{2, 3, 7}, std::vector<int64_t>{5, 1}, std::vector<int64_t>{33}}) {
    at::Tensor gate = at::randn(shape, gen, f64()) * 3, up = at::randn(shape, gen, f64());
    Fwd<SwiGLUSaved> f = swiglu_forward(gate, up);
    at::Tensor gl = leaf(gate), ul = leaf(up);
    at::Tensor ref = reference(gl, ul);
    EXPECT_LT(rel_err(f.out, ref.detach()), 1e-13);
    at::Tensor dy = at::randn(gate.sizes(), gen, gate.options());
    auto want = grads(ref, dy, {gl, ul});
    SwiGLUGrads g = swiglu_backward(dy, f.saved);
    EXPECT_LT(rel_err(g.dgate, want[0]), 1e-10);
    EXPECT_LT(rel_err(g.dup, want[1]), 1e-10);
  }
}

TEST(SwiGLUOp, SavesOnlyGateAndUpAsGiven) {
  at::Generator gen = seeded(1);
  for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16}) {
    for (int64_t F : {1, 24, 37}) {
      // gate and up as halves of one fused projection output, the way the MLP produces them.
      at::Tensor fused = at::randn({3, 2 * F}, gen).to(dt);
      at::Tensor gate = fused.narrow(-1, 0, F), up = fused.narrow(-1, F, F);
      Fwd<SwiGLUSaved> f = swiglu_forward(gate, up);
      EXPECT_EQ(swiglu_saved_bytes(3 * F, dt), tensors_bytes(f.saved.tensors()));
      EXPECT_EQ(f.saved.tensors().size(), 2u);
      EXPECT_TRUE(same_storage(f.saved.gate, fused));
      EXPECT_TRUE(same_storage(f.saved.up, fused));
      EXPECT_FALSE(same_storage(f.out, fused));
    }
  }
  EXPECT_EQ(swiglu_flops(200), 2 * swiglu_flops(100));
  EXPECT_EQ(swiglu_flops(100), 600.0);
}

TEST(SwiGLUOp, BFloat16IsCloseToFloat64) {
  at::Generator gen = seeded(1);
  at::Tensor gate = at::randn({300}, gen).to(at::kBFloat16), up = at::randn({300}, gen).to(at::kBFloat16);
  auto f = swiglu_forward(gate, up);
  EXPECT_LT(rel_err(f.out, reference(gate.to(at::kDouble), up.to(at::kDouble))), 1e-2);
  at::Tensor dy = at::randn({300}, gen).to(at::kBFloat16);
  SwiGLUGrads g = swiglu_backward(dy, f.saved);
  auto g64 = swiglu_backward(dy.to(at::kDouble), swiglu_forward(gate.to(at::kDouble), up.to(at::kDouble)).saved);
  EXPECT_LT(rel_err(g.dgate, g64.dgate), 2e-2);
  EXPECT_LT(rel_err(g.dup, g64.dup), 2e-2);
}

TEST(SwiGLUOp, RefusesMismatchedShapes) {
  at::Generator gen = seeded(1);
  expect_error(
      [&] {
        swiglu_forward(at::randn({2, 8}, gen), at::randn({2, 9}, gen));
      },
      {"[swiglu]", "[2, 8]", "[2, 9]"});
}

}  // namespace
