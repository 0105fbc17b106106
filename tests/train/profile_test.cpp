// The measured time profile: every node a full recompute runs gets a time, the model is
// left as it was, and the profile is cached per device and shape.
#include "data/temp_dir.h"
#include "remat/cost.h"
#include "remat/model.h"
#include "train/profile.h"
#include "util/gloo_ranks.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace remat {
namespace {

// tiny-gpt2 with a 64-token vocabulary at batch x seq, its run directory in `dir`.
Config tiny(const testing::TempDir& dir, int64_t batch, int64_t seq) {
  at::set_num_threads(1);
  Config cfg;
  cfg.model = model_preset("tiny-gpt2");
  cfg.model.vocab_size = 64;
  cfg.train.batch = batch;
  cfg.train.seq = seq;
  cfg.run.out_dir = dir.path().string();
  return cfg;
}

TEST(TimeProfile, TimesEveryNodeAFullRecomputeRunsAndIsCached) {
  testing::TempDir dir;
  Config cfg = tiny(dir, 2, 16);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  std::vector<at::Tensor> before;
  for (const auto& p : model->params()) before.push_back(p.value.clone());
  const data::TokenDataset data(at::randint(64, {400}, at::detail::createCPUGenerator(1), at::kInt));

  const TimeProfile p = measure_time_profile(cfg, *model, data);
  EXPECT_FALSE(p.cached);
  EXPECT_TRUE(std::filesystem::exists(p.path));
  EXPECT_GT(p.base_seconds, 0.0);
  EXPECT_GT(p.optimizer_seconds, 0.0);
  EXPECT_GT(p.times.flops_per_second, 0.0);
  // Every node a full recompute runs: all but the block's last ops, which feed no slot.
  const graph::BlockGraph g = graph::block_graph(cfg.model, 2, 16, at::kFloat);
  const cost::LayerCost full = cost::price_layer(g, {block_slots().begin(), block_slots().end()}, true, {});
  size_t timed = 0;
  for (const auto& n : g.nodes) {
    if (!p.times.seconds.count(n.name)) continue;
    ++timed;
    EXPECT_GT(p.times.seconds.at(n.name), 0.0) << n.name;
  }
  int64_t ops = 0;
  for (const auto& [kind, count] : full.ops) ops += count;
  // Views are timed too but are no ops; the recomputed ops are a subset of the timed nodes.
  EXPECT_GE(static_cast<int64_t>(timed), ops);
  EXPECT_LT(timed, g.nodes.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(at::equal(before[i], model->params()[i].value)) << model->params()[i].name;
    EXPECT_EQ(model->params()[i].grad.abs().sum().item<double>(), 0.0) << model->params()[i].name;
  }

  const TimeProfile again = measure_time_profile(cfg, *model, data);
  EXPECT_TRUE(again.cached);
  EXPECT_EQ(again.path, p.path);
  EXPECT_EQ(again.base_seconds, p.base_seconds);
  EXPECT_EQ(again.times.seconds, p.times.seconds);
  // Another shape is another profile.
  cfg.train.seq = 8;
  EXPECT_FALSE(measure_time_profile(cfg, *model, data).cached);
  // So is another attention op or loss head: other kernels, other times.
  for (auto change : {+[](Config& c) { c.model.attention = Attention::tiled; },
                      +[](Config& c) { c.model.loss_head = LossHead::recompute; }}) {
    Config other = cfg;
    change(other);
    auto other_model = Model::create(other.model, at::kCPU, at::kFloat, 1);
    EXPECT_FALSE(measure_time_profile(other, *other_model, data).cached);
  }
}

// Ranks that measure at once (pipeline stages sharing a host, tensor-parallel groups) each
// time their own passes, which differ, but all return rank 0's times, so that all plan alike
// (ranks planning from their own times had run other plans than rank 0 predicted for them,
// and their stages could have split the layers differently). So do ranks that wait for rank
// 0's measurement, and every rank finding the cache.
TEST(TimeProfile, EveryRankTakesRankZerosTimes) {
  testing::TempDir dir;
  const Config cfg = tiny(dir, 2, 16);
  const data::TokenDataset data(at::randint(64, {400}, at::detail::createCPUGenerator(1), at::kInt));
  for (const bool together : {true, false}) {
    for (const bool cached : {false, true}) {
      std::vector<TimeProfile> got(3);
      testing::on_gloo_ranks(3, 1, [&](dist::Comm& comm) {
        auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
        got[static_cast<size_t>(comm.rank())] =
            together ? measure_time_profile(cfg, *model, data, &comm) : rank_time_profile(cfg, *model, data, &comm);
      });
      EXPECT_EQ(got[0].cached, cached);  // the second round finds the first's cache
      for (int r = 1; r < 3; ++r) {
        const TimeProfile& p = got[static_cast<size_t>(r)];
        EXPECT_EQ(p.times.seconds, got[0].times.seconds) << "rank " << r << (together ? ", together" : ", after rank 0");
        EXPECT_EQ(p.base_seconds, got[0].base_seconds) << "rank " << r;
        EXPECT_EQ(p.optimizer_seconds, got[0].optimizer_seconds) << "rank " << r;
        EXPECT_EQ(p.times.flops_per_second, got[0].times.flops_per_second) << "rank " << r;
      }
    }
    std::filesystem::remove_all(dir.path() / ".profiles");
  }
}

// The tensor-parallel links are measured by every group at once (two groups of 2 here) and
// every rank of the job takes rank 0's fit, bit for bit, so all of them plan alike.
TEST(TimeProfile, EveryRankTakesRankZerosMeasureOfTheLinks) {
  std::vector<LinkRate> got(4);
  testing::on_gloo_ranks(4, 2, [&](dist::Comm& comm) { got[static_cast<size_t>(comm.rank())] = measure_link_rate(comm); });
  EXPECT_GT(got[0].bytes_per_second, 0);
  EXPECT_GE(got[0].latency_seconds, 0);
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(got[static_cast<size_t>(r)].bytes_per_second, got[0].bytes_per_second) << "rank " << r;
    EXPECT_EQ(got[static_cast<size_t>(r)].latency_seconds, got[0].latency_seconds) << "rank " << r;
  }
}

// A cache file cut short by a killed run, or of the wrong types, is measured again and
// rewritten instead of failing every later run.
TEST(TimeProfile, ADamagedCacheIsMeasuredAgainAndRewritten) {
  testing::TempDir dir;
  const Config cfg = tiny(dir, 1, 8);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  const data::TokenDataset data(at::randint(64, {100}, at::detail::createCPUGenerator(1), at::kInt));
  const std::string path = measure_time_profile(cfg, *model, data).path;
  for (const char* damage : {"{\"node_seconds\": {\"a\": 0.1}, \"flops_per", "{\"node_seconds\": 3}", "[1, 2]",
                             "{\"node_seconds\": {}, \"flops_per_second\": -1, \"base_seconds\": 0, "
                             "\"optimizer_seconds\": 0}"}) {
    std::ofstream(path) << damage;
    EXPECT_FALSE(measure_time_profile(cfg, *model, data).cached) << damage;
    EXPECT_TRUE(measure_time_profile(cfg, *model, data).cached) << damage;
  }
}

}  // namespace
}  // namespace remat
