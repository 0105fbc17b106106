#include "remat/ops/linear.h"

#include "ops/testing.h"

namespace {

using namespace remat::ops;
using namespace remat::testing;

TEST(LinearOp, MatchesAutogradOfTheMath) {
  at::Generator gen = seeded(1);
  for (bool bias : {true, false}) {
    at::Tensor x = at::randn({2, 3, 5}, gen, f64()), w = at::randn({7, 5}, gen, f64()), b = at::randn({7}, gen, f64());
    Fwd<LinearSaved> f = linear_forward(x, w, bias ? b : at::Tensor());
    at::Tensor xl = leaf(x), wl = leaf(w), bl = leaf(b);
    at::Tensor ref = (xl.unsqueeze(-2) * wl).sum(-1) + (bias ? bl : at::zeros({7}, f64()));
    EXPECT_LT(rel_err(f.out, ref.detach()), 1e-13);
    at::Tensor dy = at::randn(ref.sizes(), gen, ref.options());
    auto want = bias ? grads(ref, dy, {xl, wl, bl}) : grads(ref, dy, {xl, wl});
    at::Tensor dw = at::zeros({7, 5}, f64()), db = at::zeros({7}, f64());
    at::Tensor dx = linear_backward(dy, f.saved, w, dw, bias ? &db : nullptr);
    EXPECT_LT(rel_err(dx, want[0]), 1e-10);
    EXPECT_LT(rel_err(dw, want[1]), 1e-10);
    if (bias) {
      EXPECT_LT(rel_err(db, want[2]), 1e-10);
    }
  }
}

TEST(LinearOp, SavedBytesAndMatmulFlops) {
  at::Generator gen = seeded(1);
  for (auto [rows, in, out] : {std::tuple<int64_t, int64_t, int64_t>{6, 5, 7}, {1, 16, 3}, {33, 8, 8}}) {
    for (bool bias : {true, false}) {
      at::Tensor x = at::randn({rows, in}, gen), w = at::randn({out, in}, gen);
      MatmulFlopCounter counter;
      Fwd<LinearSaved> f = linear_forward(x, w, bias ? at::randn({out}, gen) : at::Tensor());
      EXPECT_EQ(linear_saved_bytes(rows, in, at::kFloat), tensors_bytes(f.saved.tensors()));
      const double bias_adds = bias ? double(rows * out) : 0.0;
      EXPECT_EQ(linear_flops(rows, in, out, bias) - bias_adds, counter.flops());
      EXPECT_GT(counter.flops(), 0.0);
    }
  }
}

}  // namespace
