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

// Three projections of one input, against autograd of three plain linears: the outputs,
// the summed input gradient and each weight's gradient, added to what the accumulators held.
TEST(LinearsOp, MatchesAutogradOfTheSeparateLinears) {
  at::Generator gen = seeded(2);
  for (int64_t T : {1, 5}) {
    at::Tensor x = at::randn({2, T, 6}, gen, f64());
    std::vector<at::Tensor> ws = {at::randn({6, 6}, gen, f64()), at::randn({2, 6}, gen, f64()),
                                  at::randn({3, 6}, gen, f64())};
    std::vector<at::Tensor> ys = linears_forward(x, ws);
    ASSERT_EQ(ys.size(), ws.size());
    at::Tensor xl = leaf(x);
    std::vector<at::Tensor> wl, dys;
    at::Tensor loss = at::zeros({}, f64());
    for (size_t i = 0; i < ws.size(); ++i) {
      wl.push_back(leaf(ws[i]));
      at::Tensor ref = (xl.unsqueeze(-2) * wl[i]).sum(-1);
      EXPECT_LT(rel_err(ys[i], ref.detach()), 1e-13) << i;
      dys.push_back(at::randn(ref.sizes(), gen, f64()));
      loss = loss + (ref * dys[i]).sum();
    }
    std::vector<at::Tensor> inputs = {xl};
    inputs.insert(inputs.end(), wl.begin(), wl.end());
    auto want = grads(loss, at::ones({}, f64()), inputs);
    std::vector<at::Tensor> dw, before;
    std::vector<at::Tensor*> dwp;
    for (const auto& w : ws) {
      dw.push_back(at::randn(w.sizes(), gen, f64()));
      before.push_back(dw.back().clone());
    }
    for (auto& d : dw) dwp.push_back(&d);
    at::Tensor dx = linears_backward(dys, LinearSaved{x}, ws, dwp);
    EXPECT_EQ(dx.sizes(), x.sizes());
    EXPECT_LT(rel_err(dx, want[0]), 1e-10);
    for (size_t i = 0; i < ws.size(); ++i) EXPECT_LT(rel_err(dw[i] - before[i], want[i + 1]), 1e-10) << i;
  }
}

// The forward's FLOPs are its GEMMs', one per weight, as separate linears count them.
TEST(LinearsOp, MatmulFlopsAreTheSeparateLinears) {
  at::Generator gen = seeded(3);
  at::Tensor x = at::randn({4, 3, 16}, gen);
  std::vector<at::Tensor> ws = {at::randn({16, 16}, gen), at::randn({4, 16}, gen)};
  MatmulFlopCounter counter;
  linears_forward(x, ws);
  EXPECT_EQ(counter.flops(), linear_flops(12, 16, 16, false) + linear_flops(12, 16, 4, false));
}

}  // namespace
