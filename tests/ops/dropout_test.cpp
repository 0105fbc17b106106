#include "remat/ops/dropout.h"

#include "ops/testing.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>

namespace {

using namespace remat::ops;
using namespace remat::testing;

const at::Device kCPU(at::kCPU);

DropoutKey key(uint64_t seed = 7) { return DropoutKey{seed, 3, 1, 5, DropoutSite::mlp_resid}; }

TEST(DropoutOp, SameKeyGivesBitwiseSameMask) {
  at::Tensor a = dropout_mask({37, 53}, 0.3, key(), kCPU);
  at::Tensor b = dropout_mask({37, 53}, 0.3, key(), kCPU);
  EXPECT_EQ(a.scalar_type(), at::kBool);
  EXPECT_EQ(a.element_size(), 1);
  EXPECT_TRUE(at::equal(a, b));
}

// A data-parallel rank holding rows [2, 5) of a batch draws exactly those rows of the
// whole batch's mask, by the mask and one element at a time.
TEST(DropoutOp, ARowShardDrawsTheWholeBatchsRows) {
  const at::Tensor whole = dropout_mask({6, 5, 7}, 0.4, key(), kCPU);
  DropoutKey shard_key = key();
  shard_key.first_row = 2;
  const at::Tensor shard = dropout_mask({3, 5, 7}, 0.4, shard_key, kCPU);
  EXPECT_TRUE(at::equal(shard, whole.narrow(0, 2, 3)));
  const DropoutDraw draw(shard_key, 0.4, shard.sizes());
  const at::Tensor flat = shard.reshape(-1);
  for (int64_t i = 0; i < flat.numel(); ++i) ASSERT_EQ(draw.keep(draw.offset(i / 35) + i), flat[i].item<bool>()) << i;
  // Not trivially: another row's draws differ.
  EXPECT_FALSE(at::equal(shard, whole.narrow(0, 1, 3)));
}

// Without a dimension-1 window each element is the draw DropoutDraw documents at its flat
// index plus first_row rows: the masks every run so far has drawn, pinned independently of
// the code that places windows.
TEST(DropoutOp, WithoutAWindowElementIIsTheCounterDrawOfIPlusTheRowsBefore) {
  const double p = 0.3;
  const uint64_t threshold = static_cast<uint64_t>(std::ldexp(1.0 - p, 53));
  for (int64_t first_row : {0, 3}) {
    for (const auto& sizes : {std::vector<int64_t>{}, std::vector<int64_t>{50}, std::vector<int64_t>{4, 9},
                              std::vector<int64_t>{3, 4, 5, 6}}) {
      DropoutKey k = key();
      k.first_row = first_row;
      const at::Tensor mask = dropout_mask(sizes, p, k, kCPU).reshape(-1);
      const int64_t row = sizes.empty() ? 0 : mask.numel() / sizes[0];
      const bool* m = mask.data_ptr<bool>();
      for (int64_t i = 0; i < mask.numel(); ++i) {
        const uint64_t g = static_cast<uint64_t>(i + first_row * row + 1);
        ASSERT_EQ(m[i], (DropoutDraw::mix64(k.hash() + g * 0x9e3779b97f4a7c15ULL) >> 11) < threshold)
            << "element " << i << " of " << at::IntArrayRef(sizes) << ", first_row " << first_row;
      }
    }
  }
}

// A mask holding rows [r0, r0 + n0) and dimension-1 indices [f, f + n1) of a global one (a
// data-parallel rank's rows of a tensor-parallel rank's heads) is bitwise that slice of the
// global mask, drawn whole or one element at a time, whatever the thread count (the
// larger sizes split into ranges starting inside a row).
TEST(DropoutOp, ADimensionOneWindowDrawsTheWholeMasksSlice) {
  struct Case {
    std::vector<int64_t> global;
    int64_t r0, n0, f, n1;
  };
  const Case cases[] =
      {
          {{4, 8, 6, 6}, 0, 4, 2, 2},   {{4, 8, 6, 6}, 1, 2, 4, 4}, {{4, 8, 6, 6}, 3, 1, 0, 8},
          {{3, 5, 7}, 1, 2, 1, 3},      {{5, 7}, 2, 3, 3, 4},       {{2, 6, 1, 3, 2}, 1, 1, 5, 1},
          {{4, 8, 48, 48}, 1, 3, 2, 4},  // 27648 elements: 2 threads split a row
      };
  const int saved_threads = at::get_num_threads();
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    for (const Case& c : cases) {
      const at::Tensor whole = dropout_mask(c.global, 0.3, key(), kCPU);
      std::vector<int64_t> local = c.global;
      local[0] = c.n0;
      local[1] = c.n1;
      DropoutKey k = key();
      k.first_row = c.r0;
      k.first_in_dim1 = c.f;
      k.dim1_global = c.global[1];
      const std::string what = "window rows " + std::to_string(c.r0) + "+" + std::to_string(c.n0) + ", dim 1 " +
                               std::to_string(c.f) + "+" + std::to_string(c.n1) + " of " +
                               std::to_string(c.global.size()) + "-d, " + std::to_string(threads) + " threads";
      const at::Tensor shard = dropout_mask(local, 0.3, k, kCPU);
      EXPECT_TRUE(at::equal(shard, whole.narrow(0, c.r0, c.n0).narrow(1, c.f, c.n1))) << what;
      // One element at a time, from the global coordinates spelled out.
      const DropoutDraw draw(k, 0.3, local);
      const int64_t R = shard.numel() / (c.n0 * c.n1);
      const bool* m = shard.contiguous().data_ptr<bool>();
      for (int64_t i = 0; i < shard.numel(); ++i) {
        const int64_t i0 = i / (c.n1 * R), i1 = i / R % c.n1, r = i % R;
        const int64_t g = ((i0 + c.r0) * c.global[1] + i1 + c.f) * R + r;
        ASSERT_EQ(draw.keep(g), m[i]) << what << ", element " << i;
        ASSERT_EQ(draw.offset(i0) + i, g) << what << ", element " << i;
      }
    }
  }
  at::set_num_threads(saved_threads);
}

TEST(DropoutOp, RefusesAWindowOutsideDimensionOne) {
  const auto windowed = [](int64_t first, int64_t global) {
    DropoutKey k = key();
    k.first_in_dim1 = first;
    k.dim1_global = global;
    return k;
  };
  for (const DropoutKey& k : {windowed(3, 8), windowed(-1, 8), windowed(1, 0), windowed(0, 4)}) {
    expect_error([&] { dropout_mask({2, 6, 3}, 0.1, k, kCPU); }, {"[dropout]", "dimension 1"});
    expect_error([&] { DropoutDraw(k, 0.1, {2, 6, 3}); }, {"[dropout]", "dimension 1"});
  }
  expect_error([&] { dropout_mask({12}, 0.1, windowed(0, 24), kCPU); }, {"[dropout]", "2 dimensions"});
  // A window that fits is drawn.
  EXPECT_EQ(dropout_mask({2, 6, 3}, 0.1, windowed(2, 8), kCPU).sizes(), at::IntArrayRef({2, 6, 3}));
}

TEST(DropoutOp, EveryKeyFieldChangesTheMask) {
  const DropoutKey base = key();
  const at::Tensor m0 = dropout_mask({4096}, 0.5, base, kCPU);
  std::vector<DropoutKey> variants(5, base);
  variants[0].seed += 1;
  variants[1].step += 1;
  variants[2].microbatch += 1;
  variants[3].layer += 1;
  variants[4].site = DropoutSite::attn_probs;
  std::vector<uint64_t> hashes{base.hash()};
  for (const auto& k : variants) {
    EXPECT_FALSE(at::equal(dropout_mask({4096}, 0.5, k, kCPU), m0));
    hashes.push_back(k.hash());
  }
  std::sort(hashes.begin(), hashes.end());
  EXPECT_EQ(std::unique(hashes.begin(), hashes.end()), hashes.end());
  // Swapping two fields' values is a different key too.
  DropoutKey swapped = base;
  std::swap(swapped.step, swapped.layer);
  EXPECT_NE(swapped.hash(), base.hash());
}

TEST(DropoutOp, ConcurrentCallsGiveTheSameMasks) {
  const at::Tensor want = dropout_mask({3000}, 0.4, key(), kCPU);
  std::vector<at::Tensor> got(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < got.size(); ++i) {
    threads.emplace_back([&, i] { got[i] = dropout_mask({3000}, 0.4, key(), kCPU); });
  }
  for (auto& t : threads) t.join();
  for (const auto& m : got) EXPECT_TRUE(at::equal(m, want));
}

TEST(DropoutOp, MaskIsTheSameForOneAndTwoThreads) {
  const int saved_threads = at::get_num_threads();
  const std::vector<int64_t> sizes{16, 4, 128, 128};  // large enough to be split across threads
  at::set_num_threads(1);
  const at::Tensor one = dropout_mask(sizes, 0.1, key(), kCPU);
  at::set_num_threads(2);
  const at::Tensor two = dropout_mask(sizes, 0.1, key(), kCPU);
  at::set_num_threads(saved_threads);
  EXPECT_TRUE(at::equal(one, two));
}

TEST(DropoutOp, DoesNotTouchTheGlobalGenerator) {
  // Compares the state before and after instead of reseeding: a reseed here would make
  // every later unseeded draw in the process repeat, hiding flakes in repeated runs.
  at::Generator global = at::globalContext().defaultGenerator(kCPU);
  const at::Tensor before = global.get_state();  // a copy
  dropout_mask({1000}, 0.2, key(), kCPU);
  EXPECT_TRUE(at::equal(global.get_state(), before));
}

TEST(DropoutOp, KeepFractionIsOneMinusP) {
  for (double p : {0.1, 0.5, 0.9}) {
    const int64_t n = 1 << 20;
    const double kept = dropout_mask({n}, p, key(), kCPU).sum().item<int64_t>() / double(n);
    // Binomial standard deviation is below 5e-4 here; allow 6 of them.
    EXPECT_NEAR(kept, 1.0 - p, 3e-3) << "p=" << p;
  }
}

TEST(DropoutOp, ForwardAndBackwardMatchReference) {
  const double p = 0.25;
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({5, 7, 3}, gen, f64());
  Fwd<DropoutSaved> f = dropout_forward(x, p, key());
  // The mask regenerated from the same key is the one the op used.
  at::Tensor mask = dropout_mask(x.sizes(), p, key(), kCPU);
  EXPECT_TRUE(at::equal(f.saved.mask, mask));
  at::Tensor ref = at::where(mask, x / (1 - p), at::zeros_like(x));
  EXPECT_LT(rel_err(f.out, ref), 1e-15);
  at::Tensor dy = at::randn(x.sizes(), gen, x.options());
  at::Tensor xl = remat::testing::leaf(x);
  at::Tensor yl = xl * mask.to(at::kDouble) / (1 - p);
  at::Tensor want = remat::testing::grads(yl, dy, {xl})[0];
  EXPECT_LT(rel_err(dropout_backward(dy, f.saved), want), 1e-15);
}

TEST(DropoutOp, ZeroPIsIdentityWithoutMask) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({4, 6}, gen, f64());
  Fwd<DropoutSaved> f = dropout_forward(x, 0.0, key());
  EXPECT_TRUE(at::equal(f.out, x));
  EXPECT_FALSE(f.saved.mask.defined());
  at::Tensor dy = at::randn(x.sizes(), gen, x.options());
  EXPECT_TRUE(at::equal(dropout_backward(dy, f.saved), dy));
  EXPECT_EQ(dropout_flops(x.numel(), 0.0), 0.0);
}

TEST(DropoutOp, SavedBytesAndFlops) {
  at::Generator gen = seeded(1);
  for (double p : {0.0, 0.1}) {
    for (auto sizes : {std::vector<int64_t>{3, 5}, std::vector<int64_t>{2, 17, 9}}) {
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        at::Tensor x = at::randn(sizes, gen).to(dt);
        Fwd<DropoutSaved> f = dropout_forward(x, p, key());
        EXPECT_EQ(dropout_saved_bytes(x.numel(), p), tensors_bytes(f.saved.tensors()));
      }
    }
  }
  EXPECT_EQ(dropout_flops(1000, 0.1), 1000.0);
  EXPECT_EQ(dropout_flops(2000, 0.1), 2 * dropout_flops(1000, 0.1));
}

TEST(DropoutOp, WorksInBFloat16) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({64, 32}, gen).to(at::kBFloat16);
  Fwd<DropoutSaved> f = dropout_forward(x, 0.5, key());
  EXPECT_EQ(f.out.scalar_type(), at::kBFloat16);
  at::Tensor ref = at::where(f.saved.mask, x.to(at::kFloat) * 2, at::zeros({64, 32}));
  EXPECT_TRUE(at::equal(f.out.to(at::kFloat), ref));  // scaling by 2 is exact
}

TEST(DropoutOp, RefusesPOutsideRange) {
  at::Generator gen = seeded(1);
  at::Tensor x = at::randn({4}, gen);
  for (double p : {-0.1, 1.0, 1.5, std::nan("")}) {
    expect_error([&] { dropout_forward(x, p, key()); }, {"[dropout]", "[0, 1)"});
    expect_error([&] { dropout_mask({4}, p, key(), kCPU); }, {"[dropout]"});
  }
}

}  // namespace
