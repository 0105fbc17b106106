// Attention holding a tensor-parallel share of the heads (Attrs::sharded) draws the dropout
// masks the one-process run draws for those heads, so each rank's results are bitwise the
// head slice of the one-process results.
#include "remat/graph.h"

#include "ops/testing.h"
#include "util/local_group.h"
#include "util/sdpa.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace remat;
using remat::testing::seeded;

constexpr double kP = 0.1;

struct Shape {
  int64_t B, T, Hq, Hkv, D;
};

// What one run of an attention op gives: its forward's outputs (math: out, probs, mask,
// probs_d; tiled and sdpa: out, lse) and its input gradients (dq, dk, dv).
struct Results {
  std::vector<at::Tensor> out;
  std::vector<at::Tensor> grads;
};

// The forward, then what a backward finding the op's outputs dropped does: recompute them
// (checked bitwise against the forward's) and run the backward on the recomputed ones.
Results run(const graph::OpDef& op, const graph::Attrs& a, const graph::RunContext& ctx, const at::Tensor& qkv,
            int64_t Hq, int64_t Hkv, const at::Tensor& dout) {
  const std::vector<at::Tensor> in = {qkv.narrow(2, 0, Hq), qkv.narrow(2, Hq, Hkv), qkv.narrow(2, Hq + Hkv, Hkv)};
  Results r{op.forward(in, {}, a, ctx), {}};
  const std::vector<at::Tensor> again = op.forward(in, {}, a, ctx);
  for (size_t j = 0; j < again.size(); ++j) {
    if (!at::equal(again[j], r.out[j])) throw std::runtime_error("recomputed output " + std::to_string(j) + " differs");
  }
  std::vector<at::Tensor> dy(again.size());
  dy[0] = dout;
  std::vector<at::Tensor*> no_param_grads;
  r.grads = op.backward(dy, in, again, {}, no_param_grads, a, ctx);
  return r;
}

graph::RunContext context(int64_t first_row) {
  graph::RunContext ctx;
  ctx.seed = 11;
  ctx.step = 2;
  ctx.microbatch = 1;
  ctx.layer = 3;
  ctx.first_row = first_row;
  return ctx;
}

// Runs `op` on all heads of first_row + s.B batch rows in one process, then on `ranks` ranks
// each holding its share of the heads of the last s.B rows (keyed with first_row, as a
// data-parallel rank holding them is), and expects each rank's outputs and gradients to be
// bitwise their slice of the one-process ones. `out_heads`: per output, its head dimension
// and whether it counts key/value heads (grouped rows) or query heads.
struct HeadDim {
  int64_t dim;
  bool kv;
};
void expect_head_slices(const graph::OpDef& op, const graph::Attrs& attrs, const std::vector<HeadDim>& out_heads,
                        int ranks, const Shape& s, int64_t first_row) {
  const std::string what = std::string(&op == &graph::op::tiled_attention()  ? "tiled"
                                       : &op == &graph::op::sdpa_attention() ? "sdpa"
                                                                             : "math") +
                           " on " + std::to_string(ranks) + " ranks, Hq " + std::to_string(s.Hq) + ", Hkv " +
                           std::to_string(s.Hkv) + ", first_row " + std::to_string(first_row);
  const int64_t B = first_row + s.B, Hl = s.Hq / ranks, Kl = s.Hkv / ranks;
  at::Generator gen = seeded(static_cast<uint64_t>(17 + ranks + first_row));
  // q, k, v as one fused projection [B, T, Hq + 2 Hkv, D], as the models produce them.
  const at::Tensor qkv = at::randn({B, s.T, s.Hq + 2 * s.Hkv, s.D}, gen);
  const at::Tensor dout = at::randn({B, s.T, s.Hq, s.D}, gen);
  const Results whole = run(op, attrs, context(0), qkv, s.Hq, s.Hkv, dout);
  ASSERT_EQ(whole.out.size(), out_heads.size()) << what;

  std::vector<Results> shards(static_cast<size_t>(ranks));
  remat::testing::on_local_ranks(ranks, [&](dist::Group& group) {
    const int64_t r = group.rank();
    graph::Attrs sharded = attrs;
    sharded.sharded = true;
    graph::RunContext ctx = context(first_row);
    ctx.tp = &group;
    // The rank's rows and heads, fused as its share of a column-parallel projection gives them.
    const at::Tensor rows = qkv.narrow(0, first_row, s.B);
    const at::Tensor own = at::cat(
        {rows.narrow(2, r * Hl, Hl), rows.narrow(2, s.Hq + r * Kl, Kl), rows.narrow(2, s.Hq + s.Hkv + r * Kl, Kl)}, 2);
    shards[static_cast<size_t>(r)] =
        run(op, sharded, ctx, own, Hl, Kl, dout.narrow(0, first_row, s.B).narrow(2, r * Hl, Hl).contiguous());
  });

  for (int64_t r = 0; r < ranks; ++r) {
    const Results& shard = shards[static_cast<size_t>(r)];
    const auto slice = [&](const at::Tensor& t, int64_t head_dim, int64_t heads) {
      return t.narrow(0, first_row, s.B).narrow(head_dim, r * heads, heads);
    };
    ASSERT_EQ(shard.out.size(), whole.out.size()) << what;
    for (size_t j = 0; j < whole.out.size(); ++j) {
      EXPECT_TRUE(at::equal(shard.out[j], slice(whole.out[j], out_heads[j].dim, out_heads[j].kv ? Kl : Hl)))
          << what << ": output " << op.output_name(j) << " of rank " << r;
    }
    const char* const names[] = {"dq", "dk", "dv"};
    for (size_t j = 0; j < 3; ++j) {
      EXPECT_TRUE(at::equal(shard.grads[j], slice(whole.grads[j], 2, j == 0 ? Hl : Kl)))
          << what << ": " << names[j] << " of rank " << r;
    }
  }
}

// Grouped-query heads split so that each rank holds whole groups: 8 query heads over 2
// key/value heads on 2 ranks, over 4 on 4 ranks. T = 13 is no multiple of the tiles.
const Shape kTwoRanks{2, 13, 8, 2, 4};
const Shape kFourRanks{2, 13, 8, 4, 4};

graph::Attrs attention_attrs() {
  graph::Attrs a;
  a.p = kP;
  a.site = ops::DropoutSite::attn_probs;
  a.tiles = {4, 8};
  return a;
}

TEST(ShardedAttention, MathOpRanksHoldTheOneProcessHeadSlices) {
  for (int64_t first_row : {0, 1}) {
    // out [B, T, Hq, D], probs [B, Hkv, T, G, T], mask [B, Hq, T, T], probs_d as probs.
    const std::vector<HeadDim> outs = {{2, false}, {1, true}, {1, false}, {1, true}};
    expect_head_slices(graph::op::attention(), attention_attrs(), outs, 2, kTwoRanks, first_row);
    expect_head_slices(graph::op::attention(), attention_attrs(), outs, 4, kFourRanks, first_row);
  }
}

TEST(ShardedAttention, TiledOpRanksHoldTheOneProcessHeadSlices) {
  for (int64_t first_row : {0, 1}) {
    const std::vector<HeadDim> outs = {{2, false}, {1, false}};  // out, lse [B, Hq, T]
    expect_head_slices(graph::op::tiled_attention(), attention_attrs(), outs, 2, kTwoRanks, first_row);
    expect_head_slices(graph::op::tiled_attention(), attention_attrs(), outs, 4, kFourRanks, first_row);
  }
}

// sdpa draws no dropout: its shares are the one-process head slices all the same.
TEST(ShardedAttention, SdpaOpRanksHoldTheOneProcessHeadSlices) {
  REMAT_SKIP_WITHOUT_SDPA();
  graph::Attrs attrs = attention_attrs();
  attrs.p = 0;
  for (int64_t first_row : {0, 1}) {
    const std::vector<HeadDim> outs = {{2, false}, {2, false}};  // out, lse [B, T, Hq]
    expect_head_slices(graph::op::sdpa_attention(), attrs, outs, 2, kTwoRanks, first_row);
    expect_head_slices(graph::op::sdpa_attention(), attrs, outs, 4, kFourRanks, first_row);
  }
}

// A node the transform left whole (not sharded) draws the one-process mask on every rank of
// the group, whatever its rank.
TEST(ShardedAttention, AnUnshardedOpIgnoresTheGroup) {
  const Shape& s = kTwoRanks;
  at::Generator gen = seeded(23);
  const at::Tensor qkv = at::randn({s.B, s.T, s.Hq + 2 * s.Hkv, s.D}, gen);
  const at::Tensor dout = at::randn({s.B, s.T, s.Hq, s.D}, gen);
  for (const graph::OpDef* op : {&graph::op::attention(), &graph::op::tiled_attention()}) {
    const Results want = run(*op, attention_attrs(), context(0), qkv, s.Hq, s.Hkv, dout);
    std::vector<Results> got(2);
    remat::testing::on_local_ranks(2, [&](dist::Group& group) {
      graph::RunContext ctx = context(0);
      ctx.tp = &group;
      got[static_cast<size_t>(group.rank())] = run(*op, attention_attrs(), ctx, qkv, s.Hq, s.Hkv, dout);
    });
    for (const Results& g : got) {
      for (size_t j = 0; j < want.out.size(); ++j) EXPECT_TRUE(at::equal(g.out[j], want.out[j])) << op->output_name(j);
      for (size_t j = 0; j < 3; ++j) EXPECT_TRUE(at::equal(g.grads[j], want.grads[j])) << "input gradient " << j;
    }
  }
}

}  // namespace
