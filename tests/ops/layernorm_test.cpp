#include "remat/ops/layernorm.h"

#include "remat/memory.h"

#include "ops/testing.h"

namespace {

using namespace remat::ops;
using namespace remat::testing;

// LayerNorm written as math: biased variance over the last dim.
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  at::Tensor mean = x.mean(-1, true);
  at::Tensor var = (x - mean).pow(2).mean(-1, true);
  return (x - mean) / at::sqrt(var + eps) * w + b;
}

TEST(LayerNormOp, MatchesAutogradOfTheMath) {
  const double eps = 1e-5;
  at::Generator gen = seeded(1);
  for (auto shape : {std::vector<int64_t>{2, 3, 7}, std::vector<int64_t>{5, 16}, std::vector<int64_t>{13},
                     std::vector<int64_t>{3, 1}}) {
    const int64_t C = shape.back();
    at::Tensor x = at::randn(shape, gen, f64()) * 3 + 1, w = at::randn({C}, gen, f64()), b = at::randn({C}, gen, f64());
    Fwd<LayerNormSaved> f = layernorm_forward(x, w, b, eps);
    at::Tensor xl = leaf(x), wl = leaf(w), bl = leaf(b);
    at::Tensor ref = reference(xl, wl, bl, eps);
    at::Tensor dy = at::randn(x.sizes(), gen, x.options());
    auto want = grads(ref, dy, {xl, wl, bl});
    at::Tensor dw = at::ones({C}, f64()), db = at::ones({C}, f64());
    at::Tensor dx = layernorm_backward(dy, f.saved, w, dw, db);
    // Every result is held to the size of the terms that cancel in it, not to its own:
    // xhat = (x - mean) rstd rounds like (|x| + |mean|) rstd, which is far more than xhat
    // when a row's variance is small (with C == 1 it is 0 and rstd = 1/sqrt(eps));
    // dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w cancels; dw and db sum
    // signed terms over rows onto the existing 1s.
    const at::Tensor rstd = f.saved.rstd.unsqueeze(-1);
    const at::Tensor xhat = (x - f.saved.mean.unsqueeze(-1)) * rstd;
    const at::Tensor xhat_terms = xhat.abs() + (x.abs() + f.saved.mean.unsqueeze(-1).abs()) * rstd;
    const double out_scale = (xhat_terms * w.abs() + b.abs()).max().item<double>();
    const at::Tensor g = (dy * w).abs().amax(-1, true);
    const double dx_scale = (g * rstd * (2 + xhat_terms.pow(2).amax(-1, true))).max().item<double>();
    const double dw_scale = 1 + (dy.abs() * xhat_terms).reshape({-1, C}).sum(0).max().item<double>();
    const double db_scale = 1 + dy.abs().reshape({-1, C}).sum(0).max().item<double>();
    EXPECT_LT(err_over(f.out, ref.detach(), out_scale), 1e-13) << at::IntArrayRef(shape);
    EXPECT_LT(err_over(dx, want[0], dx_scale), 1e-13) << at::IntArrayRef(shape);
    EXPECT_LT(err_over(dw - 1, want[1], dw_scale), 1e-13) << at::IntArrayRef(shape);
    EXPECT_LT(err_over(db - 1, want[2], db_scale), 1e-13) << at::IntArrayRef(shape);
  }
}

TEST(LayerNormOp, SavedBytesMatchAndStatisticsAreFloat) {
  remat::memory::install_cpu_tracking();
  at::Generator gen = seeded(1);
  for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16}) {
    for (auto shape : {std::vector<int64_t>{2, 3, 8}, std::vector<int64_t>{7, 5}}) {
      at::Tensor x = at::randn(shape, gen).to(dt);
      const int64_t C = shape.back(), rows = x.numel() / C;
      const at::Tensor w = at::ones({C}, dt), b = at::zeros({C}, dt);
      const int64_t before = remat::memory::stats(at::kCPU).current;
      Fwd<LayerNormSaved> f = layernorm_forward(x, w, b, 1e-5);
      // Only the output and the new statistics stay allocated (no float32 copies of x).
      EXPECT_EQ(remat::memory::stats(at::kCPU).current - before,
                tensors_bytes({f.out}) + tensors_bytes(f.saved.tensors()) - tensors_bytes({x}));
      EXPECT_EQ(layernorm_saved_bytes(rows, C, dt), tensors_bytes(f.saved.tensors()));
      EXPECT_EQ(f.saved.mean.scalar_type(), stats_dtype(dt));
      EXPECT_EQ(f.saved.mean.sizes(), x.sizes().slice(0, x.dim() - 1));
      EXPECT_TRUE(same_storage(f.saved.x, x));  // the input itself, not a copy
      EXPECT_FALSE(same_storage(f.saved.mean, f.out));
      EXPECT_EQ(f.out.scalar_type(), dt);
    }
  }
  EXPECT_EQ(layernorm_flops(6, 10), 2 * layernorm_flops(3, 10));
  EXPECT_EQ(layernorm_flops(3, 10), 8.0 * 30);
}

TEST(LayerNormOp, BFloat16IsCloseToFloat64) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({4, 33}, gen, f64()), w = at::randn({33}, gen, f64()), b = at::randn({33}, gen, f64());
  auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  Fwd<LayerNormSaved> f = layernorm_forward(bf(x), bf(w), bf(b), 1e-5);
  Fwd<LayerNormSaved> f64r =
      layernorm_forward(bf(x).to(at::kDouble), bf(w).to(at::kDouble), bf(b).to(at::kDouble), 1e-5);
  EXPECT_LT(rel_err(f.out, f64r.out), 1e-2);
  at::Tensor dy = at::randn({4, 33}, gen, f64());
  at::Tensor dw = at::zeros({33}), db = at::zeros({33});  // float32 accumulators
  at::Tensor dw64 = at::zeros({33}, f64()), db64 = at::zeros({33}, f64());
  at::Tensor dx = layernorm_backward(bf(dy), f.saved, bf(w), dw, db);
  at::Tensor dx64 = layernorm_backward(bf(dy).to(at::kDouble), f64r.saved, bf(w).to(at::kDouble), dw64, db64);
  EXPECT_EQ(dx.scalar_type(), at::kBFloat16);
  EXPECT_LT(rel_err(dx, dx64), 2e-2);
  EXPECT_LT(rel_err(dw, dw64), 2e-2);
  EXPECT_LT(rel_err(db, db64), 2e-2);
}

TEST(LayerNormOp, RefusesMismatchedParameters) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({2, 8}, gen);
  expect_error([&] { layernorm_forward(x, at::ones({7}), at::zeros({8}), 1e-5); }, {"[layernorm]", "[2, 8]", "[7]"});
  auto f = layernorm_forward(x, at::ones({8}), at::zeros({8}), 1e-5);
  at::Tensor dw = at::zeros({8}), db = at::zeros({8});
  expect_error(
      [&] {
        layernorm_backward(at::randn({3, 8}, gen), f.saved, at::ones({8}), dw, db);
      },
      {"[layernorm]", "[3, 8]"});
}

}  // namespace
