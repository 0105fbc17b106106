#include "util/error_of.h"
#include "remat/policy.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>

#include "remat/config.h"

// GCC 12 warns, wrongly, that assigning an AcConfig's empty optionals reads uninitialized
// strings (as in src/policy/compile.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace remat {
namespace {

using Slots = std::set<std::string>;

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::invalid_argument>(f); }

Slots all() { return {block_slots().begin(), block_slots().end()}; }

Slots all_but(const Slots& kept) {
  Slots out;
  for (const auto& s : block_slots()) {
    if (!kept.count(s)) out.insert(s);
  }
  return out;
}

std::vector<Slots> drops(const ActivationPlan& p) {
  std::vector<Slots> out;
  for (const auto& l : p.layers) {
    const auto names = l.dropped.names();
    out.emplace_back(names.begin(), names.end());
  }
  return out;
}

std::vector<int64_t> chunks(const ActivationPlan& p) {
  std::vector<int64_t> out;
  for (const auto& l : p.layers) out.push_back(l.chunk_begin);
  return out;
}

ActivationPlan compile_ac(const std::function<void(AcConfig&)>& set, int64_t layers, double dropout = 0.0) {
  AcConfig ac;
  set(ac);
  return compile_policy(ac, layers, dropout);
}

std::string error_ac(const std::function<void(AcConfig&)>& set, int64_t layers, double dropout = 0.0) {
  return error_of([&] { compile_ac(set, layers, dropout); });
}

const Slots kCoreAttn = {"attn.probs", "attn.dropout"};

// ---- canonical policies --------------------------------------------------------------

TEST(PolicyPlans, NoneKeepsEverythingAndFullKeepsOnlyTheBlockInput) {
  for (int64_t n : {1, 3, 6}) {
    const auto none = compile_policy("none", n);
    EXPECT_EQ(none.policy, "none");
    EXPECT_EQ(drops(none), std::vector<Slots>(n));
    EXPECT_EQ(chunks(none), std::vector<int64_t>(n, -1));
    const auto full = compile_policy(" full ", n);
    EXPECT_EQ(full.policy, "full");
    EXPECT_EQ(drops(full), std::vector<Slots>(n, all()));
    EXPECT_EQ(chunks(full), std::vector<int64_t>(n, -1));
  }
  EXPECT_EQ(all().size(), 14u);
}

TEST(PolicyPlans, EveryKCountsFromOneByPositionAlone) {
  EXPECT_EQ(drops(compile_policy("every:2", 5)), (std::vector<Slots>{{}, all(), {}, all(), {}}));
  EXPECT_EQ(drops(compile_policy("every:3", 6)), (std::vector<Slots>{{}, {}, all(), {}, {}, all()}));
  EXPECT_EQ(drops(compile_policy("every:1", 3)), std::vector<Slots>(3, all()));
  EXPECT_EQ(drops(compile_policy("every:4", 4)), (std::vector<Slots>{{}, {}, {}, all()}));
  // No hidden counter: the same model gets the same plan every time.
  const auto a = compile_policy("every:2", 7);
  const auto b = compile_policy("every:2", 7);
  EXPECT_TRUE(same_layers(a, b));
  EXPECT_EQ(explain_plan(a), explain_plan(b));
  EXPECT_EQ(a.policy, "every:2");
}

TEST(PolicyPlans, UniformChunksPointAtTheirFirstLayer) {
  const auto p = compile_policy("uniform:2", 5);
  EXPECT_EQ(p.policy, "uniform:2");
  EXPECT_EQ(drops(p), std::vector<Slots>(5, all()));
  EXPECT_EQ(chunks(p), (std::vector<int64_t>{-1, 0, -1, 2, -1}));
  EXPECT_EQ(chunks(compile_policy("uniform:3", 7)), (std::vector<int64_t>{-1, 0, 0, -1, 3, 3, -1}));
  EXPECT_EQ(chunks(compile_policy("uniform:1", 3)), (std::vector<int64_t>{-1, -1, -1}));
  // Chunks stay inside a pipeline stage.
  const auto staged = compile_ac(
      [](AcConfig& a) {
        a.policy = "uniform:2";
        a.stages = 2;
      },
      6);
  EXPECT_EQ(chunks(staged), (std::vector<int64_t>{-1, 0, -1, -1, 3, -1}));
}

TEST(PolicyPlans, BlockAndRatioCountPerStage) {
  EXPECT_EQ(drops(compile_policy("block:2", 4)), (std::vector<Slots>{all(), all(), {}, {}}));
  const auto block = compile_ac(
      [](AcConfig& a) {
        a.policy = "block:1";
        a.stages = 2;
      },
      4);
  EXPECT_EQ(drops(block), (std::vector<Slots>{all(), {}, all(), {}}));
  const auto ratio = compile_ac(
      [](AcConfig& a) {
        a.policy = "ratio:0.5";
        a.stages = 2;
      },
      6);
  EXPECT_EQ(drops(ratio), (std::vector<Slots>{all(), all(), {}, all(), all(), {}}));  // ceil(1.5) = 2
  EXPECT_EQ(ratio.policy, "ratio:0.5");
  // 0.3 x 10 is 3 layers, not 4, although the product rounds above 3.
  const auto tenth = compile_policy("ratio:0.3", 10);
  EXPECT_EQ(drops(tenth), (std::vector<Slots>{all(), all(), all(), {}, {}, {}, {}, {}, {}, {}}));
  EXPECT_EQ(drops(compile_policy("ratio:0", 3)), std::vector<Slots>(3));
  EXPECT_EQ(drops(compile_policy("ratio:1", 3)), std::vector<Slots>(3, all()));
  // Uneven stages from ac.num_layers_per_stage.
  const auto uneven = compile_ac(
      [](AcConfig& a) {
        a.policy = "block:1";
        a.stages = 2;
        a.num_layers_per_stage = "1,3";
      },
      4);
  EXPECT_EQ(drops(uneven), (std::vector<Slots>{all(), all(), {}, {}}));
  // Stages that do not divide the layers: as even as they go, the first taking one more.
  const auto five = compile_ac(
      [](AcConfig& a) {
        a.policy = "block:1";
        a.stages = 2;
      },
      5);
  EXPECT_EQ(drops(five), (std::vector<Slots>{all(), {}, {}, all(), {}}));
  AcConfig three;
  three.stages = 3;
  EXPECT_EQ(stage_sizes(three, 8), (std::vector<int64_t>{3, 3, 2}));
}

TEST(PolicyPlans, ModulesDropTheUnionOfTheirSlots) {
  const auto p = compile_policy("modules:[qkv, core_attn, qkv]", 3);
  EXPECT_EQ(p.policy, "modules:[core_attn,qkv]");
  EXPECT_EQ(drops(p), std::vector<Slots>(3, (Slots{"attn.probs", "attn.dropout", "attn.qkv"})));
  const auto mlp = compile_policy("modules:[act,mlp]", 2);
  EXPECT_EQ(drops(mlp),
            std::vector<Slots>(2, (Slots{"mlp.fc_in", "mlp.gathered", "mlp.act_in", "mlp.proj_in", "mlp.resid"})));
  // The sequence-gathered copies alone, and with the norms' outputs they are gathered from.
  EXPECT_EQ(drops(compile_policy("modules:[gathered]", 1)),
            std::vector<Slots>(1, (Slots{"attn.gathered", "mlp.gathered"})));
  EXPECT_EQ(drops(compile_policy("modules:[norm]", 1)),
            std::vector<Slots>(1, (Slots{"attn.norm", "attn.qkv_in", "attn.gathered", "mlp.fc_in", "mlp.gathered"})));
}

TEST(PolicyPlans, OpsKeepTheOutputsOfTheListedKinds) {
  const auto p = compile_policy("ops:[attention, matmul]", 2);
  EXPECT_EQ(p.policy, "ops:[matmul,attention]");
  EXPECT_EQ(drops(p), std::vector<Slots>(2, all_but({"attn.qkv", "mlp.act_in", "attn.proj_in"})));
  const auto every = compile_policy("ops:[softmax,dropout,norm,act,add]", 1);
  EXPECT_EQ(drops(every), (std::vector<Slots>{{"attn.qkv", "mlp.act_in", "attn.proj_in"}}));
  // matmul/2: matmul outputs kept in layers 1, 3, ... (from 1), dropped in 2, 4, ...
  const auto half = compile_policy("ops:[matmul/2,attention]", 3);
  EXPECT_EQ(half.policy, "ops:[matmul/2,attention]");
  const Slots keep_mm = all_but({"attn.qkv", "mlp.act_in", "attn.proj_in"});
  const Slots drop_mm = all_but({"attn.proj_in"});
  EXPECT_EQ(drops(half), (std::vector<Slots>{keep_mm, drop_mm, keep_mm}));
}

TEST(PolicyPlans, ExplicitLayerListsAndCompositions) {
  const auto p = compile_policy("layers:[full, none, modules:core_attn, ops:[softmax]]", 4);
  EXPECT_EQ(p.policy, "layers:[full,none,modules:[core_attn],ops:[softmax]]");
  EXPECT_EQ(drops(p), (std::vector<Slots>{all(), {}, kCoreAttn, all_but({"attn.probs"})}));
  // The canonical spelling compiles back to the same plan.
  EXPECT_TRUE(same_layers(compile_policy(p.policy, 4), p));

  const auto c = compile_policy("every:2 + modules:[core_attn]", 4);
  EXPECT_EQ(c.policy, "every:2+modules:[core_attn]");
  EXPECT_EQ(drops(c), (std::vector<Slots>{kCoreAttn, all(), kCoreAttn, all()}));
  const auto b = compile_ac(
      [](AcConfig& a) {
        a.policy = "block:1+ops:[matmul]";
        a.stages = 2;
      },
      4);
  const Slots keep_mm = all_but({"attn.qkv", "mlp.act_in"});
  EXPECT_EQ(drops(b), (std::vector<Slots>{all(), keep_mm, all(), keep_mm}));
  const auto r = compile_policy("ratio:0.5+modules:[qkv]", 4);
  EXPECT_EQ(drops(r), (std::vector<Slots>{all(), all(), {"attn.qkv"}, {"attn.qkv"}}));
}

// ---- aliases ---------------------------------------------------------------------------

void expect_same(const ActivationPlan& alias, const std::string& canonical, int64_t layers, int64_t stages = 1) {
  AcConfig ac;
  ac.policy = canonical;
  ac.stages = stages;
  const auto expected = compile_policy(ac, layers, 0.0);
  EXPECT_TRUE(same_layers(alias, expected)) << canonical;
  EXPECT_EQ(alias.policy, expected.policy);
}

TEST(PolicyAliases, TorchtuneSpellings) {
  expect_same(compile_ac([](AcConfig& a) { a.enable_activation_checkpointing = true; }, 4), "full", 4);
  expect_same(compile_ac([](AcConfig& a) { a.enable_activation_checkpointing = false; }, 4), "none", 4);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.enable_activation_checkpointing = true;
                    a.ac_mode = "full";
                  },
                  4),
              "full", 4);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.enable_activation_checkpointing = true;
                    a.ac_mode = "selective";
                    a.ac_option = "2";
                  },
                  6),
              "every:2", 6);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.enable_activation_checkpointing = true;
                    a.ac_mode = "selective";
                    a.ac_option = "op";
                  },
                  3),
              "ops:[matmul,attention]", 3);
}

TEST(PolicyAliases, MegatronSpellings) {
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.recompute_granularity = "full";
                    a.recompute_method = "uniform";
                    a.recompute_num_layers = 2;
                  },
                  5),
              "uniform:2", 5);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.recompute_granularity = "full";
                    a.recompute_method = "block";
                    a.recompute_num_layers = 1;
                    a.stages = 2;
                  },
                  4),
              "block:1", 4, 2);
  expect_same(compile_ac([](AcConfig& a) { a.recompute_granularity = "selective"; }, 3), "modules:[core_attn]", 3);
  expect_same(compile_ac([](AcConfig& a) { a.recompute_activations = true; }, 3), "modules:[core_attn]", 3);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.recompute_granularity = "selective";
                    a.recompute_modules = "mlp, core_attn";
                  },
                  3),
              "modules:[core_attn,mlp]", 3);
  expect_same(compile_ac([](AcConfig& a) { a.recompute_modules = "[qkv]"; }, 2), "modules:[qkv]", 2);
  expect_same(compile_ac([](AcConfig& a) { a.distribute_saved_activations = false; }, 2), "none", 2);
}

TEST(PolicyAliases, ColossalAiAndNanotronSpellings) {
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.gradient_checkpointing_ratio = 0.5;
                    a.stages = 2;
                  },
                  8),
              "ratio:0.5", 8, 2);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.num_ckpt_layers_per_stage = "2,2";
                    a.stages = 2;
                  },
                  8),
              "block:2", 8, 2);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.num_ckpt_layers_per_stage = "0,0";
                    a.stages = 2;
                  },
                  4),
              "none", 4, 2);
  const auto differing = compile_ac(
      [](AcConfig& a) {
        a.num_ckpt_layers_per_stage = "3,1";
        a.stages = 2;
      },
      8);
  expect_same(differing, "layers:[full,full,full,none,full,none,none,none]", 8);
  const auto uneven = compile_ac(
      [](AcConfig& a) {
        a.num_layers_per_stage = "3,5";
        a.num_ckpt_layers_per_stage = "1,2";
        a.stages = 2;
      },
      8);
  expect_same(uneven, "layers:[full,none,none,full,full,none,none,none]", 8);
  expect_same(compile_ac([](AcConfig& a) { a.recompute_layer = true; }, 3), "full", 3);
  expect_same(compile_ac([](AcConfig& a) { a.recompute_layer = false; }, 3), "none", 3);
  expect_same(compile_ac([](AcConfig& a) { a.tp_recompute_allgather = false; }, 3), "none", 3);
}

TEST(PolicyAliases, AgreeingSpellingsAreAccepted) {
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.policy = "full";
                    a.recompute_layer = true;
                    a.enable_activation_checkpointing = true;
                  },
                  4),
              "full", 4);
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.policy = "modules:[core_attn]";
                    a.recompute_activations = true;
                  },
                  4),
              "modules:[core_attn]", 4);
  // Different spellings of one plan agree: block:2 on one stage of 2 layers is full.
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.policy = "block:2";
                    a.recompute_layer = true;
                  },
                  2),
              "block:2", 2);
}

// ---- refusals ----------------------------------------------------------------------------

TEST(PolicyErrors, CountsOutOfRange) {
  EXPECT_EQ(error_of([] { compile_policy("every:0", 4); }),
            "ac.policy = \"every:0\": K = 0 must be at least 1 (every:K recomputes layers K, 2K, 3K, ... counted "
            "from 1); use none to recompute nothing.");
  EXPECT_EQ(error_of([] { compile_policy("every:-2", 4); }),
            "ac.policy = \"every:-2\": K = -2 must be at least 1 (every:K recomputes layers K, 2K, 3K, ... counted "
            "from 1); use none to recompute nothing.");
  EXPECT_EQ(error_of([] { compile_policy("every:5", 4); }),
            "ac.policy = \"every:5\": K = 5 is larger than the model, which has 4 layers; use K between 1 and 4.");
  EXPECT_EQ(error_of([] { compile_policy("every:two", 4); }),
            "ac.policy = \"every:two\": K must be a whole number (every:K recomputes layers K, 2K, 3K, ... counted "
            "from 1), got 'two'.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.policy = "block:3";
                  a.stages = 2;
                },
                4),
            "ac.policy = \"block:3\": N = 3 is larger than the smallest pipeline stage, which has 2 layers; use N "
            "between 1 and 2.");
  EXPECT_EQ(error_of([] { compile_policy("uniform:0", 4); }),
            "ac.policy = \"uniform:0\": N = 0 must be at least 1 (uniform:N recomputes chunks of N consecutive "
            "layers from each chunk's input); use none to recompute nothing.");
  EXPECT_EQ(error_of([] { compile_policy("ratio:1.5", 4); }),
            "ac.policy = \"ratio:1.5\": R = 1.5 is not a number in [0, 1]; ratio:R recomputes the first ceil(R x "
            "layers) layers of each pipeline stage, e.g. ratio:0.5 for half of them.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.enable_activation_checkpointing = true;
                  a.ac_mode = "selective";
                  a.ac_option = "0";
                },
                4),
            "ac.ac_option = 0: K = 0 must be at least 1 (every:K recomputes layers K, 2K, 3K, ... counted from 1); "
            "use none to recompute nothing.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.enable_activation_checkpointing = true;
                  a.ac_mode = "selective";
                  a.ac_option = "9";
                },
                4),
            "ac.ac_option = 9: K = 9 is larger than the model, which has 4 layers; use K between 1 and 4.");
}

TEST(PolicyErrors, UnknownNamesListTheValidOnes) {
  EXPECT_EQ(error_of([] { compile_policy("modules:[core_attn,ffn]", 2); }),
            "ac.policy = \"modules:[core_attn,ffn]\": unknown module 'ffn'; valid modules are core_attn, qkv, norm, "
            "attn, act, mlp, gathered.");
  EXPECT_EQ(error_of([] { compile_policy("ops:[mm]", 2); }),
            "ac.policy = \"ops:[mm]\": unknown op kind 'mm'; valid op kinds are matmul, matmul/2, attention, "
            "softmax, dropout, norm, act, add.");
  EXPECT_EQ(error_ac([](AcConfig& a) { a.recompute_modules = "core_attn,mlp_fc"; }, 2),
            "ac.recompute_modules = \"core_attn,mlp_fc\": unknown module 'mlp_fc'; valid modules are core_attn, "
            "qkv, norm, attn, act, mlp, gathered.");
  EXPECT_EQ(error_of([] { compile_policy("ops:[matmul,matmul/2]", 2); }),
            "ac.policy = \"ops:[matmul,matmul/2]\": 'ops:[matmul,matmul/2]' lists both matmul (keep every layer's "
            "matmul outputs) and matmul/2 (keep them in every other layer); give one of them.");
  EXPECT_EQ(error_of([] { compile_policy("selective", 2); }),
            "ac.policy = \"selective\": 'selective' is not a recompute policy; valid forms are none, full, every:K, "
            "uniform:N, block:N, ratio:R, modules:[...], ops:[...], layers:[...] and X+Y (X one of every:K, "
            "block:N, ratio:R; Y one of modules:[...], ops:[...]), each optionally followed by "
            "+offload:[slots or modules] (in some layers: +offload(block:N):[...]).");
}

TEST(PolicyErrors, LayerListsAndCompositions) {
  EXPECT_EQ(error_of([] { compile_policy("layers:[full,none]", 3); }),
            "ac.policy = \"layers:[full,none]\": layers:[...] lists 2 entries but the model has 3 layers; give "
            "exactly one entry per layer.");
  // "layers:[]" was said to list 1 entries.
  EXPECT_EQ(error_of([] { compile_policy("layers:[]", 4); }),
            "ac.policy = \"layers:[]\": layers:[...] lists no entries but the model has 4 layers; give exactly one "
            "entry per layer.");
  EXPECT_NE(error_of([] { compile_policy("layers:[full]", 2); }).find("lists 1 entry but"), std::string::npos);
  EXPECT_EQ(error_of([] { compile_policy("layers:[full,half]", 2); }),
            "ac.policy = \"layers:[full,half]\": entry 2 of layers:[...] is 'half'; an entry is full, none, "
            "modules:NAME, modules:[...] or ops:[...].");
  EXPECT_EQ(error_of([] { compile_policy("uniform:2+modules:[core_attn]", 4); }),
            "ac.policy = \"uniform:2+modules:[core_attn]\": in a composition X+Y, X must select layers (every:K, "
            "block:N or ratio:R) and Y must be selective (modules:[...] or ops:[...]); got X = 'uniform:2' and Y = "
            "'modules:[core_attn]'.");
  EXPECT_EQ(error_of([] { compile_policy("every:2+full", 4); }),
            "ac.policy = \"every:2+full\": in a composition X+Y, X must select layers (every:K, block:N or ratio:R) "
            "and Y must be selective (modules:[...] or ops:[...]); got X = 'every:2' and Y = 'full'.");
}

TEST(PolicyErrors, MegatronCombinations) {
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.recompute_granularity = "selective";
                  a.recompute_method = "block";
                },
                4),
            "ac.recompute_method = \"block\" is given with selective granularity (ac.recompute_granularity = "
            "\"selective\"); a recompute method chooses layers to recompute whole, which only full granularity "
            "does. Set ac.recompute_granularity = \"full\" with the method, or drop ac.recompute_method (to combine "
            "both, write e.g. ac.policy = \"block:2+modules:[core_attn]\").");
  EXPECT_EQ(error_ac([](AcConfig& a) { a.recompute_granularity = "full"; }, 4),
            "ac.recompute_granularity = \"full\" needs ac.recompute_method and ac.recompute_num_layers: \"uniform\" "
            "with N recomputes chunks of N layers, \"block\" with N the first N layers of each stage (e.g. "
            "recompute_method = \"uniform\", recompute_num_layers = 1). To recompute every layer, use ac.policy = "
            "\"full\".");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.recompute_granularity = "full";
                  a.recompute_method = "uniform";
                },
                4),
            "ac.recompute_granularity = \"full\" needs ac.recompute_num_layers: \"uniform\" with N recomputes "
            "chunks of N layers, \"block\" with N the first N layers of each stage (e.g. recompute_method = "
            "\"uniform\", recompute_num_layers = 1). To recompute every layer, use ac.policy = \"full\".");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.recompute_granularity = "full";
                  a.recompute_method = "block";
                  a.recompute_num_layers = 5;
                },
                4),
            "ac.recompute_method = \"block\" with ac.recompute_num_layers = 5: N = 5 is larger than the model, "
            "which has 4 layers; use N between 1 and 4.");
  EXPECT_EQ(error_ac([](AcConfig& a) { a.recompute_num_layers = 2; }, 4),
            "ac.recompute_num_layers = 2 is given with no ac.recompute_granularity; it only counts layers for full "
            "granularity with a recompute method. Drop it, or set ac.recompute_granularity = \"full\" and "
            "ac.recompute_method.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.recompute_granularity = "full";
                  a.recompute_activations = true;
                },
                4),
            "ac.recompute_activations = true means selective recompute, but ac.recompute_granularity = \"full\" "
            "asks for another granularity: two spellings of the same setting disagree. Drop one of them.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.recompute_activations = true;
                  a.distribute_saved_activations = true;
                },
                4),
            "ac.distribute_saved_activations = true keeps the input of each layer recomputed whole as a share per "
            "tensor-parallel rank, but the policy modules:[core_attn] recomputes no layer whole; choose full, "
            "uniform:N or block:N (Megatron: ac.recompute_granularity = \"full\" with a method), or drop "
            "ac.distribute_saved_activations.");
}

// Megatron's distribute_saved_activations: each layer recomputed whole (uniform chunks'
// first layers, block:N's layers, with any spelling of the policy) keeps its input as a
// share per tensor-parallel rank; layers that keep more, and the other layers of a chunk,
// are unchanged.
TEST(PolicyPlans, DistributeSavedActivationsSharesTheInputsOfLayersRecomputedWhole) {
  const auto sharded = [](const ActivationPlan& p) {
    std::vector<bool> out;
    for (const auto& l : p.layers) out.push_back(l.input_sharded);
    return out;
  };
  AcConfig ac;
  ac.recompute_granularity = "full";
  ac.recompute_method = "uniform";
  ac.recompute_num_layers = 2;
  ac.distribute_saved_activations = true;
  const ActivationPlan uniform = compile_policy(ac, 4, 0.0);
  EXPECT_EQ(uniform.policy, "uniform:2 (distribute_saved_activations)");
  EXPECT_EQ(sharded(uniform), (std::vector<bool>{true, false, true, false}));
  ac.recompute_method = "block";
  ac.recompute_num_layers = 1;
  const ActivationPlan block = compile_policy(ac, 3, 0.0);
  EXPECT_EQ(sharded(block), (std::vector<bool>{true, false, false}));
  EXPECT_NE(explain_plan(block).find("block input (a share per tensor-parallel rank) only"), std::string::npos)
      << explain_plan(block);
  ac.distribute_saved_activations = false;
  EXPECT_EQ(sharded(compile_policy(ac, 3, 0.0)), std::vector<bool>(3, false));
  EXPECT_FALSE(same_layers(block, compile_policy(ac, 3, 0.0)));
  // remat's own spellings of the same policies.
  AcConfig own;
  own.policy = "every:2";
  own.distribute_saved_activations = true;
  EXPECT_EQ(sharded(compile_policy(own, 4, 0.0)), (std::vector<bool>{false, true, false, true}));
  own.policy = "uniform:2";
  EXPECT_TRUE(same_layers(compile_policy(own, 4, 0.0), uniform));
  // Without recompute there is no input to share (a sweep's none): the plan is none's.
  own.policy = "none";
  EXPECT_EQ(compile_policy(own, 4, 0.0).policy, "none");
  EXPECT_EQ(sharded(compile_policy(own, 4, 0.0)), std::vector<bool>(4, false));
}

// nanotron's tp_recompute_allgather: whatever else the policy keeps, the gathered inputs of
// the column-parallel linears are gathered again (config.cpp refuses it without parallel.sp).
TEST(PolicyPlans, TpRecomputeAllgatherDropsTheGatheredCopiesOfEveryLayer) {
  AcConfig ac;
  ac.tp_recompute_allgather = true;
  const auto none = compile_policy(ac, 3, 0.0);
  EXPECT_EQ(none.policy, "none (tp_recompute_allgather)");
  EXPECT_EQ(drops(none), std::vector<Slots>(3, (Slots{"attn.gathered", "mlp.gathered"})));
  ac.policy = "every:2+modules:[core_attn]";
  EXPECT_EQ(drops(compile_policy(ac, 2, 0.0)),
            (std::vector<Slots>{{"attn.probs", "attn.dropout", "attn.gathered", "mlp.gathered"}, all()}));
  ac.tp_recompute_allgather = false;
  EXPECT_EQ(compile_policy(ac, 2, 0.0).policy, "every:2+modules:[core_attn]");
}

TEST(PolicyErrors, TorchtuneCombinations) {
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.enable_activation_checkpointing = false;
                  a.ac_mode = "selective";
                  a.ac_option = "2";
                },
                4),
            "ac.enable_activation_checkpointing = false turns recompute off, but ac.ac_mode = \"selective\" asks "
            "for it: two spellings of the same setting disagree. Set ac.enable_activation_checkpointing = true to "
            "use it, or drop ac.ac_mode.");
  EXPECT_EQ(error_ac([](AcConfig& a) { a.ac_mode = "full"; }, 4),
            "ac.ac_mode = \"full\" is given without ac.enable_activation_checkpointing; set "
            "ac.enable_activation_checkpointing = true with it (or use ac.policy).");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.enable_activation_checkpointing = true;
                  a.ac_mode = "selective";
                },
                4),
            "ac.ac_mode = \"selective\" needs ac.ac_option: a whole number K (recompute every K-th layer, every:K) "
            "or \"op\" (keep matmul and attention outputs, ops:[matmul,attention]).");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.enable_activation_checkpointing = true;
                  a.ac_mode = "full";
                  a.ac_option = "2";
                },
                4),
            "ac.ac_option = 2 applies only to ac.ac_mode = \"selective\"; with ac.ac_mode = \"full\" every layer is "
            "recomputed. Drop ac.ac_option or set ac.ac_mode = \"selective\".");
}

TEST(PolicyErrors, DisagreeingSpellings) {
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.policy = "full";
                  a.recompute_granularity = "selective";
                },
                4),
            "ac.policy = \"full\" asks for full but ac.recompute_granularity = \"selective\" asks for "
            "modules:[core_attn]: two spellings of the recompute policy disagree. Set only one of them.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.policy = "every:2";
                  a.recompute_layer = false;
                },
                4),
            "ac.policy = \"every:2\" asks for every:2 but ac.recompute_layer = false asks for none: two spellings "
            "of the recompute policy disagree. Set only one of them.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.gradient_checkpointing_ratio = 0.5;
                  a.num_ckpt_layers_per_stage = "1,1";
                  a.stages = 2;
                },
                8),
            "ac.gradient_checkpointing_ratio = 0.5 asks for ratio:0.5 but ac.num_ckpt_layers_per_stage = [1, 1] "
            "asks for block:1: two spellings of the recompute policy disagree. Set only one of them.");
}

// An explicit "none" is a choice like any other: an alias that recomputes contradicts it.
TEST(PolicyErrors, AnExplicitNoneDisagreesWithAnAliasThatRecomputes) {
  const std::vector<std::pair<std::function<void(AcConfig&)>, std::string>> aliases = {
      {[](AcConfig& a) { a.enable_activation_checkpointing = true; },
       "ac.enable_activation_checkpointing = true asks for full"},
      {[](AcConfig& a) { a.recompute_layer = true; }, "ac.recompute_layer = true asks for full"},
      {[](AcConfig& a) { a.recompute_granularity = "selective"; },
       "ac.recompute_granularity = \"selective\" asks for modules:[core_attn]"},
      {[](AcConfig& a) { a.gradient_checkpointing_ratio = 0.5; },
       "ac.gradient_checkpointing_ratio = 0.5 asks for ratio:0.5"}};
  for (const auto& [set, asks] : aliases) {
    EXPECT_EQ(error_ac(
                  [&](AcConfig& a) {
                    a.policy = "none";
                    set(a);
                  },
                  4),
              "ac.policy = \"none\" asks for none but " + asks +
                  ": two spellings of the recompute policy disagree. Set only one of them.");
    // Unset, the policy defers to the alias.
    EXPECT_NE(compile_ac(set, 4).policy, "none");
  }
  // An alias that asks for no recompute agrees with it.
  EXPECT_EQ(compile_ac(
                [](AcConfig& a) {
                  a.policy = "none";
                  a.recompute_layer = false;
                },
                4)
                .policy,
            "none");
}

TEST(PolicyErrors, StagesAndPerStageLists) {
  EXPECT_EQ(error_ac([](AcConfig& a) { a.gradient_checkpointing_ratio = -0.1; }, 4),
            "ac.gradient_checkpointing_ratio = -0.1 is outside [0, 1]; it is the share of each pipeline stage's "
            "layers that is recomputed, e.g. 0.5 for half of them.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.num_ckpt_layers_per_stage = "1,1,1";
                  a.stages = 2;
                },
                4),
            "ac.num_ckpt_layers_per_stage = [1, 1, 1] lists 3 stages but ac.stages = 2; give one entry per "
            "pipeline stage.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.num_ckpt_layers_per_stage = "3,1";
                  a.stages = 2;
                },
                4),
            "ac.num_ckpt_layers_per_stage = [3, 1] asks for 3 recomputed layers in stage 1, which has 2 layers; "
            "each entry must be between 0 and its stage's layer count.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.num_layers_per_stage = "2,3";
                  a.stages = 2;
                },
                4),
            "ac.num_layers_per_stage = [2, 3] sums to 5 layers but the model has 4; the stages must split exactly "
            "the model's layers.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.num_layers_per_stage = "4";
                  a.stages = 2;
                },
                4),
            "ac.num_layers_per_stage = [4] lists 1 stages but ac.stages = 2; give one entry per pipeline stage.");
  EXPECT_EQ(error_ac([](AcConfig& a) { a.check = "all"; }, 4),
            "ac.check must be \"none\", \"meta\" or \"values\", got \"all\".");
}

TEST(PolicyErrors, DropoutWithoutRngPreservation) {
  auto no_rng = [](AcConfig& a) {
    a.policy = "every:2";
    a.preserve_rng_state = false;
  };
  EXPECT_EQ(error_ac(no_rng, 4, 0.1),
            "ac.preserve_rng_state = false with dropout 0.1 makes recomputed dropout draw other masks than the "
            "forward did, which silently changes training; keep ac.preserve_rng_state = true, or set "
            "ac.allow_rng_mismatch = true to accept the mismatch.");
  EXPECT_EQ(error_ac(no_rng, 4, 0.0), "");  // no dropout: nothing to replay
  EXPECT_EQ(error_ac(
                [&](AcConfig& a) {
                  no_rng(a);
                  a.allow_rng_mismatch = true;
                },
                4, 0.1),
            "");
  EXPECT_EQ(error_ac([](AcConfig& a) { a.preserve_rng_state = false; }, 4, 0.1), "");  // nothing recomputed
}

// ---- explain_plan --------------------------------------------------------------------------

TEST(PolicyExplain, GroupsIdenticalLayersAndShowsChunks) {
  const std::string full = explain_plan(compile_policy("full", 3));
  EXPECT_EQ(full,
            "policy: full (3 layers, numbered from 1)\n"
            "layers  keeps             drops  chunk\n"
            "1-3     block input only  all    -\n");
  const std::string every = explain_plan(compile_policy("every:2", 4));
  EXPECT_NE(every.find("policy: every:2 (4 layers, numbered from 1)\n"), std::string::npos) << every;
  EXPECT_NE(every.find("\n1       all               -      -\n"), std::string::npos) << every;
  EXPECT_NE(every.find("\n2       block input only  all    -\n"), std::string::npos) << every;
  const std::string uniform = explain_plan(compile_policy("uniform:2", 5));
  EXPECT_EQ(uniform,
            "policy: uniform:2 (5 layers, numbered from 1)\n"
            "layers  keeps                                      drops  chunk\n"
            "1       block input only                           all    1-2\n"
            "2       nothing (recomputed from layer 1's input)  all    1-2\n"
            "3       block input only                           all    3-4\n"
            "4       nothing (recomputed from layer 3's input)  all    3-4\n"
            "5       block input only                           all    -\n");
  EXPECT_TRUE(same_layers(compile_policy("uniform:1", 3), compile_policy("full", 3)));
  const std::string mods = explain_plan(compile_policy("modules:[core_attn]", 2));
  EXPECT_NE(mods.find("1-2     block input, attn.norm, attn.qkv_in, attn.gathered, attn.qkv, attn.proj_in, "
                      "attn.resid, mlp.norm, mlp.fc_in, mlp.gathered, mlp.act_in, mlp.proj_in, mlp.resid  "
                      "attn.probs, attn.dropout  -\n"),
            std::string::npos)
      << mods;
}

// ---- offload ---------------------------------------------------------------------------------

std::vector<Slots> offloads(const ActivationPlan& p) {
  std::vector<Slots> out;
  for (const auto& l : p.layers) {
    const auto names = l.offloaded.names();
    out.emplace_back(names.begin(), names.end());
  }
  return out;
}

TEST(PolicyOffload, EachLayerOffloadsTheNamedSlotsItKeeps) {
  const ActivationPlan full = compile_policy("full + offload:[mlp, input]", 3);
  EXPECT_EQ(full.policy, "full+offload:[input,mlp.fc_in,mlp.gathered,mlp.act_in,mlp.proj_in,mlp.resid]");
  EXPECT_EQ(offloads(full), std::vector<Slots>(3, Slots{"input"}));  // the mlp slots are recomputed
  EXPECT_EQ(drops(full), std::vector<Slots>(3, all()));

  const ActivationPlan alone = compile_policy("none+offload:[attn]", 2);
  EXPECT_EQ(alone.policy,
            "offload:[attn.norm,attn.qkv_in,attn.gathered,attn.qkv,attn.probs,attn.dropout,"
            "attn.proj_in,attn.resid]");
  EXPECT_EQ(drops(alone), std::vector<Slots>(2, Slots{}));
  const ActivationPlan selective = compile_policy("modules:[core_attn]+offload:[attn]", 2);
  EXPECT_EQ(offloads(selective)[1],
            (Slots{"attn.norm", "attn.qkv_in", "attn.gathered", "attn.qkv", "attn.proj_in", "attn.resid"}));

  // A uniform chunk keeps only its first layer's input: that is what moves.
  const ActivationPlan uniform = compile_policy("uniform:2+offload:[input]", 3);
  EXPECT_EQ(offloads(uniform), (std::vector<Slots>{{"input"}, {}, {"input"}}));
  // A composition keeps its layers and adds the offload.
  const ActivationPlan three = compile_policy("every:2+modules:[act]+offload:[qkv]", 4);
  EXPECT_EQ(three.policy, "every:2+modules:[act]+offload:[attn.qkv]");
  EXPECT_EQ(offloads(three), (std::vector<Slots>{{"attn.qkv"}, {}, {"attn.qkv"}, {}}));
  EXPECT_EQ(drops(three)[0], Slots{"mlp.proj_in"});

  EXPECT_FALSE(same_layers(compile_policy("full", 2), compile_policy("full+offload:[input]", 2)));
  EXPECT_NE(explain_plan(full).find("offloaded to host\n1-3     block input only  all    -      input\n"),
            std::string::npos)
      << explain_plan(full);
}

TEST(PolicyOffload, TorchtunesActivationOffloadingOffloadsEveryKeptSlot) {
  AcConfig checkpointed;
  checkpointed.enable_activation_checkpointing = true;
  checkpointed.enable_activation_offloading = true;
  const ActivationPlan full = compile_policy(checkpointed, 3, 0.0);
  EXPECT_EQ(offloads(full), std::vector<Slots>(3, Slots{"input"}));
  EXPECT_EQ(full.policy.rfind("full+offload:[input,attn.norm,", 0), 0u) << full.policy;
  AcConfig alone;
  alone.enable_activation_offloading = true;
  Slots every = all();
  every.insert("input");
  EXPECT_EQ(offloads(compile_policy(alone, 2, 0.0)), std::vector<Slots>(2, every));
  alone.policy = "offload:[input]";
  EXPECT_EQ(error_of([&] { compile_policy(alone, 2, 0.0); }),
            "ac.policy = \"offload:[input]\" and ac.enable_activation_offloading = true both choose what moves to "
            "host memory; give the offload once (ac.policy = \"P+offload:[...]\" or one of the offload keys).");
}

TEST(PolicyOffload, ASelectionOffloadsOnlyItsLayers) {
  const ActivationPlan first = compile_policy("full+offload(block:2):[input]", 4);
  EXPECT_EQ(first.policy, "full+offload(block:2):[input]");
  EXPECT_EQ(offloads(first), (std::vector<Slots>{{"input"}, {"input"}, {}, {}}));
  EXPECT_EQ(offloads(compile_policy("offload(every:2):[qkv]", 4)),
            (std::vector<Slots>{{}, {"attn.qkv"}, {}, {"attn.qkv"}}));
  EXPECT_EQ(compile_policy("offload( ratio : 0.5 ):[input]", 4).policy, "offload(ratio:0.5):[input]");
  AcConfig staged;
  staged.policy = "offload(block:1):[input]";
  staged.stages = 2;
  EXPECT_EQ(offloads(compile_policy(staged, 4, 0.0)), (std::vector<Slots>{{"input"}, {}, {"input"}, {}}));
  EXPECT_NE(explain_plan(first).find("policy: full+offload(block:2):[input] (4 layers"), std::string::npos)
      << explain_plan(first);

  EXPECT_EQ(error_of([] { compile_policy("offload(first:2):[input]", 4); }),
            "ac.policy = \"offload(first:2):[input]\": 'offload(first:2):[input]' must be offload(S):[...] with S "
            "one of every:K, block:N or ratio:R, the layers that offload, e.g. offload(block:2):[input].");
  EXPECT_EQ(error_of([] { compile_policy("offload(block:5):[input]", 4); }),
            "ac.policy = \"offload(block:5):[input]\": N = 5 is larger than the model, which has 4 layers; use N "
            "between 1 and 4.");
  EXPECT_EQ(error_of([] { compile_policy("offload(ratio:0):[input]", 4); }),
            "ac.policy = \"offload(ratio:0):[input]\": offload(ratio:0) selects no layer, so it moves nothing to "
            "host memory; select at least one, e.g. offload(ratio:0.5):[input], or drop the offload term.");
  EXPECT_EQ(error_of([] { compile_policy("full+offload(every:2):[mlp]", 4); }),
            "ac.policy = \"full+offload(every:2):[mlp]\": offload(every:2):[mlp] moves nothing to host memory: the "
            "policy full recomputes every slot it names in every layer it selects, and a recomputed slot is not "
            "kept; offload slots the policy keeps, e.g. full+offload:[input].");
}

TEST(PolicyOffload, MegatronsOffloadModulesMapToTheSlotsTheyMove) {
  const auto modules = [](const std::string& names, int64_t layers = 3) {
    return compile_ac([&](AcConfig& a) { a.offload_modules = names; }, layers);
  };
  expect_same(modules("core_attn, attn_proj"), "offload:[attn.qkv,attn.probs,attn.dropout,attn.proj_in]", 3);
  expect_same(modules("[attn_norm]"), "offload:[input,attn.norm]", 3);
  expect_same(modules("qkv_linear"), "offload:[attn.qkv_in,attn.gathered]", 3);
  expect_same(modules("mlp_norm,attn_proj"), "offload:[attn.proj_in,mlp.norm]", 3);
  EXPECT_EQ(modules("core_attn").policy, "offload:[attn.qkv,attn.probs,attn.dropout]");

  // With Megatron's recompute keys, as its docs combine them.
  expect_same(compile_ac(
                  [](AcConfig& a) {
                    a.recompute_granularity = "selective";
                    a.recompute_modules = "core_attn";
                    a.offload_modules = "core_attn,attn_proj";
                  },
                  3),
              "modules:[core_attn]+offload:[attn.qkv,attn.probs,attn.dropout,attn.proj_in]", 3);
  // The canonical term lists what was asked; the recomputed slots among them stay put.
  EXPECT_TRUE(same_layers(compile_policy("modules:[core_attn]+offload:[attn.qkv,attn.proj_in]", 3),
                          compile_policy("modules:[core_attn]+offload:[qkv,attn.proj_in,core_attn]", 3)));
  const ActivationPlan chunks = compile_ac(
      [](AcConfig& a) {
        a.recompute_granularity = "full";
        a.recompute_method = "uniform";
        a.recompute_num_layers = 2;
        a.offload_modules = "layer_input";
      },
      5);
  expect_same(chunks, "uniform:2+offload:[input]", 5);
  EXPECT_EQ(offloads(chunks), (std::vector<Slots>{{"input"}, {}, {"input"}, {}, {"input"}}));
}

TEST(PolicyOffload, MegatronsOffloadModulesRefuseWhatDoesNotMap) {
  const std::string mapped =
      "the names that map are attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, layer_input (the dense MLP's "
      "slots: ac.policy = \"P+offload:[mlp]\").";
  EXPECT_EQ(error_ac([](AcConfig& a) { a.offload_modules = "core_attn,expert_fc1"; }, 3),
            "ac.offload_modules = \"core_attn,expert_fc1\": expert_fc1 offloads activations of MoE experts, and "
            "remat's blocks have none; " +
                mapped);
  EXPECT_EQ(error_ac([](AcConfig& a) { a.offload_modules = "core_atn"; }, 3),
            "ac.offload_modules = \"core_atn\": 'core_atn' is not one of Megatron's offload modules; " + mapped);
  EXPECT_EQ(error_ac([](AcConfig& a) { a.offload_modules = ""; }, 3),
            "ac.offload_modules is empty; list the modules whose saved inputs go to host memory (attn_norm, "
            "qkv_linear, core_attn, attn_proj, mlp_norm, layer_input), or drop it.");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.recompute_granularity = "full";
                  a.recompute_method = "block";
                  a.recompute_num_layers = 1;
                  a.offload_modules = "layer_input";
                },
                3),
            "ac.offload_modules = \"layer_input\": layer_input moves the input each recomputed layer restarts from, "
            "but the policy block:1 keeps layer 2's input without recomputing that layer whole; Megatron allows "
            "layer_input only with full recompute, so choose full or uniform:N (ac.recompute_granularity = "
            "\"full\" with ac.recompute_method = \"uniform\"), or drop layer_input.");
  // Recomputed whole, every slot but the input is gone: what mlp_norm names is not kept.
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.policy = "full";
                  a.offload_modules = "mlp_norm";
                },
                3),
            "ac.offload_modules = \"mlp_norm\": offload:[mlp.norm] moves nothing to host memory: the policy full "
            "recomputes every slot it names in every layer, and a recomputed slot is not kept; offload slots the "
            "policy keeps, e.g. full+offload:[input].");
}

TEST(PolicyOffload, TransformerEnginesNumLayersOffloadsTheFirstLayers) {
  const auto first = [](int64_t n, int64_t layers, int64_t stages = 1) {
    return compile_ac(
        [&](AcConfig& a) {
          a.cpu_offloading_num_layers = n;
          a.stages = stages;
        },
        layers);
  };
  expect_same(first(2, 4), "offload(block:2):[input,attn,mlp,mlp.norm]", 4);
  Slots every = all();
  every.insert("input");
  EXPECT_EQ(offloads(first(2, 4)), (std::vector<Slots>{every, every, {}, {}}));
  // Counted within each pipeline stage, as block:N is.
  expect_same(first(1, 6, 2), "offload(block:1):[input,attn,mlp,mlp.norm]", 6, 2);
  EXPECT_EQ(offloads(first(1, 4, 2)), (std::vector<Slots>{every, {}, every, {}}));
  // Composed with Megatron's recompute keys (Megatron itself refuses the pair): the
  // recomputed layers keep, and so move, only their inputs.
  const ActivationPlan full = compile_ac(
      [](AcConfig& a) {
        a.recompute_granularity = "full";
        a.recompute_method = "uniform";
        a.recompute_num_layers = 1;
        a.cpu_offloading_num_layers = 3;
      },
      4);
  expect_same(full, "uniform:1+offload(block:3):[input,attn,mlp,mlp.norm]", 4);
  EXPECT_EQ(offloads(full), (std::vector<Slots>{{"input"}, {"input"}, {"input"}, {}}));

  EXPECT_EQ(error_of([&] { first(0, 4); }),
            "ac.cpu_offloading_num_layers = 0 offloads no layer; give N of at least 1 (the first N layers of each "
            "pipeline stage keep every slot in host memory), or drop it.");
  EXPECT_EQ(error_of([&] { first(4, 4); }),
            "ac.cpu_offloading_num_layers = 4 is not less than the model's layers (4): Megatron offloads all but "
            "the last layer at most, whose backward follows its forward at once; give N below 4, or offload every "
            "layer with ac.enable_activation_offloading = true.");
  EXPECT_EQ(error_of([&] { first(3, 6, 2); }),
            "ac.cpu_offloading_num_layers = 3 is not less than the layers of the smallest pipeline stage (3): "
            "Megatron offloads all but the last layer at most, whose backward follows its forward at once; give N "
            "below 3, or offload every layer with ac.enable_activation_offloading = true.");
}

TEST(PolicyOffload, OneOffloadSpellingAtATime) {
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.policy = "full+offload:[input]";
                  a.cpu_offloading_num_layers = 1;
                },
                3),
            "ac.policy = \"full+offload:[input]\" and ac.cpu_offloading_num_layers = 1 both choose what moves to "
            "host memory; give the offload once (ac.policy = \"P+offload:[...]\" or one of the offload keys).");
  EXPECT_EQ(error_ac(
                [](AcConfig& a) {
                  a.offload_modules = "core_attn";
                  a.cpu_offloading_num_layers = 1;
                },
                3),
            "ac.offload_modules = \"core_attn\" and ac.cpu_offloading_num_layers = 1 both choose what moves to host "
            "memory; give the offload once (ac.policy = \"P+offload:[...]\" or one of the offload keys).");
  EXPECT_NE(error_ac(
                [](AcConfig& a) {
                  a.enable_activation_offloading = true;
                  a.offload_modules = "core_attn";
                },
                3)
                .find("ac.enable_activation_offloading = true and ac.offload_modules = \"core_attn\" both choose"),
            std::string::npos);
  // A false torchtune switch asks for nothing.
  EXPECT_NO_THROW(compile_ac(
      [](AcConfig& a) {
        a.enable_activation_offloading = false;
        a.offload_modules = "core_attn";
      },
      3));
}

TEST(PolicyOffload, AnOffloadThatCannotWorkIsASentence) {
  EXPECT_EQ(error_of([] { compile_policy("full+offload:[mlp]", 2); }),
            "ac.policy = \"full+offload:[mlp]\": offload:[mlp] moves nothing to host memory: the policy full "
            "recomputes every slot it names in every layer, and a recomputed slot is not kept; offload slots the "
            "policy keeps, e.g. full+offload:[input].");
  EXPECT_NE(error_of([] { compile_policy("offload:[bogus]", 2); })
                .find("unknown slot or module 'bogus'; valid slot "
                      "or modules are input, attn.norm"),
            std::string::npos);
  EXPECT_EQ(error_of([] { compile_policy("offload:[input]+full", 2); }),
            "ac.policy = \"offload:[input]+full\": offload:[...] is the last term of a policy (X+offload:[...]), "
            "got it before full.");
  AcConfig ac;
  ac.policy = "full+offload:[input]";
  ac.distribute_saved_activations = true;
  EXPECT_NE(error_of([&] {
              compile_policy(ac, 2, 0.0);
            }).find("offloads that input to host memory: a kept input is held one way"),
            std::string::npos);
}

// ---- configuration -------------------------------------------------------------------------

std::string write_temp(const std::string& text) {
  char name[] = "/tmp/remat-policy-XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(name) << text;
  return name;
}

TEST(PolicyConfig, AcKeysLoadFromTomlAndOverridesAndRoundTrip) {
  const std::string path = write_temp(
      "[model]\nn_layer = 4\n[ac]\nrecompute_modules = [\"mlp\", \"core_attn\"]\n"
      "num_layers_per_stage = [1, 3]\nstages = 2\n");
  const Config c = load_config(path, {"ac.recompute_granularity=selective", "ac.check=meta"});
  std::remove(path.c_str());
  EXPECT_EQ(c.ac.recompute_modules, std::optional<std::string>("mlp,core_attn"));
  EXPECT_EQ(c.ac.num_layers_per_stage, std::optional<std::string>("1,3"));
  EXPECT_EQ(c.ac.recompute_granularity, std::optional<std::string>("selective"));
  EXPECT_FALSE(c.ac.ac_mode.has_value());
  EXPECT_EQ(c.ac.check, "meta");
  EXPECT_EQ(compile_policy(c.ac, c.model.n_layer, c.model.dropout).policy, "modules:[core_attn,mlp]");

  const std::string toml = config_to_toml(c);
  EXPECT_NE(toml.find("\n[ac]\n# policy = (unset)\n"), std::string::npos) << toml;
  EXPECT_NE(toml.find("\nrecompute_modules = [\"mlp\", \"core_attn\"]\n"), std::string::npos) << toml;
  EXPECT_NE(toml.find("\nnum_layers_per_stage = [1, 3]\n"), std::string::npos) << toml;
  EXPECT_NE(toml.find("\n# ac_mode = (unset)\n"), std::string::npos) << toml;
  const std::string again_path = write_temp(toml);
  const Config again = load_config(again_path, {});
  std::remove(again_path.c_str());
  EXPECT_EQ(config_to_toml(again), toml);

  // Overrides give lists as comma strings; an empty value unsets an alias again.
  const Config o = load_config("", {"ac.stages=2", "ac.num_ckpt_layers_per_stage=1,2", "ac.ac_option=op",
                                    "ac.ac_option=", "ac.recompute_num_layers=3", "ac.recompute_num_layers="});
  EXPECT_EQ(o.ac.num_ckpt_layers_per_stage, std::optional<std::string>("1,2"));
  EXPECT_FALSE(o.ac.ac_option.has_value());
  EXPECT_FALSE(o.ac.recompute_num_layers.has_value());
  const std::string o_toml = config_to_toml(o);
  EXPECT_NE(o_toml.find("\nnum_ckpt_layers_per_stage = [1, 2]\n"), std::string::npos) << o_toml;
  const Config t =
      load_config("", {"ac.enable_activation_checkpointing=true", "ac.ac_mode=selective", "ac.ac_option=2"});
  EXPECT_NE(config_to_toml(t).find("\nac_option = 2\n"), std::string::npos);
  EXPECT_EQ(compile_policy(t.ac, t.model.n_layer, t.model.dropout).policy, "every:2");
  const Config m = load_config("", {"ac.offload_modules=core_attn,attn_proj", "ac.recompute_granularity=selective"});
  EXPECT_NE(config_to_toml(m).find("\noffload_modules = [\"core_attn\", \"attn_proj\"]\n"), std::string::npos);
  EXPECT_EQ(compile_policy(m.ac, m.model.n_layer, m.model.dropout).policy,
            "modules:[core_attn]+offload:[attn.qkv,attn.probs,attn.dropout,attn.proj_in]");
  const Config te = load_config("", {"ac.cpu_offloading_num_layers=2"});
  EXPECT_EQ(te.ac.cpu_offloading_num_layers, std::optional<int64_t>(2));
  EXPECT_EQ(compile_policy(te.ac, te.model.n_layer, te.model.dropout).policy.rfind("offload(block:2):[input,", 0), 0u);
}

TEST(PolicyConfig, AnExplicitNoneAndARecomputingAliasAreRefusedInEitherOrderAndInToml) {
  const std::string refusal =
      "ac.policy = \"none\" asks for none but ac.enable_activation_checkpointing = true asks "
      "for full: two spellings of the recompute policy disagree. Set only one of them.";
  EXPECT_EQ(error_of([] {
              load_run_config("", {"ac.policy=none", "ac.enable_activation_checkpointing=true"});
            }),
            refusal);
  EXPECT_EQ(error_of([] {
              load_run_config("", {"ac.enable_activation_checkpointing=true", "ac.policy=none"});
            }),
            refusal);
  const std::string path = write_temp("[ac]\npolicy = \"none\"\nenable_activation_checkpointing = true\n");
  EXPECT_EQ(error_of([&] { load_run_config(path, {}); }), refusal);
  std::remove(path.c_str());
  // And with a budget, which asks the planner: an explicit policy of any kind is a second answer.
  EXPECT_NE(error_of([] {
              load_run_config("", {"ac.policy=none", "ac.budget=0.6"});
            }).find("keep one of them"),
            std::string::npos);
}

TEST(PolicyConfig, LoadRefusesABadPolicyAndSuggestsAcKeys) {
  EXPECT_EQ(error_of([] { load_run_config("", {"ac.policy=every:9"}); }),
            "ac.policy = \"every:9\": K = 9 is larger than the model, which has 4 layers; use K between 1 and 4.");
  EXPECT_EQ(error_of([] { load_config("", {"ac.recompute_granularty=full"}); }),
            "Unknown config key 'ac.recompute_granularty' (command-line override); did you mean "
            "'ac.recompute_granularity'?");
  EXPECT_EQ(error_of([] { load_config("", {"ac.recompute_layer=maybe"}); }),
            "ac.recompute_layer must be true or false, got 'maybe'.");
}

}  // namespace
}  // namespace remat
