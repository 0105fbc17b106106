// AdamW against its formula, and a restored optimizer against one never stopped.
#include "model/adamw.h"
#include "util/fused_adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace remat {
namespace {

struct Tensors {
  std::vector<at::Tensor> values, grads;
  std::vector<bool> decay;
};

// Two matrices and a vector of random values, each with a gradient of its own.
Tensors tensors(at::ScalarType dtype, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  Tensors r;
  for (const std::vector<int64_t>& sizes : {std::vector<int64_t>{33, 17}, {64, 8}, {101}}) {
    r.values.push_back(at::randn(sizes, gen, at::kDouble).to(dtype));
    r.grads.push_back(at::zeros(sizes, at::TensorOptions(dtype)));
    r.decay.push_back(sizes.size() >= 2);
  }
  return r;
}

std::vector<AdamWParam> params_of(const Tensors& r) {
  std::vector<AdamWParam> out;
  for (size_t k = 0; k < r.values.size(); ++k) out.push_back({r.values[k], r.grads[k], r.decay[k]});
  return out;
}

// Step t's gradients: drawn anew every step, from the step's own seed, so that both runs
// of a comparison see the same ones.
void draw_grads(Tensors& r, int64_t t) {
  auto gen = at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(t));
  for (auto& g : r.grads) g.copy_(at::randn(g.sizes(), gen, at::kDouble) * (t % 3 == 0 ? 1e-3 : 1.0));
}

constexpr AdamWSettings kSettings{.beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.1, .eps = 1e-8};

double lr_of(int64_t t) { return 1e-2 / static_cast<double>(1 + t); }

// Loshchilov and Hutter's AdamW in float64 beside the float32 optimizer, step by step on
// the same gradients. Each float32 step rounds the weight a few times (the decay, the
// update's subtraction: 4u|p|), the update itself through a handful of operations (8u of
// it), and the moments carry their own rounding forward, which reaches the update as about
// 5u per step taken so far; u = 2^-24. The weights' distance to the float64 ones stays
// within the sum of these over the steps.
TEST(AdamW, StepsAsThePapersFormulaInFloat64) {
  Tensors single = tensors(at::kFloat, 7);
  AdamW optimizer(params_of(single), kSettings);
  std::vector<at::Tensor> p, m, v;
  for (const auto& x : single.values) {
    p.push_back(x.to(at::kDouble));
    m.push_back(at::zeros_like(p.back()));
    v.push_back(at::zeros_like(p.back()));
  }
  const double u = std::ldexp(1.0, -24);
  std::vector<double> bound(p.size(), 0.0);
  for (int64_t t = 1; t <= 30; ++t) {
    draw_grads(single, t);
    const double lr = lr_of(t);
    optimizer.step(lr);
    for (size_t k = 0; k < p.size(); ++k) {
      const at::Tensor g = single.grads[k].to(at::kDouble);
      const double wd = single.decay[k] ? kSettings.weight_decay : 0.0;
      p[k].mul_(1 - lr * wd);
      m[k] = kSettings.beta1 * m[k] + (1 - kSettings.beta1) * g;
      v[k] = kSettings.beta2 * v[k] + (1 - kSettings.beta2) * g * g;
      const at::Tensor m_hat = m[k] / (1 - std::pow(kSettings.beta1, static_cast<double>(t)));
      const at::Tensor v_hat = v[k] / (1 - std::pow(kSettings.beta2, static_cast<double>(t)));
      const at::Tensor update = lr * m_hat / (v_hat.sqrt() + kSettings.eps);
      p[k] -= update;
      bound[k] += u * (4 * p[k].abs().max().item<double>() +
                       (8 + 5 * static_cast<double>(t)) * update.abs().max().item<double>());
      const double off = (single.values[k].to(at::kDouble) - p[k]).abs().max().item<double>();
      ASSERT_LE(off, bound[k]) << "tensor " << k << " after step " << t << (util::kFusedAdamW ? " (fused)" : "");
    }
  }
  EXPECT_EQ(optimizer.updates(), 30);
}

// A checkpoint's state (the moments and the update count) continues bitwise as the
// optimizer that never stopped, through the second bias correction too.
TEST(AdamW, ARestoredOptimizerContinuesBitwise) {
  Tensors whole = tensors(at::kFloat, 11), resumed = tensors(at::kFloat, 11);
  AdamW a(params_of(whole), kSettings);
  AdamW b(params_of(resumed), kSettings);
  EXPECT_FALSE(a.exp_avg(0).defined());
  for (int64_t t = 1; t <= 4; ++t) {
    draw_grads(whole, t);
    a.step(lr_of(t));
  }
  std::vector<at::Tensor> firsts, seconds;
  for (size_t k = 0; k < whole.values.size(); ++k) {
    resumed.values[k].copy_(whole.values[k]);
    firsts.push_back(a.exp_avg(k).clone());
    seconds.push_back(a.exp_avg_sq(k).clone());
  }
  b.restore(4, firsts, seconds);
  for (int64_t t = 5; t <= 8; ++t) {
    draw_grads(whole, t);
    draw_grads(resumed, t);
    a.step(lr_of(t));
    b.step(lr_of(t));
  }
  EXPECT_EQ(b.updates(), 8);
  for (size_t k = 0; k < whole.values.size(); ++k) {
    EXPECT_TRUE(at::equal(whole.values[k], resumed.values[k])) << "tensor " << k;
    EXPECT_TRUE(at::equal(a.exp_avg_sq(k), b.exp_avg_sq(k))) << "tensor " << k;
  }
}

}  // namespace
}  // namespace remat
