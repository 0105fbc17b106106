#include "remat/ops/rmsnorm.h"

#include "remat/memory.h"

#include "ops/testing.h"

namespace {

using namespace remat::ops;
using namespace remat::testing;

at::Tensor reference(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x / at::sqrt(x.pow(2).mean(-1, true) + eps) * w;
}

TEST(RMSNormOp, MatchesAutogradOfTheMath) {
  const double eps = 1e-6;
  at::Generator gen = seeded(1);
  // Not C == 1: there dx is eps-sized, the difference of two nearly equal terms, and its
  // relative error sits at the 1e-10 bound whatever the implementation.
  for (auto shape : {std::vector<int64_t>{2, 3, 7}, std::vector<int64_t>{5, 16}, std::vector<int64_t>{11},
                     std::vector<int64_t>{4, 2}}) {
    const int64_t C = shape.back();
    at::Tensor x = at::randn(shape, gen, f64()) * 2 + 0.5, w = at::randn({C}, gen, f64());
    Fwd<RMSNormSaved> f = rmsnorm_forward(x, w, eps);
    at::Tensor xl = leaf(x), wl = leaf(w);
    at::Tensor ref = reference(xl, wl, eps);
    EXPECT_LT(rel_err(f.out, ref.detach()), 1e-10) << at::IntArrayRef(shape);
    at::Tensor dy = at::randn(x.sizes(), gen, x.options());
    auto want = grads(ref, dy, {xl, wl});
    at::Tensor dw = at::ones({C}, f64());
    at::Tensor dx = rmsnorm_backward(dy, f.saved, w, dw);
    EXPECT_LT(rel_err(dx, want[0]), 1e-10) << at::IntArrayRef(shape);
    EXPECT_LT(rel_err(dw - 1, want[1]), 1e-10);
  }
}

TEST(RMSNormOp, SavedBytesMatch) {
  remat::memory::install_cpu_tracking();
  at::Generator gen = seeded(1);
  for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16}) {
    for (auto shape : {std::vector<int64_t>{2, 3, 8}, std::vector<int64_t>{7, 5}}) {
      at::Tensor x = at::randn(shape, gen).to(dt);
      const int64_t C = shape.back(), rows = x.numel() / C;
      const at::Tensor w = at::ones({C}, dt);
      const int64_t before = remat::memory::stats(at::kCPU).current;
      Fwd<RMSNormSaved> f = rmsnorm_forward(x, w, 1e-6);
      // Only the output and the new statistics stay allocated (no float32 copies of x).
      EXPECT_EQ(remat::memory::stats(at::kCPU).current - before,
                tensors_bytes({f.out}) + tensors_bytes(f.saved.tensors()) - tensors_bytes({x}));
      EXPECT_EQ(rmsnorm_saved_bytes(rows, C, dt), tensors_bytes(f.saved.tensors()));
      EXPECT_EQ(f.saved.rstd.scalar_type(), stats_dtype(dt));
      EXPECT_TRUE(same_storage(f.saved.x, x));
      EXPECT_EQ(f.out.scalar_type(), dt);
    }
  }
  EXPECT_EQ(rmsnorm_flops(6, 10), 2 * rmsnorm_flops(3, 10));
  EXPECT_EQ(rmsnorm_flops(3, 10), 5.0 * 30);
}

TEST(RMSNormOp, BFloat16IsCloseToFloat64) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({4, 33}, gen).to(at::kBFloat16), w = at::randn({33}, gen).to(at::kBFloat16);
  at::Tensor dy = at::randn({4, 33}, gen).to(at::kBFloat16);
  auto f = rmsnorm_forward(x, w, 1e-6);
  auto r = rmsnorm_forward(x.to(at::kDouble), w.to(at::kDouble), 1e-6);
  EXPECT_LT(rel_err(f.out, r.out), 1e-2);
  at::Tensor dw = at::zeros({33}), dw64 = at::zeros({33}, f64());
  at::Tensor dx = rmsnorm_backward(dy, f.saved, w, dw);
  at::Tensor dx64 = rmsnorm_backward(dy.to(at::kDouble), r.saved, w.to(at::kDouble), dw64);
  EXPECT_LT(rel_err(dx, dx64), 1e-2);
  EXPECT_LT(rel_err(dw, dw64), 1e-5);  // dw accumulates in float32
}

TEST(RMSNormOp, RefusesMismatchedWeight) {
  at::Generator gen = seeded(1);
  expect_error([&] { rmsnorm_forward(at::randn({2, 8}, gen), at::ones({9}), 1e-6); }, {"[rmsnorm]", "[2, 8]", "[9]"});
}

}  // namespace
