#include "remat/ops/gelu.h"

#include "ops/testing.h"

#include <cmath>

namespace {

using namespace remat::ops;
using namespace remat::testing;

at::Tensor reference(const at::Tensor& x) {
  return 0.5 * x * (1 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
}

TEST(GeluOp, MatchesAutogradOfTheTanhFormula) {
  at::Generator gen = seeded(1);
  for (auto shape : {std::vector<int64_t>{2, 3, 7}, std::vector<int64_t>{1}, std::vector<int64_t>{129}}) {
    at::Tensor x = at::randn(shape, gen, f64()) * 3;
    Fwd<GeluSaved> f = gelu_forward(x);
    at::Tensor xl = leaf(x);
    at::Tensor ref = reference(xl);
    EXPECT_LT(rel_err(f.out, ref.detach()), 1e-13);
    at::Tensor dy = at::randn(x.sizes(), gen, x.options());
    EXPECT_LT(rel_err(gelu_backward(dy, f.saved), grads(ref, dy, {xl})[0]), 1e-10);
  }
}

TEST(GeluOp, SavesOnlyTheInput) {
  at::Generator gen = seeded(1);
  for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16}) {
    for (int64_t n : {1, 37, 256}) {
      at::Tensor x = at::randn({n}, gen).to(dt);
      Fwd<GeluSaved> f = gelu_forward(x);
      EXPECT_EQ(gelu_saved_bytes(n, dt), tensors_bytes(f.saved.tensors()));
      EXPECT_TRUE(same_storage(f.saved.x, x));
    }
  }
  EXPECT_EQ(gelu_flops(200), 2 * gelu_flops(100));
  EXPECT_EQ(gelu_flops(100), 1000.0);
}

TEST(GeluOp, BFloat16IsCloseToFloat64) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({300}, gen).to(at::kBFloat16);
  EXPECT_LT(rel_err(gelu_forward(x).out, reference(x.to(at::kDouble))), 1e-2);
}

TEST(GeluOp, RefusesMismatchedGradient) {
  at::Generator gen = seeded(1);
  auto f = gelu_forward(at::randn({3, 4}, gen));
  expect_error([&] { gelu_backward(at::randn({4, 3}, gen), f.saved); }, {"[gelu]", "[3, 4]", "[4, 3]"});
}

}  // namespace
