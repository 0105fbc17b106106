// A run's plan as its checkpoints keep it: written and read back whole, and refused with a
// sentence when damaged or made for another model.
#include "remat/policy.h"
#include "run/planning.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace remat {
namespace {

std::string refusal(const std::string& json, int64_t n_layers, int64_t stages) {
  try {
    parse_saved_plan(json, n_layers, stages);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(SavedPlan, ReadsBackChunksSharedInputsKeptWeightsAndTheSplit) {
  RunPlan r;
  r.plan = compile_policy("layers:[full,modules:[core_attn],none,none,ops:[matmul],full]", 6);
  // uniform:2's chunk structure on the last two layers, and a sharded kept input.
  r.plan.layers[4].chunk_begin = 4;
  r.plan.layers[5].chunk_begin = 4;
  r.plan.layers[2].input_sharded = true;
  // model.attention = auto per layer: the ops named.
  r.plan.layers[1].attention = Attention::tiled;
  r.plan.layers[3].attention = Attention::math;
  // A budget plan's offloaded slots, the input among them.
  r.plan.layers[2].offloaded = {Slot::input, Slot::mlp_act_in};
  // ZeRO-3: layers keeping their gathered weights to their backward.
  r.plan.layers[0].weights_kept = true;
  r.plan.layers[3].weights_kept = true;
  r.plan.policy = "budget:123";
  r.split = {2, 4};
  const SavedPlan back = parse_saved_plan(saved_plan_json(r.plan, r.split), 6, 2);
  EXPECT_TRUE(same_layers(back.plan, r.plan));
  EXPECT_EQ(back.plan.policy, "budget:123");
  EXPECT_EQ(back.split, r.split);
  for (size_t l = 0; l < 6; ++l) {
    EXPECT_EQ(back.plan.layers[l].chunk_begin, r.plan.layers[l].chunk_begin) << l;
    EXPECT_EQ(back.plan.layers[l].input_sharded, r.plan.layers[l].input_sharded) << l;
    EXPECT_EQ(back.plan.layers[l].attention, r.plan.layers[l].attention) << l;
    EXPECT_EQ(back.plan.layers[l].offloaded, r.plan.layers[l].offloaded) << l;
    EXPECT_EQ(back.plan.layers[l].weights_kept, r.plan.layers[l].weights_kept) << l;
  }
}

TEST(SavedPlan, ADamagedPlanOrAnotherModelsIsASentence) {
  RunPlan r;
  r.plan = compile_policy("full", 2);
  r.split = {2};
  const std::string good = saved_plan_json(r.plan, r.split);
  const std::string tail = "; resume from a checkpoint this model's run wrote, or start the run again.";
  EXPECT_EQ(refusal(good, 3, 1),
            "The checkpoint's plan (its \"plan\" metadata) has 2 layers where the model has 3" + tail);
  EXPECT_EQ(refusal(good, 2, 2),
            "The checkpoint's plan (its \"plan\" metadata) splits the layers as [2], but this run "
            "puts its 2 layers on 2 pipeline stages" +
                tail);
  EXPECT_EQ(refusal("[1]", 2, 1), "The checkpoint's plan (its \"plan\" metadata) is not a JSON object" + tail);
  EXPECT_EQ(refusal(R"({"policy":"x","split":[2],"layers":[{"dropped":["nope"],"chunk_begin":-1,"input_sharded":false},
                       {"dropped":[],"chunk_begin":-1,"input_sharded":false}]})",
                    2, 1),
            "The checkpoint's plan (its \"plan\" metadata) drops 'nope' in layer 1, which no block has" + tail);
  // Its policy and names are printed (plan.txt, the terminal): no control character passes.
  EXPECT_EQ(refusal(R"({"policy":"full\u001b[2J\u0000","split":[2],"layers":[]})", 2, 1),
            "The checkpoint's plan (its \"plan\" metadata) names its policy 'full\\x1b[2J\\x00', with a control "
            "character" +
                tail);
  EXPECT_EQ(refusal(R"({"policy":"x","split":[2],"layers":[{"dropped":["a\u001b[0m"],"chunk_begin":-1,
                       "input_sharded":false}]})",
                    2, 1),
            "The checkpoint's plan (its \"plan\" metadata) drops 'a\\x1b[0m' in layer 1, which no block has" + tail);
  EXPECT_EQ(refusal(R"({"policy":"x","split":[2],"layers":[{"dropped":[],"chunk_begin":-1,"input_sharded":false},
                       {"dropped":[],"chunk_begin":5,"input_sharded":false}]})",
                    2, 1),
            "The checkpoint's plan (its \"plan\" metadata) begins layer 2's chunk at layer 6" + tail);
  EXPECT_EQ(refusal(R"({"policy":"x","split":[2],"layers":[{"dropped":[],"chunk_begin":-1,"input_sharded":false},
                       {"dropped":[],"chunk_begin":-1,"input_sharded":false,"attention":"flash"}]})",
                    2, 1),
            fmt::format("The checkpoint's plan (its \"plan\" metadata) runs attention 'flash' in layer 2, which is "
                        "none of this build's ops ({}){}",
                        kSdpaBuilt ? "math, tiled, sdpa" : "math, tiled", tail));
  EXPECT_EQ(refusal(R"({"policy":"x","split":[2]})", 2, 1)
                .rfind("The checkpoint's plan (its \"plan\" metadata) is "
                       "damaged (",
                       0),
            0u);
}

}  // namespace
}  // namespace remat
