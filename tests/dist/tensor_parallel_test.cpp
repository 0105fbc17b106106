// Tensor parallelism, with and without sequence parallelism, against one process: ranks
// as threads of this test (a LocalGroup, which sums in rank order), each holding its share
// of the very model one process builds for the seed, trained on the same batch.
#include "remat/model.h"
#include "remat/policy.h"
#include "train/step.h"
#include "util/local_group.h"
#include "util/seeded.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <tuple>

namespace remat {
namespace {

constexpr uint64_t kSeed = 5;
const StepContext kStep{kSeed, 3, 0};
constexpr int64_t kRows = 2, kSeq = 8;

// Shapes whose heads, KV heads, hidden features and vocabulary divide over `tp` ranks.
ModelConfig shape_for(const char* arch, int tp, double dropout) {
  ModelConfig cfg = model_preset(std::string("tiny-") + arch);
  if (tp == 4) {
    cfg.n_head = 8;
    cfg.n_kv_head = cfg.arch == Arch::llama ? 4 : 8;
  }
  cfg.dropout = dropout;
  return cfg;
}

// A recompute setting by name: a policy; with "+", the same policy with
// ac.tp_recompute_allgather; with "^", with ac.offload_prefetch; "uniform:N*" or
// "block:N*", Megatron's full granularity by that method with ac.distribute_saved_activations.
AcConfig ac_of(std::string name) {
  AcConfig ac;
  ac.allow_rng_mismatch = true;
  const char mark = name.back();
  if (mark == '+' || mark == '*' || mark == '^') name.pop_back();
  if (mark == '*') {
    const size_t colon = name.find(':');
    ac.recompute_granularity = "full";
    ac.recompute_method = name.substr(0, colon);
    ac.recompute_num_layers = std::stoll(name.substr(colon + 1));
    ac.distribute_saved_activations = true;
  } else {
    ac.policy = name;
  }
  if (mark == '+') ac.tp_recompute_allgather = true;
  ac.offload_prefetch = mark == '^';
  return ac;
}

std::unique_ptr<Model> make_model(const ModelConfig& cfg, at::ScalarType dtype, const std::string& policy,
                                  dist::Group* tp, bool sp = false) {
  Layout layout;
  layout.tp = tp != nullptr ? tp->size() : 1;
  layout.sp = sp;
  auto model = Model::create(cfg, at::kCPU, dtype, 1, layout, tp);
  const AcConfig ac = ac_of(policy);
  apply_plan(*model, compile_policy(ac, cfg.n_layer, cfg.dropout), ac);
  return model;
}

// Token ids below `tokens` (0: the model's vocabulary; fewer: a padded vocabulary's real ones).
std::pair<at::Tensor, at::Tensor> batch(const ModelConfig& cfg, int64_t tokens = 0) {
  auto gen = testing::seeded(9);
  const int64_t n = tokens > 0 ? tokens : cfg.vocab_size;
  return {at::randint(n, {kRows, kSeq}, gen, at::kLong), at::randint(n, {kRows, kSeq}, gen, at::kLong)};
}

struct Result {
  double loss = 0;
  std::vector<at::Tensor> grads;  ///< whole (gathered) unless `parts` asked for
  ActivationBytes measured, predicted;
};

// One microbatch's loss and gradients, from zeroed gradients. `chunk`: tokens per logit chunk;
// `tokens`: as batch's.
Result step(Model& model, bool parts, int64_t chunk = 5, int64_t tokens = 0) {
  const auto [tok, tgt] = batch(model.config(), tokens);
  model.zero_grad();
  Result r;
  r.loss = model.forward_backward(tok, tgt, kStep, 1.0, chunk, &r.measured);
  model.sum_partial_grads("the test's partial gradients");
  r.predicted = model.predict_activation_bytes(kRows, kSeq);
  for (size_t i = 0; i < model.params().size(); ++i) {
    const at::Tensor& g = model.params()[i].grad;
    r.grads.push_back(parts ? g.clone() : model.whole(i, g).clone());
  }
  return r;
}

// Every rank's result, run as `tp` threads.
std::vector<Result> on_tp(int tp, const ModelConfig& cfg, at::ScalarType dtype, const std::string& policy, bool parts,
                          LossHead head = LossHead::fused, bool sp = false) {
  std::vector<Result> out(static_cast<size_t>(tp));
  testing::on_local_ranks(tp, [&](dist::Group& group) {
    ModelConfig c = cfg;
    c.loss_head = head;
    auto model = make_model(c, dtype, policy, &group, sp);
    out[static_cast<size_t>(group.rank())] = step(*model, parts);
  });
  return out;
}

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

TEST(TensorParallel, PartsJoinBackToTheWhole) {
  auto gen = testing::seeded(1);
  const at::Tensor full = at::randn({12, 6}, gen);
  for (const graph::Shard& shard : {graph::Shard{0, {}}, graph::Shard{0, {4, 4, 4}}, graph::Shard{1, {}}}) {
    for (int64_t tp : {2, 4}) {
      if (full.size(shard.dim) % tp != 0 || (!shard.blocks.empty() && 4 % tp != 0)) continue;
      std::vector<at::Tensor> parts;
      for (int64_t r = 0; r < tp; ++r) parts.push_back(graph::take_part(full, shard, tp, r));
      EXPECT_TRUE(at::equal(graph::join_parts(at::cat(parts, shard.dim), shard, tp), full));
    }
  }
  // A fused q/k/v projection: each rank holds its rows of each of the three parts.
  const at::Tensor rows = at::arange(12).reshape({12, 1});
  EXPECT_TRUE(
      at::equal(graph::take_part(rows, {0, {4, 4, 4}}, 2, 1).flatten(), at::tensor({2, 3, 6, 7, 10, 11}, at::kLong)));
}

// Each rank's parameters are its part of what one process initialises for the seed.
TEST(TensorParallel, RanksHoldTheirPartOfOneProcesssModel) {
  for (const char* arch : {"gpt2", "llama"}) {
    const ModelConfig cfg = shape_for(arch, 2, 0.0);
    const auto one = make_model(cfg, at::kFloat, "none", nullptr);
    testing::on_local_ranks(2, [&](dist::Group& group) {
      const auto model = make_model(cfg, at::kFloat, "none", &group);
      ASSERT_EQ(model->params().size(), one->params().size());
      int64_t split = 0;
      for (size_t i = 0; i < one->params().size(); ++i) {
        const Param& p = model->params()[i];
        EXPECT_TRUE(at::equal(p.value, model->part(i, one->params()[i].value))) << p.name;
        EXPECT_TRUE(at::equal(model->whole(i, p.value), one->params()[i].value)) << p.name;
        split += p.shard.split();
      }
      // Every block's linears (gpt2: the column ones' biases too), and the vocabulary's rows.
      EXPECT_EQ(split, cfg.arch == Arch::gpt2 ? 2 * 6 + 1 : 2 * 7 + 2) << arch;
    });
  }
}

// In float64 the ranks' only difference from one process is the order of the sums the
// split products and the vocabulary's statistics make: each such sum of K terms differs
// by at most 2 gamma_K sum|terms| (Higham, Theorem 3.1), K <= 256 here, so about 6e-14
// of its terms' magnitude; through two small layers at initialisation the gradients'
// relative difference stays orders of magnitude below the 1e-10 asserted.
// Sequence parallelism adds the sums of the partial norm, bias and position gradients over
// the ranks (t terms each, the same bound).
TEST(TensorParallel, LossAndGradientsEqualOneProcessInFloat64) {
  for (const char* arch : {"gpt2", "llama"}) {
    for (int tp : {2, 4}) {
      for (const LossHead head : {LossHead::fused, LossHead::recompute}) {
        for (const bool sp : {false, true}) {
          ModelConfig cfg = shape_for(arch, tp, 0.1);
          cfg.loss_head = head;
          const auto one = make_model(cfg, at::kDouble, "none", nullptr);
          const Result want = step(*one, false);
          const std::vector<Result> got = on_tp(tp, cfg, at::kDouble, "none", false, head, sp);
          for (int r = 0; r < tp; ++r) {
            const std::string what =
                fmt::format("{} tp {} sp {} rank {} head {}", arch, tp, sp, r, static_cast<int>(head));
            const Result& g = got[static_cast<size_t>(r)];
            EXPECT_LE(std::abs(g.loss - want.loss), 1e-12 * std::abs(want.loss)) << what;
            for (size_t i = 0; i < want.grads.size(); ++i) {
              EXPECT_LE(max_abs(g.grads[i] - want.grads[i]), 1e-10 * max_abs(want.grads[i]))
                  << what << " " << one->params()[i].name;
            }
          }
        }
      }
    }
  }
}

// A vocabulary no tp divides (GPT-2's is odd) is padded to one that does: the ranks' loss and
// gradients are one process's with the same padded vocabulary, the tokens the real ones only.
TEST(TensorParallel, APaddedVocabularyEqualsOneProcessInFloat64) {
  for (const char* arch : {"gpt2", "llama"}) {
    for (const auto& [tp, multiple, real] : {std::tuple<int, int64_t, int64_t>{2, 1, 61}, {4, 1, 61}, {2, 4, 57}}) {
      Config c;
      c.model = shape_for(arch, tp, 0.1);
      c.model.vocab_multiple = multiple;
      c.parallel.tp = tp;
      c.train.seq = kSeq;
      c.model.vocab_size = padded_vocab_size(c, real);
      ASSERT_EQ(c.model.vocab_size % (multiple * tp), 0);
      ASSERT_GT(c.model.vocab_size, real);
      ASSERT_LT(c.model.vocab_size, real + multiple * tp);
      validate_config(c);
      const auto one = make_model(c.model, at::kDouble, "none", nullptr);
      const Result want = step(*one, false, 5, real);
      std::vector<Result> got(static_cast<size_t>(tp));
      testing::on_local_ranks(tp, [&](dist::Group& group) {
        got[static_cast<size_t>(group.rank())] =
            step(*make_model(c.model, at::kDouble, "none", &group), false, 5, real);
      });
      for (int r = 0; r < tp; ++r) {
        const std::string what = fmt::format("{} tp {} vocab {} of {} rank {}", arch, tp, real, c.model.vocab_size, r);
        const Result& g = got[static_cast<size_t>(r)];
        EXPECT_LE(std::abs(g.loss - want.loss), 1e-12 * std::abs(want.loss)) << what;
        for (size_t i = 0; i < want.grads.size(); ++i) {
          EXPECT_LE(max_abs(g.grads[i] - want.grads[i]), 1e-10 * max_abs(want.grads[i]))
              << what << " " << one->params()[i].name;
        }
      }
      // The padding rows are in the loss's softmax (as Megatron's): the output weight's
      // padding rows get a gradient, pushing their logits down, though no token is theirs.
      // No token looks them up: Llama's untied embedding gets none there.
      int64_t vocab_params = 0;
      for (size_t i = 0; i < one->params().size(); ++i) {
        const Param& p = one->params()[i];
        if (!p.vocab) continue;
        ++vocab_params;
        const double padding = max_abs(want.grads[i].narrow(0, real, c.model.vocab_size - real));
        if (p.name == "model.embed_tokens.weight") {
          EXPECT_EQ(padding, 0);
        } else {
          EXPECT_GT(padding, 0) << p.name;
        }
      }
      EXPECT_EQ(vocab_params, c.model.arch == Arch::gpt2 ? 1 : 2);
    }
  }
}

// Recompute changes nothing within one layout: every policy's loss and every rank's
// gradient parts are bitwise those of the same ranks without recompute; with sequence
// parallelism also gathering the column-parallel inputs again (tp_recompute_allgather)
// instead of keeping them, alone or with a policy; without it, keeping the inputs of the
// layers recomputed whole as a share per rank (distribute_saved_activations); or moving
// kept slots to host memory until the backward (offload), or the backward of the layer
// above (offload_prefetch).
TEST(TensorParallel, EveryPolicyIsBitwiseTheSameRanksWithoutRecompute) {
  for (const char* arch : {"gpt2", "llama"}) {
    for (const bool sp : {false, true}) {
      const ModelConfig cfg = shape_for(arch, 2, 0.1);
      const std::vector<Result> none = on_tp(2, cfg, at::kFloat, "none", true, LossHead::fused, sp);
      for (const char* policy : {"full", "modules:[core_attn]", "ops:[matmul]", "every:2", "uniform:2", "none+",
                                 "modules:[core_attn]+", "uniform:1*", "uniform:2*", "block:1*", "full+offload:[input]",
                                 "modules:[core_attn]+offload:[input,mlp,attn.gathered]",
                                 "modules:[core_attn]+offload:[input,mlp,attn.gathered]^"}) {
        const char mark = std::string(policy).back();
        if ((mark == '+' && !sp) || (mark == '*' && sp)) continue;
        const std::vector<Result> got = on_tp(2, cfg, at::kFloat, policy, true, LossHead::fused, sp);
        for (int r = 0; r < 2; ++r) {
          const std::string what = fmt::format("{} sp {} {} rank {}", arch, sp, policy, r);
          EXPECT_EQ(got[static_cast<size_t>(r)].loss, none[static_cast<size_t>(r)].loss) << what;
          for (size_t i = 0; i < none[0].grads.size(); ++i) {
            EXPECT_TRUE(at::equal(got[static_cast<size_t>(r)].grads[i], none[static_cast<size_t>(r)].grads[i]))
                << what << " grad " << i;
          }
        }
      }
    }
  }
}

// What a sequence-parallel rank keeps is what the model predicts from the graph, under
// every policy; gathering the inputs of the column-parallel linears again
// (tp_recompute_allgather) keeps, per layer and per gathered input, the rank's positions
// [B, T / t, C] instead of all of them [B, T, C].
TEST(TensorParallel, SequenceParallelRanksKeepWhatThePredictionSays) {
  for (const char* arch : {"gpt2", "llama"}) {
    const ModelConfig cfg = shape_for(arch, 2, 0.1);
    std::map<std::string, int64_t> kept;
    for (const char* policy : {"none", "none+", "full", "modules:[core_attn]", "modules:[core_attn]+", "uniform:2"}) {
      const std::vector<Result> got = on_tp(2, cfg, at::kFloat, policy, true, LossHead::fused, true);
      for (int r = 0; r < 2; ++r) {
        const Result& g = got[static_cast<size_t>(r)];
        EXPECT_EQ(g.measured.blocks, g.predicted.blocks) << arch << " " << policy << " rank " << r;
        EXPECT_EQ(g.measured.embedding, g.predicted.embedding) << arch << " " << policy << " rank " << r;
        EXPECT_EQ(g.measured.head, g.predicted.head) << arch << " " << policy << " rank " << r;
      }
      kept[policy] = got[0].measured.total();
    }
    const int64_t per_input = kRows * (kSeq - kSeq / 2) * cfg.d_model * 4;  // float32
    EXPECT_EQ(kept["none"] - kept["none+"], cfg.n_layer * 2 * per_input) << arch;
    EXPECT_EQ(kept["modules:[core_attn]"] - kept["modules:[core_attn]+"], cfg.n_layer * 2 * per_input) << arch;
  }
}

// Megatron's distribute_saved_activations: each layer recomputed whole keeps its input
// [B, T, C], which every rank holds, as a share of B T C / t elements, so it keeps
// (1 - 1/t) of those bytes less, on every rank, as the model predicts from the graph; a
// uniform chunk of two keeps one input per chunk. At t = 4 as well.
TEST(TensorParallel, DistributedSavedActivationsKeepAShareOfEachInput) {
  for (const char* arch : {"gpt2", "llama"}) {
    for (const int tp : {2, 4}) {
      const ModelConfig cfg = shape_for(arch, tp, 0.1);
      ASSERT_EQ(cfg.n_layer % 2, 0);
      std::map<std::string, int64_t> kept;
      for (const char* policy : {"full", "uniform:1*", "uniform:2", "uniform:2*", "block:1*"}) {
        const std::vector<Result> got = on_tp(tp, cfg, at::kFloat, policy, true);
        for (int r = 0; r < tp; ++r) {
          const Result& g = got[static_cast<size_t>(r)];
          const std::string what = fmt::format("{} tp {} {} rank {}", arch, tp, policy, r);
          EXPECT_EQ(g.measured.blocks, g.predicted.blocks) << what;
          EXPECT_EQ(g.measured.total(), got[0].measured.total()) << what;
        }
        kept[policy] = got[0].measured.total();
      }
      const int64_t input = kRows * kSeq * cfg.d_model * 4;  // float32
      const int64_t saved = input - input / tp;
      EXPECT_EQ(kept["full"] - kept["uniform:1*"], cfg.n_layer * saved) << arch << " tp " << tp;
      EXPECT_EQ(kept["uniform:2"] - kept["uniform:2*"], cfg.n_layer / 2 * saved) << arch << " tp " << tp;
      // block:1: the first layer keeps its input as a share; the others keep everything.
      EXPECT_LT(kept["uniform:1*"], kept["block:1*"]) << arch << " tp " << tp;
    }
  }
}

}  // namespace
}  // namespace remat
