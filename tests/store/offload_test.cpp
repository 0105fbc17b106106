// Offloaded slots (LayerPlan::offloaded) train exactly like `none`: the same losses and
// bitwise the same gradients, for every policy with an offload term, with their copies back
// started early (ac.offload_prefetch) or not, for random plans
// mixing keep, recompute and offload per slot, and for the planner's plans under a host
// budget, on both architectures and every attention op.
#include "plan/plan_test_util.h"
#include "remat/memory.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "store/store_run.h"

#include "util/sdpa.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <random>

namespace remat {
namespace {

const char* kOffloadPolicies[] = {"offload:[input]",
                                  "full+offload:[input]",
                                  "offload:[attn,mlp]",
                                  "modules:[core_attn]+offload:[input,mlp]",
                                  "uniform:2+offload:[input]",
                                  "every:2+modules:[act]+offload:[qkv,norm]",
                                  "ops:[matmul]+offload:[attn.qkv,mlp.act_in]",
                                  "offload:[attn.probs,attn.dropout,mlp.proj_in]",
                                  "full+offload(block:1):[input]",
                                  "modules:[core_attn]+offload(every:2):[input,mlp]"};

class OffloadBitwise : public ::testing::TestWithParam<std::tuple<std::string, Attention>> {};

TEST_P(OffloadBitwise, EveryOffloadPlanEqualsNoneBitwise) {
  const auto& [preset, attention] = GetParam();
  if (attention == Attention::sdpa) REMAT_SKIP_WITHOUT_SDPA();
  ModelConfig cfg = model_preset(preset);
  cfg.n_layer = 4;
  cfg.dropout = attention == Attention::sdpa ? 0.0 : 0.2;  // sdpa has no attention dropout
  cfg.attention = attention;
  cfg.attention_tile = 4;
  const int64_t B = 2, T = 9;
  const testing::StoreOutcome base =
      testing::run_two_microbatches(cfg, compile_policy("none", cfg.n_layer, cfg.dropout), B, T);
  const auto check = [&](const ActivationPlan& plan, const std::string& what) {
    const testing::StoreOutcome r = testing::run_two_microbatches(cfg, plan, B, T);
    EXPECT_EQ(r.losses, base.losses) << what;
    for (size_t i = 0; i < base.grads.size(); ++i) {
      ASSERT_TRUE(at::equal(r.grads[i], base.grads[i])) << what << " parameter " << i;
    }
    // Every buffer is back in the pool after the backwards; some memory went through it.
    EXPECT_EQ(r.host.in_use, 0) << what;
    EXPECT_GT(r.host.moved, 0) << what;
  };
  for (const char* policy : kOffloadPolicies) check(compile_policy(policy, cfg.n_layer, cfg.dropout), policy);
  // Copies back started in the backward of the layer above.
  for (const char* policy : {"offload:[input]", "modules:[core_attn]+offload:[input,mlp]",
                             "every:2+modules:[act]+offload:[qkv,norm]", "full+offload(block:1):[input]"}) {
    AcConfig ac;
    ac.policy = policy;
    ac.offload_prefetch = true;
    check(compile_policy(ac, cfg.n_layer, cfg.dropout), std::string(policy) + " (offload_prefetch)");
  }
  std::mt19937 rng(20261126);
  for (int trial = 0; trial < 6; ++trial) {
    std::string text;
    const ActivationPlan plan = testing::random_fates(rng, cfg.n_layer, text);
    check(plan, text);
  }
  const graph::BlockGraph block = graph::block_graph(cfg, B, T, at::kFloat);
  const int64_t host = 2 * block.saved_bytes();
  const Planner planner(cfg, testing::plan_shape(B, T), {}, testing::offload_times(block));
  const int64_t lo = planner.least_budget(host), hi = planner.none_peak();
  int offloading = 0;
  for (int i = 0; i < 3; ++i) {
    const auto r = testing::solve(planner, lo + (hi - lo) * i / 4, host);
    ASSERT_TRUE(r.has_value());
    if (r->prediction.host_peak == 0) continue;
    ++offloading;
    check(r->plan, explain_plan(r->plan));
  }
  EXPECT_GT(offloading, 0) << "some budget's plan offloads";
}

// The pool's buffers hold exactly their storages' bytes; on a CUDA device each is
// page-locked, and a round trip gives back the same bytes, views as views.
TEST(HostPool, BuffersAreExactAndOnCudaPageLocked) {
  const auto round_trip = [](at::Device device) {
    auto gen = at::detail::createCPUGenerator(20261126);
    const at::Tensor whole = at::randn({3, 1000}, gen).to(device);
    memory::HostPool pool;
    const memory::HostPool::Moved moved = pool.to_host({whole, whole.narrow(1, 10, 20)});
    pool.await(moved.ticket);
    const std::vector<at::Tensor>& host = moved.tensors;
    const memory::HostPool::Counts c = pool.counts();
    EXPECT_EQ(c.reserved, 3 * 1000 * 4) << "one buffer for the storage both tensors view";
    EXPECT_EQ(c.pinned, device.is_cuda() ? c.reserved : 0);
    const memory::HostPool::Moved fetched = pool.to_device(host, device);
    pool.await(fetched.ticket);
    const std::vector<at::Tensor>& back = fetched.tensors;
    EXPECT_TRUE(at::equal(back[0], whole));
    EXPECT_TRUE(at::equal(back[1], whole.narrow(1, 10, 20)));
    EXPECT_EQ(back[0].storage().unsafeGetStorageImpl(), back[1].storage().unsafeGetStorageImpl());
  };
  round_trip(at::kCPU);
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU here; scripts/gpu-check.sh runs this where one is";
  round_trip(at::Device(at::kCUDA, 0));
}

// Copies run on the pool's copy thread in the order they started: a copy back started
// before the copy out was awaited still reads its result. The pool holds what a copy reads
// and writes until it is done, so the caller may drop the sources at once; awaiting the
// last copy frees them.
TEST(HostPool, CopiesRunInOrderAndHoldTheirTensorsUntilDone) {
  memory::install_cpu_tracking();
  auto gen = at::detail::createCPUGenerator(20261127);
  std::vector<at::Tensor> sources, want;
  for (int i = 0; i < 8; ++i) {
    sources.push_back(at::randn({1 << 16}, gen));
    want.push_back(sources.back().clone());
  }
  const int64_t bytes = 8 * (int64_t{1} << 16) * 4;
  memory::HostPool pool;
  const int64_t before = memory::stats(at::kCPU).current;
  memory::HostPool::Moved host = pool.to_host(sources);
  sources.clear();
  const memory::HostPool::Moved back = pool.to_device(host.tensors, at::kCPU);
  host.tensors.clear();
  pool.await(back.ticket);
  EXPECT_EQ(memory::stats(at::kCPU).current, before)
      << "the sources went once copied, and the copies back took as many bytes";
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(back.tensors[i], want[i])) << i;
  EXPECT_EQ(pool.counts().in_use, 0) << "the host buffers went back to the pool once read";
  EXPECT_EQ(pool.counts().moved, bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Models, OffloadBitwise,
    ::testing::Values(std::make_tuple("tiny-gpt2", Attention::math), std::make_tuple("tiny-llama", Attention::math),
                      std::make_tuple("tiny-gpt2", Attention::tiled), std::make_tuple("tiny-llama", Attention::tiled),
                      std::make_tuple("tiny-gpt2", Attention::sdpa), std::make_tuple("tiny-llama", Attention::sdpa)),
    [](const auto& info) {
      return fmt::format("{}_{}", std::get<0>(info.param) == "tiny-gpt2" ? "gpt2" : "llama",
                         attention_name(std::get<1>(info.param)));
    });

}  // namespace
}  // namespace remat
