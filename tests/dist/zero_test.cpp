// ZeRO stages 1 to 3 (parallel.zero = 1, 2, 3) against the same ranks without them: ranks as
// threads of this test, joined through a real TCPStore and Gloo group on the loopback, each
// training on its rows of every batch with TrainStep. Each parameter is updated whole by
// one rank, by the kernels that update it without ZeRO, and reaches the others through an
// exact exchange (under stage 3, an exact gather before each part's passes); its gradient is the same sum of the same two terms whether the ranks sum
// the whole buffer or its part's, so the weights are compared bit for bit (the sign of
// zero included), not within a bound.
#include "cli/launch.h"
#include "plan/statics.h"
#include "remat/cost.h"
#include "remat/dist.h"
#include "remat/model.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/safetensors.h"
#include "train/step.h"
#include "util/fused_adamw.h"
#include "util/gloo_ranks.h"
#include "util/seeded.h"
#include "util/temp_dir.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <numeric>
#include <random>
#include <thread>

namespace remat {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kSeq = 8;
constexpr uint64_t kSeed = 5;

TrainConfig train_config() {
  TrainConfig t;
  t.batch = 2;  // per rank
  t.seq = kSeq;
  t.steps = 4;
  t.warmup = 1;
  t.grad_clip = 0.05;  // small enough to clip every step: the global norm must be the same
  return t;
}

const data::TokenDataset& dataset() {
  static const data::TokenDataset data(at::randint(64, {300}, testing::seeded(3), at::kInt));
  return data;
}

// tiny-gpt2 (vocabulary 64, context 32; heads, features and vocabulary split by 2), with
// a few elements of a position row no sequence of kSeq tokens reaches set to -0.0: their
// gradient stays 0, so they stay -0.0 through every update, and an exchange that turned
// them into +0.0 would show.
std::unique_ptr<Model> make_model(dist::Group* tp, bool sp = false) {
  Layout layout;
  layout.tp = tp != nullptr ? tp->size() : 1;
  layout.sp = sp;
  auto model = Model::create(model_preset("tiny-gpt2"), at::kCPU, at::kFloat, 1, layout, tp);
  for (Param& p : model->params()) {
    if (p.name == "wpe.weight") p.value[kSeq + 1].narrow(0, 0, 4).fill_(-0.0);
  }
  return model;
}

using Weights = std::vector<std::pair<std::string, at::Tensor>>;

// The whole weights after `steps` steps on every rank of `n` (tp each, with sequence
// parallelism when `sp`), from a fresh model or, with `resume`, from that checkpoint; with
// `save`, the checkpoint after `save_after` steps is written there (rank 0 writes, every
// rank gives its part).
std::vector<Weights> train_on_ranks(int n, int tp, int64_t zero, int64_t steps, const std::string& resume = "",
                                    const std::string& save = "", int64_t save_after = 0,
                                    const TrainConfig& train = train_config(), bool sp = false) {
  std::vector<Weights> out(static_cast<size_t>(n));
  testing::on_gloo_ranks(n, tp, [&](dist::Comm& comm) {
    auto model = make_model(tp > 1 ? &comm.tensor() : nullptr, sp);
    TrainStep step(*model, train, kSeed, &comm, zero);
    std::mt19937_64 rng(7);
    int64_t first = 0;
    if (!resume.empty()) first = step.load_checkpoint(resume, rng);
    for (int64_t s = first; s < steps; ++s) {
      step.run(s, dataset(), rng);
      if (!save.empty() && s + 1 == save_after && (comm.rank() == 0 || step.gives_to_checkpoint())) {
        step.save_checkpoint(save, s + 1, rng, comm.rank() == 0);
      }
    }
    out[static_cast<size_t>(comm.rank())] = model->whole_params();
  });
  return out;
}

// Equal bit for bit: -0.0 and +0.0 differ, as do NaNs of other payloads.
void expect_bitwise(const Weights& a, const Weights& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first) << what;
    EXPECT_TRUE(at::equal(a[i].second.view(at::kInt), b[i].second.view(at::kInt))) << what << ": " << a[i].first;
  }
}

// The -0.0s make_model planted are still there (so the comparisons above could see them
// turn into +0.0).
void expect_negative_zeros(const Weights& w) {
  for (const auto& [name, t] : w) {
    if (name != "wpe.weight") continue;
    const at::Tensor planted = t[kSeq + 1].narrow(0, 0, 4);
    EXPECT_TRUE(at::equal(planted, at::zeros_like(planted)) && at::signbit(planted).all().item<bool>()) << planted;
    return;
  }
  ADD_FAILURE() << "no wpe.weight";
}

TEST(Zero, TwoRanksTrainBitwiseAsWithoutZero) {
  const std::vector<Weights> plain = train_on_ranks(2, 1, 0, 4);
  expect_negative_zeros(plain[0]);
  for (const int64_t stage : {1, 2, 3}) {
    const std::vector<Weights> zero = train_on_ranks(2, 1, stage, 4);
    for (int r = 0; r < 2; ++r) {
      expect_bitwise(zero[static_cast<size_t>(r)], plain[0], fmt::format("zero {} rank {}", stage, r));
    }
  }
  // And the weights moved: the comparison is of trained models.
  const auto fresh = make_model(nullptr)->whole_params();
  EXPECT_FALSE(at::equal(fresh[0].second, plain[0][0].second));
}

// Two data-parallel copies of a two-rank tensor-parallel group: the data-parallel group
// of each tensor-parallel position shards the moments (and gradients) of that position's
// parts. With sequence parallelism too: stage 2 sums each part's partial gradients (the
// norms', the position table's, the row-parallel biases') over the tensor-parallel pair
// before the data-parallel sum, as stage 0 does for the whole step's.
TEST(Zero, DataParallelCopiesOfATensorParallelGroupTrainBitwiseAsWithoutZero) {
  for (const bool sp : {false, true}) {
    const std::vector<Weights> plain = train_on_ranks(4, 2, 0, 3, "", "", 0, train_config(), sp);
    expect_negative_zeros(plain[0]);
    for (const int64_t stage : {1, 2, 3}) {
      const std::vector<Weights> zero = train_on_ranks(4, 2, stage, 3, "", "", 0, train_config(), sp);
      for (int r = 0; r < 4; ++r) {
        expect_bitwise(zero[static_cast<size_t>(r)], plain[0], fmt::format("sp {} zero {} rank {}", sp, stage, r));
      }
    }
  }
}

// Stage 2 over two microbatches sums each microbatch's gradients over the ranks before it
// sums the microbatches (the reverse of stage 0's order, so not its bits: the data-parallel
// tests bound that), over four ranks in Gloo's order: every rank still ends with the same
// weights, bit for bit, since each is its owner's update exchanged exactly. Stage 3 sums
// the same gradients of the same weights, so its weights are stage 2's to the bit.
TEST(Zero, StagesTwoAndThreeAgreeOverMicrobatchesAndFourRanks) {
  TrainConfig train = train_config();
  train.batch = 1;
  train.grad_accum = 2;
  const std::vector<Weights> zero = train_on_ranks(4, 1, 2, 2, "", "", 0, train);
  const auto fresh = make_model(nullptr)->whole_params();
  EXPECT_FALSE(at::equal(fresh[0].second, zero[0][0].second));
  for (int r = 1; r < 4; ++r) expect_bitwise(zero[static_cast<size_t>(r)], zero[0], fmt::format("rank {}", r));
  const std::vector<Weights> three = train_on_ranks(4, 1, 3, 2, "", "", 0, train);
  for (int r = 0; r < 4; ++r) expect_bitwise(three[static_cast<size_t>(r)], zero[0], fmt::format("zero 3 rank {}", r));
}

// Stage 3 with layers that keep their gathered weights from their forward to their
// backward instead of gathering them again (LayerPlan::weights_kept), beside dropped slots
// and a uniform chunk, over two microbatches: the very bytes the gather gave, so the
// weights are those of gathering again, to the bit, with one gather fewer per layer and
// microbatch outside the chunk.
TEST(Zero, StageThreeLayersKeepingTheirGatheredWeightsTrainAsGatheringAgain) {
  TrainConfig train = train_config();
  train.batch = 1;
  train.grad_accum = 2;
  const ModelConfig cfg = model_preset("tiny-gpt2");
  for (const char* policy : {"none", "modules:[mlp]", "uniform:2"}) {
    std::map<bool, std::vector<Weights>> out;
    std::map<bool, int64_t> collectives;
    for (const bool keep : {false, true}) {
      ActivationPlan plan = compile_policy(policy, cfg.n_layer, cfg.dropout);
      for (LayerPlan& l : plan.layers) l.weights_kept = keep;
      out[keep].resize(2);
      testing::on_gloo_ranks(2, 1, [&](dist::Comm& comm) {
        auto model = make_model(nullptr);
        model->set_activation_plan(plan, StoreOptions{});
        TrainStep step(*model, train, kSeed, &comm, 3);
        std::mt19937_64 rng(7);
        for (int64_t s = 0; s < 2; ++s) step.run(s, dataset(), rng);
        out[keep][static_cast<size_t>(comm.rank())] = model->whole_params();
        if (comm.rank() == 0) collectives[keep] = comm.data().reduced().collectives;
      });
    }
    for (int r = 0; r < 2; ++r) {
      expect_bitwise(out[true][static_cast<size_t>(r)], out[false][0], fmt::format("{} keeping, rank {}", policy, r));
    }
    // Two layers, two microbatches, two steps.
    const int64_t fewer = policy == std::string("uniform:2") ? 0 : 2 * 2 * 2;
    EXPECT_EQ(collectives[false] - collectives[true], fewer) << policy;
  }
}

// In bfloat16, stage 3 gathers each part's weights as 64-bit words (Gloo sums no
// bfloat16), its end padded to a whole word: the ops compute with the very values stage
// 2's cast gives them, so the weights are stage 2's to the bit.
TEST(Zero, StageThreeGathersBfloat16WeightsExactly) {
  // Width 18: a layer's 4,122 weights are 8,244 bytes, so its gather is padded.
  ModelConfig odd = model_preset("tiny-gpt2");
  odd.d_model = 18;
  odd.d_ff = 72;
  std::map<int64_t, std::vector<Weights>> out;
  for (const int64_t stage : {2, 3}) {
    out[stage].resize(2);
    testing::on_gloo_ranks(2, 1, [&](dist::Comm& comm) {
      auto model = Model::create(odd, at::kCPU, at::kBFloat16, 1);
      TrainStep step(*model, train_config(), kSeed, &comm, stage);
      std::mt19937_64 rng(7);
      for (int64_t s = 0; s < 2; ++s) step.run(s, dataset(), rng);
      out[stage][static_cast<size_t>(comm.rank())] = model->whole_params();
    });
  }
  for (int r = 0; r < 2; ++r) {
    expect_bitwise(out[3][static_cast<size_t>(r)], out[2][static_cast<size_t>(r)], fmt::format("rank {}", r));
  }
  const auto fresh = Model::create(odd, at::kCPU, at::kBFloat16, 1)->whole_params();
  EXPECT_FALSE(at::equal(fresh[0].second, out[3][0][0].second));
}

// Stage 3 keeps a rank's own masters only: the others hold no values, and the one flat
// buffer of masters is the rank's share.
TEST(Zero, StageThreeKeepsEachRanksOwnMastersOnly) {
  std::vector<int64_t> kept(2), held(2);
  int64_t all = 0;
  testing::on_gloo_ranks(2, 1, [&](dist::Comm& comm) {
    auto model = make_model(nullptr);
    std::vector<int64_t> numels;
    for (const Param& p : model->params()) numels.push_back(p.value.numel());
    const std::vector<int> owner = cost::zero_owners(numels, 2);
    const TrainStep step(*model, train_config(), kSeed, &comm, 3);
    const auto r = static_cast<size_t>(comm.rank());
    for (size_t i = 0; i < numels.size(); ++i) {
      const Param& p = model->params()[i];
      EXPECT_EQ(p.value.is_meta(), owner[i] != comm.rank()) << p.name;
      EXPECT_EQ(p.value.numel(), numels[i]) << p.name;
      kept[r] += owner[i] == comm.rank() ? numels[i] : 0;
    }
    held[r] = model->value_buffer().numel();
    if (r == 0) all = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  });
  EXPECT_EQ(held, kept);
  EXPECT_EQ(kept[0] + kept[1], all);
  EXPECT_GT(kept[0], 0);
  EXPECT_GT(kept[1], 0);
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A checkpoint holds whole moments whatever parallel.zero wrote it: the files are byte for
// byte alike, and a run resumed under the other setting continues bit for bit.
TEST(Zero, CheckpointsAreTheSameFileAndResumeUnderEitherSetting) {
  const remat::testing::TempDir dir;
  const std::string with = (dir / "zero1.safetensors").string(), without = (dir / "zero0.safetensors").string(),
                    stage2 = (dir / "zero2.safetensors").string(), stage3 = (dir / "zero3.safetensors").string();
  const std::vector<Weights> plain = train_on_ranks(2, 1, 0, 4, "", without, 2);
  train_on_ranks(2, 1, 1, 2, "", with, 2);
  train_on_ranks(2, 1, 2, 2, "", stage2, 2);
  train_on_ranks(2, 1, 3, 2, "", stage3, 2);
  EXPECT_TRUE(file_bytes(with) == file_bytes(without)) << with << " and " << without << " differ";
  EXPECT_TRUE(file_bytes(stage2) == file_bytes(without)) << stage2 << " and " << without << " differ";
  EXPECT_TRUE(file_bytes(stage3) == file_bytes(without)) << stage3 << " and " << without << " differ";
  const model::SafeTensors file = model::load_safetensors(with);
  EXPECT_EQ(file.metadata.at("adam_steps"), "2");
  EXPECT_NE(file.find("exp_avg_sq.wte.weight"), nullptr);

  // Tensor-parallel parts of the moments too: gathered over both groups into one file.
  const std::string tp_with = (dir / "tp-zero1.safetensors").string(),
                    tp_without = (dir / "tp-zero0.safetensors").string();
  train_on_ranks(4, 2, 0, 2, "", tp_without, 2);
  train_on_ranks(4, 2, 1, 2, "", tp_with, 2);
  EXPECT_TRUE(file_bytes(tp_with) == file_bytes(tp_without)) << tp_with << " and " << tp_without << " differ";

  for (const auto& [from, zero] : {std::pair{with, int64_t{0}}, std::pair{without, int64_t{1}},
                                   std::pair{without, int64_t{2}}, std::pair{stage2, int64_t{3}}}) {
    const std::vector<Weights> resumed = train_on_ranks(2, 1, zero, 4, from);
    for (int r = 0; r < 2; ++r) {
      expect_bitwise(resumed[static_cast<size_t>(r)], plain[0], from + " resumed with zero " + std::to_string(zero));
    }
  }
}

// The partition: whole parameters, largest first to the least loaded rank (the lowest on a
// tie), so that every rank computes the same one and the busiest holds at most the mean
// plus the largest parameter.
TEST(Zero, OwnersBalanceWholeParameters) {
  EXPECT_EQ(cost::zero_owners({5, 3, 3, 2, 1}, 1), (std::vector<int>{0, 0, 0, 0, 0}));
  // 5 -> rank 0; 3 -> 1; 3 -> 1 (load 3 < 5); 2 -> 0 (5 < 6); 1 -> 1 (6 < 7).
  EXPECT_EQ(cost::zero_owners({5, 3, 3, 2, 1}, 2), (std::vector<int>{0, 1, 1, 0, 1}));
  EXPECT_EQ(cost::zero_owners({4, 4, 4}, 2), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(cost::zero_owners({1, 1}, 4), (std::vector<int>{0, 1}));

  // The model's own parameters over 2 ranks: loads within the largest parameter.
  const auto model = make_model(nullptr);
  std::vector<int64_t> numels;
  for (const Param& p : model->params()) numels.push_back(p.value.numel());
  const std::vector<int> owner = cost::zero_owners(numels, 2);
  int64_t load[2] = {0, 0}, largest = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    load[owner[i]] += numels[i];
    largest = std::max(largest, numels[i]);
  }
  EXPECT_LE(std::abs(load[0] - load[1]), largest);
  EXPECT_GT(load[0], 0);
  EXPECT_GT(load[1], 0);
}

// The cost model's optimizer bytes are the busiest rank's moments.
TEST(Zero, TheCostModelHoldsTheBusiestRanksMoments) {
  ModelConfig cfg = model_preset("tiny-gpt2");
  const auto model = make_model(nullptr);
  std::vector<int64_t> numels;
  for (const Param& p : model->params()) numels.push_back(p.value.numel());
  cost::StepShape shape;
  shape.seq = kSeq;
  Layout layout;
  const cost::StaticBytes whole = cost::static_bytes(cfg, shape, layout);
  // The fused kernel's step count, a float32 scalar, beside the moments.
  const int64_t count = util::kFusedAdamW ? 4 : 0;
  EXPECT_EQ(whole.optimizer, 2 * 4 * model->num_params() + count);
  for (const int64_t ranks : {2, 3}) {
    layout.dp = ranks;
    layout.zero = 1;
    const std::vector<int> owner = cost::zero_owners(numels, ranks);
    std::vector<int64_t> load(static_cast<size_t>(ranks)), largest(load.size());
    for (size_t i = 0; i < numels.size(); ++i) {
      load[static_cast<size_t>(owner[i])] += numels[i];
      largest[static_cast<size_t>(owner[i])] = std::max(largest[static_cast<size_t>(owner[i])], numels[i]);
    }
    const cost::StaticBytes sharded = cost::static_bytes(cfg, shape, layout);
    const int64_t busiest = *std::max_element(load.begin(), load.end());
    EXPECT_EQ(sharded.optimizer, 2 * 4 * busiest + count) << ranks;
    EXPECT_EQ(sharded.params, whole.params);
    EXPECT_EQ(sharded.grads, whole.grads);
    // The optimizer step's point: a rank's own moments and its own largest update's two
    // temporaries, the highest over the ranks. Fused, there are no temporaries: the busiest
    // rank's moments and step count beside the gradient norm's squares, one gradient's at a
    // time beside the float32 sums of those before it.
    int64_t step = 0;
    for (size_t r = 0; r < load.size(); ++r) step = std::max(step, 2 * 4 * (load[r] + largest[r]));
    if (util::kFusedAdamW) {
      int64_t norm = 0;
      for (size_t i = 0; i < numels.size(); ++i) norm = std::max(norm, 4 * (numels[i] + static_cast<int64_t>(i) + 1));
      step = 2 * 4 * busiest + count + norm;
    }
    EXPECT_EQ(sharded.optimizer + cost::step_constants(cfg, shape, layout).optimizer, step) << ranks;
  }
}

// Stage 2: the busiest rank's gradients beside its moments, the buffers a backward sums a
// part's gradients from (a layer's, and the embedding's with the head's), and the update's
// point on the rank whose kept gradients, moments and temporaries peak highest, squaring
// only the gradients it keeps.
TEST(Zero, TheCostModelHoldsTheBusiestRanksGradientsUnderStageTwo) {
  const ModelConfig cfg = model_preset("tiny-gpt2");
  const auto model = make_model(nullptr);
  std::vector<int64_t> numels;
  int64_t all = 0, layer = 0;
  for (const Param& p : model->params()) {
    numels.push_back(p.value.numel());
    all += p.value.numel();
    if (p.name.rfind("h.0.", 0) == 0) layer += p.value.numel();
  }
  cost::StepShape shape;
  shape.seq = kSeq;
  Layout layout;
  layout.zero = 2;
  EXPECT_EQ(cost::static_bytes(cfg, shape, layout).grads, 4 * all);  // one rank: nothing sharded
  EXPECT_EQ(cost::gradient_buffers(cfg, layout, at::kFloat).layer, 0);
  layout.dp = 2;
  const cost::GradientBuffers buffers = cost::gradient_buffers(cfg, layout, at::kFloat);
  EXPECT_EQ(buffers.layer, 4 * layer);
  EXPECT_EQ(buffers.ends, 4 * (all - cfg.n_layer * layer));

  const std::vector<int> owner = cost::zero_owners(numels, 2);
  std::vector<int64_t> load(2), largest(2);
  for (size_t i = 0; i < numels.size(); ++i) {
    load[static_cast<size_t>(owner[i])] += numels[i];
    largest[static_cast<size_t>(owner[i])] = std::max(largest[static_cast<size_t>(owner[i])], numels[i]);
  }
  const int64_t busiest = std::max(load[0], load[1]);
  const int64_t count = util::kFusedAdamW ? 4 : 0;
  const cost::StaticBytes sharded = cost::static_bytes(cfg, shape, layout);
  EXPECT_EQ(sharded.grads, 4 * busiest);
  EXPECT_EQ(sharded.optimizer, 2 * 4 * busiest + count);
  // Unfused, two temporaries of the rank's largest parameter; fused, none, and the norm's
  // squares of the busiest rank's own gradients (one at a time, beside the sums before it
  // and the one zero standing for the other rank's), its kept gradients beside them.
  int64_t step = 0;
  if (util::kFusedAdamW) {
    const int rank = load[0] >= load[1] ? 0 : 1;
    int64_t norm = 0, sums = 0;
    bool other = false;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (owner[i] != rank) {
        other = true;
        continue;
      }
      norm = std::max(norm, 4 * (numels[i] + ++sums) + (other ? 4 : 0));
    }
    step = 3 * 4 * busiest + count + norm;
  } else {
    for (size_t r = 0; r < 2; ++r) step = std::max(step, 3 * 4 * load[r] + 2 * 4 * largest[r]);
  }
  EXPECT_EQ(sharded.grads + sharded.optimizer + cost::step_constants(cfg, shape, layout).optimizer, step);
}

// Stage 3: the busiest rank's masters beside its gradients and moments, no compute copies
// in bfloat16, and each part's weights gathered as whole 64-bit words in the compute dtype:
// a layer's in its forward and its backward, the embedding's and the loss head's (the tied
// table in both) in theirs.
TEST(Zero, TheCostModelHoldsTheBusiestRanksMastersAndEachGatheredPartUnderStageThree) {
  const ModelConfig cfg = model_preset("tiny-gpt2");
  const auto model = make_model(nullptr);
  std::vector<int64_t> numels;
  int64_t all = 0, layer = 0, embed = 0, head = 0;
  for (const Param& p : model->params()) {
    numels.push_back(p.value.numel());
    all += p.value.numel();
    if (p.name.rfind("h.0.", 0) == 0) layer += p.value.numel();
    if (p.name == "wte.weight" || p.name == "wpe.weight") embed += p.value.numel();
    if (p.name == "wte.weight" || p.name.rfind("ln_f.", 0) == 0) head += p.value.numel();
  }
  cost::StepShape shape;
  shape.seq = kSeq;
  shape.dtype = at::kBFloat16;
  Layout layout;
  layout.zero = 3;
  const cost::StaticBytes one = cost::static_bytes(cfg, shape, layout);  // one rank: nothing sharded
  EXPECT_EQ(one.params, 4 * all);
  EXPECT_EQ(one.compute_copies, 2 * all);
  EXPECT_EQ(one.gathered, 0);
  layout.dp = 2;
  const std::vector<int> owner = cost::zero_owners(numels, 2);
  std::vector<int64_t> load(2);
  for (size_t i = 0; i < numels.size(); ++i) load[static_cast<size_t>(owner[i])] += numels[i];
  const int64_t busiest = std::max(load[0], load[1]);
  const cost::StaticBytes sharded = cost::static_bytes(cfg, shape, layout);
  EXPECT_EQ(sharded.params, 4 * busiest);
  EXPECT_EQ(sharded.grads, 4 * busiest);
  EXPECT_EQ(sharded.compute_copies, 0);
  const auto words = [](int64_t bytes) { return (bytes + 7) / 8 * 8; };
  const cost::GatheredWeights g = cost::gathered_weights(cfg, layout, at::kBFloat16);
  EXPECT_EQ(g.layer, words(2 * layer));
  EXPECT_EQ(g.embed, words(2 * embed));
  EXPECT_EQ(g.head, words(2 * head));
  EXPECT_EQ(sharded.gathered, std::max({g.layer, g.embed, g.head}));
  Layout two = layout;
  two.zero = 2;
  const cost::StepConstants k3 = cost::step_constants(cfg, shape, layout), k2 = cost::step_constants(cfg, shape, two);
  EXPECT_EQ(k3.embed_peak - k2.embed_peak, g.embed);
  EXPECT_EQ(k3.embed_backward - k2.embed_backward, g.embed);
  EXPECT_EQ(k3.head_peak - k2.head_peak, g.head);
  // The update's point holds the updating rank's own masters where stage 2 holds them all
  // and their compute copies.
  const std::vector<graph::Param> params = cost::stage_params(cfg, layout);
  const cost::OptimizerShare share = cost::optimizer_share(cfg, params, layout);
  ASSERT_EQ(share.rank, cost::optimizer_share(cfg, params, two).rank);
  const cost::StaticBytes sharded2 = cost::static_bytes(cfg, shape, two);
  EXPECT_EQ(sharded.total() + k3.optimizer, sharded2.total() - sharded2.compute_copies + k2.optimizer - 4 * all +
                                                4 * load[static_cast<size_t>(share.rank)]);
}

// Over pipeline stages, each stage's ranks shard their own parameters' gradients, but the
// table the first and last stage both hold (tiny-gpt2's tied embedding) keeps its whole
// gradient on every rank of either: a rank that does not own it holds it besides its share.
// The ends' buffer is held over the stage's embedding or head backward alone.
TEST(Zero, APipelinesTiedTableKeepsItsWholeGradientOnEveryRank) {
  const ModelConfig cfg = model_preset("tiny-gpt2");
  cost::StepShape shape;
  shape.seq = kSeq;
  Layout layout;
  layout.zero = 2;
  layout.dp = 2;
  layout.pp = 2;
  for (int64_t stage = 0; stage < 2; ++stage) {
    Layout at = layout.at_stage(stage);
    const std::vector<graph::Param> params = cost::stage_params(cfg, at);
    std::vector<int64_t> numels;
    int64_t tied = -1;
    for (size_t i = 0; i < params.size(); ++i) {
      numels.push_back(cost::numel(params[i]));
      if (params[i].name == "wte.weight") tied = static_cast<int64_t>(i);
    }
    ASSERT_GE(tied, 0) << "stage " << stage;
    const std::vector<int> owner = cost::zero_owners(numels, 2);
    const cost::GradientBuffers buffers = cost::gradient_buffers(cfg, at, at::kFloat);
    EXPECT_FALSE(buffers.ends_over_layers);
    EXPECT_EQ(buffers.in_layer_backward(), buffers.layer);
    EXPECT_GT(buffers.ends, 0);
    int owners = 0;
    for (int64_t d = 0; d < 2; ++d) {
      int64_t load = 0;
      for (size_t i = 0; i < numels.size(); ++i) load += owner[i] == d ? numels[i] : 0;
      const bool owns = owner[static_cast<size_t>(tied)] == d;
      at.dp_rank = d;
      EXPECT_EQ(cost::static_bytes(cfg, shape, at).grads, 4 * (load + (owns ? 0 : numels[static_cast<size_t>(tied)])))
          << "stage " << stage << ", rank " << d;
      owners += owns ? 1 : 0;
    }
    EXPECT_EQ(owners, 1) << "stage " << stage;  // so one rank holds the table besides its share
  }
}

// Each data-parallel rank is predicted its own share. At a shape whose peak is a layer's
// backward, a rank owning fewer elements peaks lower by exactly the bytes it keeps per
// element (two float32 moments, from stage 2 its gradient, at stage 3 its master), and no
// rank above the plan's prediction, which holds the busiest share.
TEST(Zero, EachDataParallelRankIsPredictedItsOwnShare) {
  ModelConfig cfg = model_preset("gpt2-demo");
  cfg.vocab_size = 2048;
  std::vector<int64_t> numels;
  const auto model = Model::create(cfg, at::kCPU, at::kFloat, 1);  // held: the loop reads its parameters
  for (const Param& p : model->params()) numels.push_back(p.value.numel());
  constexpr int64_t kRanks = 4;
  const std::vector<int> owner = cost::zero_owners(numels, kRanks);
  std::vector<int64_t> load(kRanks);
  for (size_t i = 0; i < numels.size(); ++i) load[static_cast<size_t>(owner[i])] += numels[i];
  const int64_t busiest = *std::max_element(load.begin(), load.end());
  ASSERT_LT(*std::min_element(load.begin(), load.end()), busiest);  // shares that differ
  cost::StepShape shape;
  shape.batch = 16;
  shape.seq = 128;
  cost::NodeTimes times;
  times.flops_per_second = 1e9;
  const ActivationPlan none = ActivationPlan::none(cfg.n_layer);
  for (const int64_t zero : {0, 1, 2, 3}) {
    Layout layout;
    layout.dp = kRanks;
    layout.zero = zero;
    const Planner planner(cfg, shape, layout, times);
    const std::vector<std::vector<int64_t>> peaks = planner.rank_peaks(none);
    if (zero == 0) {
      EXPECT_TRUE(peaks.empty());  // every rank holds the same
      continue;
    }
    const int64_t predicted = planner.predict(none, {}, Ledgers::peak).peak();
    ASSERT_EQ(peaks.size(), static_cast<size_t>(kRanks));
    for (size_t d = 0; d < peaks.size(); ++d) {
      ASSERT_EQ(peaks[d].size(), 1u);
      EXPECT_EQ(peaks[d][0], predicted - (zero + 1) * 4 * (busiest - load[d])) << zero << " " << d;
    }
  }
}

// What a rank sends over its data-parallel group in a step is what the cost model counts:
// the same all-reduces of the same bytes (Group::reduced), at every stage, with tensor and
// sequence parallelism, for a uniform chunk's recompute, which gathers its layers again
// under stage 3, and on each of two pipeline stages, which hold the tied table apart.
// Step 2's, after the first has made AdamW's moments.
TEST(Zero, EachStepsDataParallelCollectivesAreTheCostModels) {
  const ModelConfig cfg = model_preset("tiny-gpt2");
  TrainConfig train = train_config();
  train.grad_accum = 2;
  struct Case {
    int ranks, tp, pp;
    bool sp;
    const char* policy;
    bool keep_first = false;  // the first layer keeps its gathered weights to its backward
  };
  for (const Case c : {Case{2, 1, 1, false, "none"}, Case{2, 1, 1, false, "uniform:2"}, Case{4, 2, 1, true, "full"},
                       Case{4, 1, 2, false, "none"}, Case{2, 1, 1, false, "modules:[mlp]", true}}) {
    for (const int64_t zero : {0, 1, 2, 3}) {
      const std::string what = fmt::format("{} ranks, tp {}, pp {}, {}{}, zero {}", c.ranks, c.tp, c.pp, c.policy,
                                           c.keep_first ? " keeping layer 1's weights" : "", zero);
      Layout layout;
      layout.dp = c.ranks / c.tp / c.pp;
      layout.tp = c.tp;
      layout.sp = c.sp;
      layout.pp = c.pp;
      layout.zero = zero;
      if (c.pp > 1) layout.split = {1, 1};
      cost::StepShape shape;
      shape.batch = train.batch;
      shape.seq = train.seq;
      shape.grad_accum = train.grad_accum;
      ActivationPlan plan = compile_policy(c.policy, cfg.n_layer, cfg.dropout);
      plan.layers[0].weights_kept = c.keep_first;
      std::vector<cost::DataParallelTraffic> predicted;  // by stage
      for (int64_t s = 0; s < c.pp; ++s) {
        predicted.push_back(cost::data_parallel_traffic(cfg, shape, layout.at_stage(s), plan));
        EXPECT_EQ(predicted.back().gathers.none(), zero < 3) << what;
        // Two layers, each gathered again but for a kept one, twice for a chunk's.
        const int64_t again = c.keep_first ? 1 : c.policy == std::string("uniform:2") ? 4 : 2 / c.pp;
        EXPECT_EQ(predicted.back().regathers.messages, zero < 3 ? 0 : again * train.grad_accum * 2 * (layout.dp - 1))
            << what;
        EXPECT_EQ(predicted.back().exchange.none(), zero == 0 || zero == 3) << what;
      }
      std::vector<std::pair<int64_t, dist::Group::Reduced>> counted(static_cast<size_t>(c.ranks));
      testing::on_gloo_ranks(
          c.ranks, c.tp,
          [&](dist::Comm& comm) {
            const int64_t stage = comm.pipeline().rank();
            auto model = c.pp > 1 ? Model::create(cfg, at::kCPU, at::kFloat, 1, Layout::pipeline_stage({1, 1}, stage))
                                  : make_model(c.tp > 1 ? &comm.tensor() : nullptr, c.sp);
            model->set_activation_plan(plan, StoreOptions{});
            TrainStep step(*model, train, kSeed, &comm, zero);
            std::mt19937_64 rng(7);
            step.run(0, dataset(), rng);
            const dist::Group::Reduced before = comm.data().reduced();
            step.run(1, dataset(), rng);
            const dist::Group::Reduced after = comm.data().reduced();
            counted[static_cast<size_t>(comm.rank())] = {
                stage, {after.bytes - before.bytes, after.collectives - before.collectives}};
          },
          c.pp);
      // A ring all-reduce over d ranks: each sends 2 (d - 1) / d of the bytes in 2 (d - 1) steps.
      const auto d = static_cast<double>(layout.dp);
      for (int r = 0; r < c.ranks; ++r) {
        const auto& [stage, got] = counted[static_cast<size_t>(r)];
        const graph::LinkTraffic total = predicted[static_cast<size_t>(stage)].total();
        EXPECT_GT(got.collectives, 0) << what;
        EXPECT_DOUBLE_EQ(total.bytes, 2 * (d - 1) / d * static_cast<double>(got.bytes)) << what << ", rank " << r;
        EXPECT_EQ(total.messages, 2 * (layout.dp - 1) * got.collectives) << what << ", rank " << r;
      }
    }
  }
}

}  // namespace
}  // namespace remat
