// The block graph's own rules, on a four-node block written here: where each value dies
// (Lifetimes), the order of a walk's copies to host memory and back (BlockRun over a
// backend that only records), the slot table Builder::finish refuses, and the splits the
// tensor-parallel transform refuses.
#include "graph/walk.h"
#include "remat/graph.h"
#include "util/error_of.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <climits>
#include <memory>
#include <string>
#include <vector>

namespace remat::graph {
namespace {

using testing::error_of;

// x [2, 3, 4] -> fc (linear to 8 features) -> act (gelu) -> proj (linear to 4) -> out (x + proj).
struct Mlp {
  Builder b{{{2, 3, 4}, at::kFloat, {}}, at::kFloat};
  int fc, act, proj, out;
  explicit Mlp(int64_t features = 8) {
    const int fc_w = b.param("fc.weight", {features, 4}), fc_b = b.param("fc.bias", {features});
    const int proj_w = b.param("proj.weight", {4, features}), proj_b = b.param("proj.bias", {4});
    fc = b.add1("fc", op::linear(), {b.input()}, {fc_w, fc_b});
    act = b.add1("act", op::gelu(), {fc});
    proj = b.add1("proj", op::linear(), {act}, {proj_w, proj_b});
    out = b.add1("out", op::residual(), {b.input(), proj});
  }
  // The slot table every test but the refused ones uses.
  BlockGraph finish() {
    b.slot(Slot::input, {b.input()});
    b.slot(Slot::mlp_act_in, {fc});
    b.slot(Slot::mlp_proj_in, {act});
    return b.finish(out);
  }
};

TEST(Lifetimes, EachValueDiesAfterItsLastReaderInEitherDirection) {
  Mlp m;
  const BlockGraph g = m.finish();
  const Lifetimes lt(g);
  const int x = g.input;
  // Forward: the input lives until the residual, every other value until its one reader.
  EXPECT_EQ(lt.last_forward_reader[x], 3);
  EXPECT_EQ(lt.last_forward_reader[m.fc], 1);
  EXPECT_EQ(lt.last_forward_reader[m.act], 2);
  EXPECT_EQ(lt.last_forward_reader[m.proj], 3);
  EXPECT_EQ(lt.last_forward_reader[m.out], -1);
  // Backward: a linear and gelu save their input, the residual nothing.
  EXPECT_EQ(lt.last_backward_reader[x], 0);
  EXPECT_EQ(lt.last_backward_reader[m.fc], 1);
  EXPECT_EQ(lt.last_backward_reader[m.act], 2);
  EXPECT_EQ(lt.last_backward_reader[m.proj], INT_MAX);
  // The input's gradient is summed from two readers, in forward order.
  EXPECT_EQ(lt.grad_readers[x], (std::vector<int>{0, 3}));
  EXPECT_EQ(lt.grad_readers[m.act], (std::vector<int>{2}));
  EXPECT_EQ(lt.runs_backward, (std::vector<bool>{true, true, true, true}));
}

TEST(Lifetimes, AKeyOnlyMaskCarriesNoGradient) {
  Builder b({{2, 3, 4}, at::kFloat, {}}, at::kFloat);
  const auto [dropped, mask] = b.dropout("drop", b.input(), 0.5, ops::DropoutSite::attn_resid);
  const int out = b.add1("out", op::residual(), {b.input(), dropped});
  b.slot(Slot::input, {b.input()});
  b.slot(Slot::attn_resid, {mask});
  const BlockGraph g = b.finish(out);
  const Lifetimes lt(g);
  const int mask_node = g.values[mask].producer;
  EXPECT_FALSE(lt.runs_backward[mask_node]);
  EXPECT_TRUE(lt.grad_readers[mask].empty());               // the apply node's mask input is not differentiable
  EXPECT_EQ(lt.last_backward_reader[mask], mask_node + 1);  // read by the apply node's backward
  EXPECT_TRUE(g.saved[mask]);
  EXPECT_FALSE(g.saved[dropped]);
}

// A backend that runs nothing: every result is a fresh buffer named after its value, and
// each call a line of the log.
struct Buffer {
  std::string name;
};
struct Recorder {
  using Tensor = std::shared_ptr<Buffer>;
  struct Moved {
    std::vector<Tensor> tensors;
    uint64_t ticket;
  };
  const BlockGraph& g;
  std::vector<std::string> log;
  uint64_t tickets = 0;

  static std::string names(const std::vector<Tensor>& ts) {
    std::string s;
    for (const Tensor& t : ts) s += (s.empty() ? "" : ",") + t->name;
    return s;
  }
  std::vector<Tensor> forward(int node, const std::vector<Tensor>&, bool recompute) {
    log.push_back((recompute ? "recompute " : "forward ") + g.nodes[node].name);
    std::vector<Tensor> out;
    for (int v : g.nodes[node].outputs) out.push_back(std::make_shared<Buffer>(Buffer{g.values[v].name}));
    return out;
  }
  std::vector<Tensor> backward(int node, const std::vector<Tensor>&, const std::vector<Tensor>&,
                               const std::vector<Tensor>&) {
    log.push_back("backward " + g.nodes[node].name);
    std::vector<Tensor> grads;
    for (int v : g.nodes[node].inputs) grads.push_back(std::make_shared<Buffer>(Buffer{"d" + g.values[v].name}));
    return grads;
  }
  Tensor add(const Tensor& a, const Tensor&) {
    log.push_back("add " + a->name);
    return a;
  }
  void dropped(int v, const Tensor&) { log.push_back("drop " + g.values[v].name); }
  void refilled(Slot s, const std::vector<Tensor>&) { log.push_back("refilled " + slot_name(s)); }
  template <class F>
  void recompute(F&& f) {
    f();
  }
  bool early_stop() const { return true; }
  Tensor shard(const Tensor& t) { return t; }
  Tensor gather(const Tensor& t) { return t; }
  Moved offload(const std::vector<Tensor>& group) {
    log.push_back(fmt::format("offload {} #{}", names(group), ++tickets));
    return {group, tickets};
  }
  Moved fetch(const std::vector<Tensor>& group) {
    log.push_back(fmt::format("fetch {} #{}", names(group), ++tickets));
    return {group, tickets};
  }
  void await(uint64_t ticket) { log.push_back(fmt::format("await #{}", ticket)); }
};

// An offloaded value leaves once produced, the forward's end waits for the last copy out;
// the copies back start before the backward, the value the backward reads first first, and
// each is awaited where the backward first reads it.
TEST(BlockRun, CopiesOutAsProducedAndBackInTheOrderTheBackwardReads) {
  Mlp m;
  const BlockGraph g = m.finish();
  const Lifetimes lt(g);
  Recorder rec{g, {}};
  BlockRun<Recorder> run(g, lt, std::vector<bool>(kSlotCount, true), true, InputHold::whole,
                         {Slot::mlp_act_in, Slot::mlp_proj_in});
  run.backward(rec, run.forward(rec, std::make_shared<Buffer>(Buffer{"x"})));
  EXPECT_EQ(rec.log, (std::vector<std::string>{
                         "forward fc", "offload fc #1", "forward act", "offload act #2", "forward proj", "forward out",
                         "await #2",                     // the forward's end
                         "fetch act #3", "fetch fc #4",  // restore: the backward reads act first
                         "backward out", "await #3", "backward proj", "await #4", "backward act", "backward fc",
                         "add dx",  // the input's gradient: fc's part, then the residual's
                     }));
}

// A dropped slot is recomputed from what is kept, the offloaded value awaited before the
// recompute reads it.
TEST(BlockRun, ARecomputeAwaitsTheOffloadedValueItReads) {
  Mlp m;
  const BlockGraph g = m.finish();
  const Lifetimes lt(g);
  std::vector<bool> keep(kSlotCount, true);
  keep[static_cast<size_t>(Slot::mlp_proj_in)] = false;
  Recorder rec{g, {}};
  BlockRun<Recorder> run(g, lt, keep, true, InputHold::whole, {Slot::mlp_act_in});
  run.backward(rec, run.forward(rec, std::make_shared<Buffer>(Buffer{"x"})));
  EXPECT_EQ(rec.log, (std::vector<std::string>{"forward fc", "offload fc #1", "forward act", "forward proj", "drop act",
                                               "forward out", "await #1", "fetch fc #2", "backward out", "await #2",
                                               "recompute act", "refilled mlp.proj_in",  // act again, from fc
                                               "backward proj", "backward act", "backward fc", "add dx"}));
}

TEST(BuilderFinish, RefusesASavedValueInNoSlot) {
  Mlp m;
  m.b.slot(Slot::input, {m.b.input()});
  m.b.slot(Slot::mlp_act_in, {m.fc});
  EXPECT_NE(error_of<c10::Error>([&] { m.b.finish(m.out); }).find("value act is read by a backward but is in no slot"),
            std::string::npos);
}

TEST(BuilderFinish, RefusesAValueInTwoSlots) {
  Mlp m;
  m.b.slot(Slot::input, {m.b.input()});
  m.b.slot(Slot::mlp_act_in, {m.fc});
  m.b.slot(Slot::mlp_proj_in, {m.act, m.fc});
  EXPECT_NE(error_of<c10::Error>([&] { m.b.finish(m.out); }).find("value fc is in two slots"), std::string::npos);
}

TEST(BuilderFinish, RefusesAnInputSlotWithoutTheBlockInput) {
  Mlp m;
  m.b.slot(Slot::input, {m.fc});
  m.b.slot(Slot::mlp_proj_in, {m.act});
  EXPECT_NE(error_of<c10::Error>([&] { m.b.finish(m.out); }).find("Slot::input must hold exactly the block input"),
            std::string::npos);
}

// Dropping one of two slots that share memory (a value and its view) would free nothing.
TEST(BuilderFinish, RefusesTwoSlotsSharingMemory) {
  Builder b({{2, 3, 4}, at::kFloat, {}}, at::kFloat);
  const int w = b.param("fc.weight", {4, 4});
  const int act = b.add1("act", op::gelu(), {b.input()});
  const int rows = b.view("rows", act, {6, 4});
  const int fc = b.add1("fc", op::linear(), {rows}, {w});
  b.slot(Slot::input, {b.input()});
  b.slot(Slot::mlp_act_in, {act});
  b.slot(Slot::mlp_proj_in, {rows});
  EXPECT_NE(
      error_of<c10::Error>([&] { b.finish(fc); }).find("slots mlp.act_in and mlp.proj_in share the memory of rows"),
      std::string::npos);
}

TEST(BuilderFinish, RefusesAShardInItsGatheredValuesSlot) {
  Mlp m;
  m.b.gathered(m.fc, m.act);
  m.b.slot(Slot::input, {m.b.input()});
  m.b.slot(Slot::mlp_act_in, {m.fc, m.act});
  EXPECT_NE(
      error_of<c10::Error>([&] { m.b.finish(m.out); }).find("the shard fc and its gathered value must be in two slots"),
      std::string::npos);
}

TEST(BuilderFinish, FillsTheSlotOfEachValue) {
  Mlp m;
  const BlockGraph g = m.finish();
  EXPECT_EQ(g.slot_of[g.input], static_cast<int>(Slot::input));
  EXPECT_EQ(g.slot_of[m.fc], static_cast<int>(Slot::mlp_act_in));
  EXPECT_EQ(g.slot_of[m.act], static_cast<int>(Slot::mlp_proj_in));
  EXPECT_EQ(g.slot_of[m.proj], -1);
  EXPECT_EQ(g.saved, (std::vector<bool>{true, true, true, false, false}));
}

const TensorParallelPlan kMlpPlan{{"fc"}, {"proj"}, {}};

// The block as the architectures write one: a norm before the column-parallel linear (a
// column linear reading the block input itself would put the input's tp_copy in
// Slot::input, which Builder::finish refuses).
TEST(TensorParallelTransform, SplitsTheColumnAndRowLinearsBetweenACopyAndAReduce) {
  Builder b({{2, 3, 4}, at::kFloat, {}}, at::kFloat);
  const int ln_w = b.param("ln.weight", {4}), ln_b = b.param("ln.bias", {4});
  const int fc_w = b.param("fc.weight", {8, 4}), fc_b = b.param("fc.bias", {8});
  const int proj_w = b.param("proj.weight", {4, 8}), proj_b = b.param("proj.bias", {4});
  Attrs norm;
  norm.eps = 1e-5;
  const auto ln = b.add("ln", op::layernorm(), {b.input()}, {ln_w, ln_b}, norm);
  const int fc = b.add1("fc", op::linear(), {ln[0]}, {fc_w, fc_b});
  const int act = b.add1("act", op::gelu(), {fc});
  const int proj = b.add1("proj", op::linear(), {act}, {proj_w, proj_b});
  const int out = b.add1("out", op::residual(), {b.input(), proj});
  b.slot(Slot::input, {b.input()});
  b.slot(Slot::mlp_norm, {ln[1], ln[2]});
  b.slot(Slot::mlp_fc_in, {ln[0]});
  b.slot(Slot::mlp_act_in, {fc});
  b.slot(Slot::mlp_proj_in, {act});
  const BlockGraph g = tensor_parallel(b.finish(out), kMlpPlan, 2);

  std::vector<std::string> nodes;
  for (const Node& n : g.nodes) nodes.push_back(n.name);
  EXPECT_EQ(nodes, (std::vector<std::string>{"ln", "fc_tp_copy", "fc", "act", "proj", "proj_tp_reduce", "out"}));
  EXPECT_EQ(g.params[2].sizes, (std::vector<int64_t>{4, 4}));  // fc.weight: half its rows
  EXPECT_EQ(g.params[3].sizes, (std::vector<int64_t>{4}));     // fc.bias: half
  EXPECT_EQ(g.params[4].sizes, (std::vector<int64_t>{4, 4}));  // proj.weight: half its columns
  EXPECT_EQ(g.params[5].sizes, (std::vector<int64_t>{4}));     // proj.bias: whole, added after the sum
  // The copy is the memory of the value it copies: in that value's slot.
  EXPECT_EQ(g.slot(Slot::mlp_fc_in).size(), 2u);
  EXPECT_EQ(g.tp, 2);
}

TEST(TensorParallelTransform, RefusesASplitThatIsNotEven) {
  Mlp m(6);
  const std::string error = error_of<c10::Error>([&] { tensor_parallel(m.finish(), kMlpPlan, 4); });
  EXPECT_NE(error.find("Tensor parallelism over 4 ranks splits the parameter of fc.weight (6) into equal shares, but "
                       "6 is not a multiple of 4; choose parallel.tp dividing it."),
            std::string::npos)
      << error;
}

TEST(TensorParallelTransform, RefusesAnOpWithoutAShareRuleBetweenTheRegions) {
  Builder b({{2, 3, 4}, at::kFloat, {}}, at::kFloat);
  const int fc_w = b.param("fc.weight", {8, 4}), ln_w = b.param("ln.weight", {8}), ln_b = b.param("ln.bias", {8});
  const int proj_w = b.param("proj.weight", {4, 8});
  const int fc = b.add1("fc", op::linear(), {b.input()}, {fc_w});
  Attrs norm;
  norm.eps = 1e-5;
  const auto ln = b.add("ln", op::layernorm(), {fc}, {ln_w, ln_b}, norm);
  const int proj = b.add1("proj", op::linear(), {ln[0]}, {proj_w});
  const BlockGraph g = b.finish_kept(proj);
  const std::string error = error_of<c10::Error>([&] { tensor_parallel(g, kMlpPlan, 2); });
  EXPECT_NE(error.find("[tensor_parallel] ln (layernorm) reads a rank's share of heads or features, but has no rule "
                       "for it"),
            std::string::npos)
      << error;
}

TEST(TensorParallelTransform, RefusesARowLinearReadingNoSplitValue) {
  Mlp m;
  const std::string error = error_of<c10::Error>([&] { tensor_parallel(m.finish(), {{}, {"proj"}, {}}, 2); });
  EXPECT_NE(error.find("[tensor_parallel] the row-parallel proj reads no split value"), std::string::npos) << error;
}

TEST(TensorParallelTransform, RefusesSequenceParallelismOverPositionsThatDoNotDivide) {
  Mlp m;  // 3 positions
  const std::string error = error_of<c10::Error>([&] { tensor_parallel(m.finish(), kMlpPlan, 2, /*sp=*/true); });
  EXPECT_NE(error.find("splits the positions of the sequence (3)"), std::string::npos) << error;
}

}  // namespace
}  // namespace remat::graph
