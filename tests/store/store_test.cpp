// Every policy trains exactly like `none`: the same loss and bitwise the same parameter
// gradients, with dropout, gradient accumulation and several shapes; and the store
// re-executes exactly the ops the plan implies.
#include "remat/model.h"
#include "remat/policy.h"
#include "store/store_run.h"

#include "util/sdpa.h"

#include <gtest/gtest.h>

namespace remat {
namespace {

using Outcome = testing::StoreOutcome;

Outcome run(const ModelConfig& cfg, const ActivationPlan& plan, int64_t B, int64_t T, StoreOptions opt = {}) {
  return testing::run_two_microbatches(cfg, plan, B, T, opt);
}

Outcome run(const ModelConfig& cfg, const std::string& policy, int64_t B, int64_t T, StoreOptions opt = {}) {
  return run(cfg, compile_policy(policy, cfg.n_layer, cfg.dropout), B, T, opt);
}

ModelConfig shape(const std::string& preset, int64_t layers, double dropout) {
  ModelConfig c = model_preset(preset);
  c.n_layer = layers;
  c.dropout = dropout;
  return c;
}

const char* kPolicies[] = {"full",
                           "every:1",
                           "every:2",
                           "uniform:2",
                           "uniform:3",
                           "block:1",
                           "ratio:0.5",
                           "modules:[core_attn]",
                           "modules:[qkv]",
                           "modules:[norm]",
                           "modules:[attn]",
                           "modules:[act]",
                           "modules:[mlp]",
                           "modules:[core_attn,act,norm]",
                           "ops:[matmul,attention]",
                           "ops:[matmul/2,softmax]",
                           "ops:[add]",
                           "every:2+modules:[core_attn]",
                           "layers:[full,none,modules:core_attn]"};

class StoreBitwise : public ::testing::TestWithParam<std::tuple<std::string, int64_t, int64_t, int64_t, Attention>> {};

TEST_P(StoreBitwise, EveryPolicyEqualsNoneBitwise) {
  const auto& [preset, layers, B, T, attention] = GetParam();
  if (attention == Attention::sdpa) REMAT_SKIP_WITHOUT_SDPA();
  // sdpa has no attention dropout (attention_refusal): its models train without dropout.
  ModelConfig cfg = shape(preset, layers, attention == Attention::sdpa ? 0.0 : 0.2);
  cfg.attention = attention;
  cfg.attention_tile = 4;  // several tiles per sequence
  const Outcome base = run(cfg, "none", B, T);
  for (const char* policy : kPolicies) {
    if (std::string(policy).rfind("layers:", 0) == 0 && layers != 3) continue;
    const Outcome r = run(cfg, policy, B, T);
    EXPECT_EQ(r.losses, base.losses) << policy;
    for (size_t i = 0; i < base.grads.size(); ++i) {
      ASSERT_TRUE(at::equal(r.grads[i], base.grads[i])) << policy << " parameter " << i;
    }
    EXPECT_GT(r.counters.ops_recomputed, 0) << policy;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, StoreBitwise,
                         ::testing::Values(std::make_tuple("tiny-gpt2", 3, 2, 9, Attention::math),
                                           std::make_tuple("tiny-gpt2", 4, 1, 16, Attention::math),
                                           std::make_tuple("tiny-llama", 3, 2, 11, Attention::math),
                                           std::make_tuple("tiny-llama", 4, 3, 8, Attention::math),
                                           std::make_tuple("tiny-gpt2", 3, 2, 9, Attention::tiled),
                                           std::make_tuple("tiny-llama", 3, 2, 11, Attention::tiled),
                                           std::make_tuple("tiny-gpt2", 3, 2, 9, Attention::sdpa),
                                           std::make_tuple("tiny-llama", 4, 3, 8, Attention::sdpa)),
                         [](const auto& info) {
                           return fmt::format("{}_L{}_B{}_T{}_{}",
                                              std::get<0>(info.param) == "tiny-gpt2" ? "gpt2" : "llama",
                                              std::get<1>(info.param), std::get<2>(info.param), std::get<3>(info.param),
                                              attention_name(std::get<4>(info.param)));
                         });

// model.attention = auto per layer: a model whose layers run two attention ops trains
// under every policy exactly as it does under `none` with the same ops.
TEST(StoreBitwise, LayersRunningTwoAttentionOpsEqualNoneBitwise) {
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    for (const Attention model_op : kAttentionOps) {
      ModelConfig cfg = shape(preset, 3, model_op == Attention::sdpa ? 0.0 : 0.2);
      cfg.attention = model_op;
      cfg.attention_tile = 4;
      const Attention other = model_op == Attention::math ? Attention::tiled : Attention::math;
      for (const char* policy : kPolicies) {
        // Every second layer outside a uniform chunk (whose layers run the model's op).
        ActivationPlan plan = compile_policy(policy, cfg.n_layer, cfg.dropout);
        ActivationPlan none = compile_policy("none", cfg.n_layer, cfg.dropout);
        const size_t n = plan.layers.size();
        for (size_t l = 1; l < n; l += 2) {
          const bool chunked = plan.layers[l].chunk_begin >= 0 || (l + 1 < n && plan.layers[l + 1].chunk_begin >= 0);
          if (!chunked) plan.layers[l].attention = none.layers[l].attention = other;
        }
        const Outcome base = run(cfg, none, 2, 9);
        const Outcome r = run(cfg, plan, 2, 9);
        EXPECT_EQ(r.losses, base.losses) << preset << " " << policy;
        for (size_t i = 0; i < base.grads.size(); ++i) {
          ASSERT_TRUE(at::equal(r.grads[i], base.grads[i])) << preset << " " << policy << " parameter " << i;
        }
      }
    }
  }
}

TEST(StoreCounts, FullReexecutesEachForwardOpOnceAndEarlyStopSkipsTheTail) {
  const ModelConfig cfg = shape("tiny-gpt2", 3, 0.1);
  // Per layer and microbatch: ln1, qkv, attention, c_proj, its dropout mask and dropout,
  // residual, ln2, c_fc, gelu, and the MLP's residual-dropout mask; the MLP's c_proj, its
  // dropout and the last residual add feed nothing the backward needs, so early stop skips
  // them. (Views of heads move no data and are no ops.)
  const Outcome r = run(cfg, "full", 2, 8);
  const int64_t n = 3 * 2;
  EXPECT_EQ(r.counters.ops_by_kind.at("layernorm"), 2 * n);
  EXPECT_EQ(r.counters.ops_by_kind.at("linear"), 3 * n);
  EXPECT_EQ(r.counters.ops_by_kind.at("attention"), n);
  EXPECT_EQ(r.counters.ops_by_kind.at("residual"), n);
  EXPECT_EQ(r.counters.ops_by_kind.at("gelu"), n);
  EXPECT_EQ(r.counters.ops_by_kind.at("dropout_mask"), 2 * n);
  EXPECT_EQ(r.counters.ops_by_kind.at("dropout"), n);
  EXPECT_EQ(r.counters.ops_recomputed, 11 * n);
  EXPECT_EQ(r.counters.bytes_recomputed, r.counters.bytes_dropped);

  StoreOptions whole;
  whole.early_stop = false;
  const Outcome w = run(cfg, "full", 2, 8, whole);
  EXPECT_EQ(w.counters.ops_by_kind.at("linear"), 4 * n);
  EXPECT_EQ(w.counters.ops_by_kind.at("residual"), 2 * n);
  EXPECT_EQ(w.counters.ops_by_kind.at("dropout"), 2 * n);
  EXPECT_EQ(w.counters.ops_recomputed, 14 * n);
  EXPECT_EQ(w.losses, r.losses);
}

TEST(StoreCounts, CoreAttentionReexecutesOnlyTheAttentionCore) {
  const Outcome r = run(shape("tiny-llama", 2, 0.1), "modules:[core_attn]", 2, 8);
  EXPECT_EQ(r.counters.ops_by_kind, (std::map<std::string, int64_t>{{"attention", 2 * 2}}));
  EXPECT_EQ(r.counters.bytes_recomputed, r.counters.bytes_dropped);
  const Outcome g = run(shape("tiny-gpt2", 2, 0.0), "modules:[act]", 2, 8);
  EXPECT_EQ(g.counters.ops_by_kind, (std::map<std::string, int64_t>{{"gelu", 2 * 2}}));
}

TEST(StoreCounts, UniformChunksReexecuteEachLayerOnce) {
  const ModelConfig cfg = shape("tiny-llama", 4, 0.0);
  const Outcome r = run(cfg, "uniform:2", 2, 8);
  // Whole-block forwards: 12 ops per Llama block (q/k/v and gate/up one op each), 4
  // blocks, 2 microbatches.
  EXPECT_EQ(r.counters.ops_recomputed, 12 * 4 * 2);
  EXPECT_EQ(r.counters.ops_by_kind.at("attention"), 4 * 2);
}

TEST(StoreCounts, KeptBytesShrinkInTheOrderUsersExpect) {
  const ModelConfig cfg = shape("tiny-gpt2", 4, 0.1);
  auto kept = [&](const std::string& policy) {
    auto model = Model::create(cfg, at::kCPU, at::kFloat, 1);
    model->set_activation_plan(compile_policy(policy, cfg.n_layer, cfg.dropout), {});
    auto tok = at::randint(cfg.vocab_size, {2, 32}, at::detail::createCPUGenerator(1), at::kLong);
    ActivationBytes m;
    model->forward_backward(tok, tok, {1, 0, 0}, 1.0, 64, &m);
    return m.total();
  };
  const int64_t none = kept("none"), sel = kept("modules:[core_attn]"), every2 = kept("every:2"), full = kept("full");
  EXPECT_GT(none, sel);
  EXPECT_GT(sel, every2);
  EXPECT_GT(every2, full);
}

TEST(StoreBytes, PredictedActivationBytesEqualWhatTheForwardKeeps) {
  for (const char* preset : {"tiny-gpt2", "tiny-llama"}) {
    const ModelConfig cfg = shape(preset, 4, 0.1);
    for (const char* policy : {"none", "full", "every:2", "uniform:2", "modules:[core_attn]", "ops:[matmul,attention]",
                               "every:2+modules:[core_attn,act]"}) {
      auto model = Model::create(cfg, at::kCPU, at::kFloat, 1);
      model->set_activation_plan(compile_policy(policy, cfg.n_layer, cfg.dropout), {});
      auto gen = at::detail::createCPUGenerator(1);
      auto tok = at::randint(cfg.vocab_size, {3, 10}, gen, at::kLong);
      auto tgt = at::randint(cfg.vocab_size, {3, 10}, gen, at::kLong);
      ActivationBytes m;
      model->forward_backward(tok, tgt, {1, 0, 0}, 1.0, 64, &m);
      const ActivationBytes p = model->predict_activation_bytes(3, 10);
      EXPECT_EQ(p.blocks, m.blocks) << preset << " " << policy;
      EXPECT_EQ(p.embedding, m.embedding) << preset << " " << policy;
      EXPECT_EQ(p.head, m.head) << preset << " " << policy;
    }
  }
}

// Plans hold slots as bits: a name no block has is refused where names are read.
TEST(StorePlan, ASlotNoBlockHasIsRefusedByName) {
  for (const std::vector<std::string>& names : {std::vector<std::string>{"attn.qkv", "mlp.gate"}, {"input"}}) {
    try {
      SlotMask::of_names(names);
      FAIL() << "a plan dropping " << names.back() << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("'" + names.back() + "' is not a slot of a block; the slots are attn.norm"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(SlotMask::of_names({"mlp.act_in", "attn.qkv"}).names(),
            (std::vector<std::string>{"attn.qkv", "mlp.act_in"}));
}

TEST(StoreCheck, ValuesCheckCatchesARecomputeWithTheWrongRandomKeys) {
  StoreOptions broken;
  broken.preserve_rng = false;  // recompute draws other dropout masks
  broken.check = DeterminismCheck::values;
  try {
    run(shape("tiny-gpt2", 2, 0.2), "full", 2, 8, broken);
    FAIL() << "a recompute with other dropout masks passed the values check";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "Recompute of layer 2 (counted from 1), slot mlp.resid is not what the forward saved"),
              std::string::npos)
        << e.what();
  }
  broken.check = DeterminismCheck::meta;  // shapes agree: meta cannot see it
  EXPECT_NO_THROW(run(shape("tiny-gpt2", 2, 0.2), "full", 2, 8, broken));
  StoreOptions sound;
  sound.check = DeterminismCheck::values;
  EXPECT_NO_THROW(run(shape("tiny-llama", 2, 0.2), "every:1", 2, 8, sound));
  EXPECT_NO_THROW(run(shape("tiny-llama", 4, 0.2), "uniform:2", 2, 8, sound));
}

}  // namespace
}  // namespace remat
