#include "remat/ops/embedding.h"

#include "remat/graph.h"

#include "ops/testing.h"
#include "util/local_group.h"

namespace {

using namespace remat::ops;
using namespace remat::testing;

TEST(EmbeddingOp, MatchesAutogradOfOneHotProduct) {
  at::Generator gen = seeded(1);
  for (auto shape : {std::vector<int64_t>{2, 5}, std::vector<int64_t>{3, 1}, std::vector<int64_t>{7}}) {
    const int64_t V = 11, C = 6;
    at::Tensor ids = at::randint(V, shape, gen, at::kLong);
    ids.view({-1})[0] = ids.view({-1})[-1];  // a repeated id: its gradient rows must add up
    at::Tensor w = at::randn({V, C}, gen, f64());
    Fwd<EmbeddingSaved> f = embedding_forward(ids, w);
    // Reference: a one-hot matrix times the table, which is the lookup written as math.
    at::Tensor wl = leaf(w);
    at::Tensor ref = at::matmul(at::one_hot(ids, V).to(at::kDouble), wl);
    EXPECT_LT(rel_err(f.out, ref.detach()), 1e-15);
    at::Tensor dy = at::randn(ref.sizes(), gen, ref.options());
    at::Tensor dw = at::randn({V, C}, gen, f64());
    at::Tensor dw0 = dw.clone();
    embedding_backward(dy, f.saved, dw);
    EXPECT_LT(rel_err(dw - dw0, grads(ref, dy, {wl})[0]), 1e-12);
  }
}

TEST(EmbeddingOp, SavesOnlyTheIds) {
  at::Generator gen = seeded(1);
  for (int64_t n : {1, 9, 64}) {
    at::Tensor ids = at::randint(5, {n}, gen, at::kLong);
    Fwd<EmbeddingSaved> f = embedding_forward(ids, at::randn({5, 3}, gen));
    EXPECT_EQ(embedding_saved_bytes(n), remat::ops::tensors_bytes(f.saved.tensors()));
  }
}

TEST(EmbeddingOp, RefusesIdsOutOfRange) {
  at::Generator gen = seeded(1);
  at::Tensor w = at::randn({10, 4}, gen);
  expect_error([&] { embedding_forward(at::tensor({1, 10}, at::kLong), w); }, {"[embedding]", "[0, 10)", "10]"});
  expect_error([&] { embedding_forward(at::tensor({-1, 3}, at::kLong), w); }, {"[embedding]", "[-1, 3]"});
  expect_error([&] { embedding_forward(at::tensor({1, 2}, at::kInt), w); }, {"[embedding]", "int64"});
  expect_error([&] { embedding_forward(at::tensor({1}, at::kLong), at::randn({10}, gen)); }, {"[embedding]", "[10]"});
}

TEST(EmbeddingOp, WorksInBFloat16) {
  at::Generator gen = seeded(1);
  at::Tensor w = at::randn({8, 4}, gen).to(at::kBFloat16);
  at::Tensor ids = at::tensor({3, 1, 3}, at::kLong);
  Fwd<EmbeddingSaved> f = embedding_forward(ids, w);
  EXPECT_TRUE(at::equal(f.out[1], w[1]));
  at::Tensor dw = at::zeros({8, 4});  // float32 accumulator for bf16 activations
  embedding_backward(at::ones({3, 4}, at::kBFloat16), f.saved, dw);
  EXPECT_EQ(dw[3][0].item<float>(), 2.0f);
  EXPECT_EQ(dw[0][0].item<float>(), 0.0f);
}

// The tensor-parallel embedding as the graph transform places it: each of t ranks (a
// thread) runs the op definition, marked sharded, on its [V/t, C] rows. Only the rank
// holding an id gives it a nonzero row, so the sum over the ranks is the whole table's
// lookup bit for bit, and each rank's gradient is its rows of the whole one.
TEST(EmbeddingOp, VocabularyShardsSumToTheWholeTablesLookup) {
  using namespace remat::graph;
  const int64_t V = 12, C = 5;
  at::Generator gen = seeded(7);
  for (int ranks : {2, 4}) {
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      const int64_t held = V / ranks;
      at::Tensor ids = at::randint(V, {3, 7}, gen, at::kLong);
      at::Tensor flat = ids.view({-1});
      for (int r = 0; r < ranks; ++r) {  // every share's first and last rows
        flat[2 * r] = r * held;
        flat[2 * r + 1] = (r + 1) * held - 1;
      }
      flat[20] = flat[3];  // a repeated id: its gradient rows add up
      at::Tensor w = at::randn({V, C}, gen).to(dt), dy = at::randn({3, 7, C}, gen).to(dt);
      at::Tensor dw0 = at::randn({V, C}, gen);  // float32 accumulators, added onto
      Fwd<EmbeddingSaved> whole = embedding_forward(ids, w);
      at::Tensor dw_whole = dw0.clone();
      embedding_backward(dy, whole.saved, dw_whole);

      std::vector<at::Tensor> out(static_cast<size_t>(ranks)), dw(static_cast<size_t>(ranks));
      Attrs sharded;
      sharded.sharded = true;
      on_local_ranks(ranks, [&](remat::dist::Group& group) {
        const int r = group.rank();
        RunContext ctx;
        ctx.tp = &group;
        const at::Tensor w_r = w.narrow(0, r * held, held);
        at::Tensor& dw_r = dw[static_cast<size_t>(r)];
        dw_r = dw0.narrow(0, r * held, held).clone();
        std::vector<at::Tensor*> g{&dw_r};
        out[static_cast<size_t>(r)] = op::embedding().forward({ids}, {w_r}, sharded, ctx)[0];
        op::embedding().backward({dy}, {ids}, {}, {w_r}, g, sharded, ctx);
      });

      const std::string what = std::to_string(ranks) + " ranks, " + c10::toString(dt);
      at::Tensor sum = out[0];
      for (int r = 0; r < ranks; ++r) {
        const at::Tensor mine = (ids >= r * held).logical_and_(ids < (r + 1) * held).unsqueeze(-1);
        EXPECT_TRUE(at::equal(out[static_cast<size_t>(r)], at::where(mine, whole.out, at::zeros_like(whole.out))))
            << what << ": rank " << r << " must give its rows and zeros for the others' ids";
        EXPECT_TRUE(at::equal(dw[static_cast<size_t>(r)], dw_whole.narrow(0, r * held, held)))
            << what << ": rank " << r << "'s weight gradient";
        if (r > 0) sum = sum + out[static_cast<size_t>(r)];
      }
      EXPECT_TRUE(at::equal(sum, whole.out)) << what;
    }
  }
}

TEST(EmbeddingOp, VocabularyShareChecksIdsAgainstTheWholeVocabulary) {
  at::Generator gen = seeded(1);
  at::Tensor w = at::randn({5, 4}, gen);
  const VocabShard second{5, 10};
  // Ids of the other share are fine (zero rows); ids outside the vocabulary are refused.
  EXPECT_TRUE(at::equal(embedding_forward(at::tensor({0, 4}, at::kLong), w, second).out, at::zeros({2, 4})));
  expect_error(
      [&] {
        embedding_forward(at::tensor({1, 10}, at::kLong), w, second);
      },
      {"[embedding]", "[0, 10)", "10]"});
  expect_error(
      [&] {
        embedding_forward(at::tensor({1}, at::kLong), w, VocabShard{8, 10});
      },
      {"[embedding]", "5 vocabulary rows from row 8", "vocabulary of 10"});
}

TEST(PositionEmbeddingOp, MatchesAutogradOfBroadcastAdd) {
  const int64_t P = 9, C = 5, B = 3, T = 7;
  at::Generator gen = seeded(1);
  at::Tensor w = at::randn({P, C}, gen, f64());
  Fwd<PositionEmbeddingSaved> f = position_embedding_forward(T, w);
  EXPECT_TRUE(at::equal(f.out, w.slice(0, 0, T)));
  EXPECT_TRUE(f.saved.tensors().empty());
  // Reference: tokens + w[0:T] broadcast over the batch.
  at::Tensor wl = leaf(w);
  at::Tensor tok = at::randn({B, T, C}, gen, f64());
  at::Tensor ref = tok + wl.slice(0, 0, T).unsqueeze(0);
  at::Tensor dy = at::randn(ref.sizes(), gen, ref.options());
  at::Tensor dw = at::zeros({P, C}, f64());
  position_embedding_backward(dy, f.saved, dw);
  EXPECT_LT(rel_err(dw, grads(ref, dy, {wl})[0]), 1e-14);
}

TEST(PositionEmbeddingOp, RefusesSequencesLongerThanTheContext) {
  at::Generator gen = seeded(1);
  at::Tensor w = at::randn({1024, 8}, gen);
  EXPECT_EQ(position_embedding_forward(1024, w).out.size(0), 1024);
  expect_error([&] { position_embedding_forward(1025, w); },
               {"[position_embedding]", "1025", "context length of 1024"});
  expect_error([&] { position_embedding_forward(0, w); }, {"[position_embedding]"});
  at::Tensor dw = at::zeros({1024, 8});
  auto f = position_embedding_forward(4, w);
  expect_error(
      [&] {
        position_embedding_backward(at::randn({2, 5, 8}, gen), f.saved, dw);
      },
      {"[position_embedding]", "[2, 5, 8]"});
}

}  // namespace
