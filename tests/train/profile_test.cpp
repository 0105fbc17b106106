// The measured time profile: every node a full recompute runs gets a time, the model is
// left as it was, and the profile is cached per device and shape.
#include "util/temp_dir.h"
#include "remat/cost.h"
#include "remat/model.h"
#include "profile/profile.h"
#include "util/gloo_ranks.h"
#include "util/sha256.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

namespace remat {
namespace {

// While it lives, the profile reads this machine's clocks: each reading a second after the
// last, this process busy all of it, and other processes busy `loads[k]` CPUs in the second
// before reading 2k+1 or 2k+2 (the profile's try k+1 reads twice; the last load for any
// later; unknown: /proc/stat unreadable). The real clocks would make the tests' outcome
// hang on what else the machine runs.
class FakeMachine {
 public:
  explicit FakeMachine(std::vector<std::optional<double>> loads) : loads_(std::move(loads)) {
    set_cpu_times_reader([this] { return read(); });
  }
  ~FakeMachine() { set_cpu_times_reader({}); }
  FakeMachine(const FakeMachine&) = delete;
  FakeMachine& operator=(const FakeMachine&) = delete;
  int readings() {
    std::lock_guard<std::mutex> lock(mutex_);
    return readings_;
  }

 private:
  util::CpuTimes read() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++readings_;
    const auto& load = loads_[std::min(static_cast<size_t>(readings_ - 1) / 2, loads_.size() - 1)];
    busy_ += 1 + load.value_or(0);
    return {load ? std::optional<double>(busy_) : std::nullopt, static_cast<double>(readings_),
            static_cast<double>(readings_)};
  }
  std::vector<std::optional<double>> loads_;
  std::mutex mutex_;
  int readings_ = 0;
  double busy_ = 0;
};

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
  FakeMachine idle({0.0});
  testing::TempDir dir;
  Config cfg = tiny(dir, 2, 16);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  std::vector<at::Tensor> before;
  for (const auto& p : model->params()) before.push_back(p.value.clone());
  const data::TokenDataset data(at::randint(64, {400}, at::detail::createCPUGenerator(1), at::kInt));

  const TimeProfile p = measure_time_profile(cfg, *model, data);
  EXPECT_FALSE(p.cached);
  EXPECT_TRUE(std::filesystem::exists(p.path));
  EXPECT_EQ(p.other_cpus, 0.0);
  EXPECT_EQ(idle.readings(), 2) << "one try: idle";
  EXPECT_GT(p.base_seconds, 0.0);
  EXPECT_GT(p.optimizer_seconds, 0.0);
  EXPECT_GT(p.times.flops_per_second, 0.0);
  // Every node a full recompute runs: all but the block's last ops, which feed no slot.
  const graph::BlockGraph g = graph::block_graph(cfg.model, 2, 16, at::kFloat);
  const cost::LayerCost full = cost::price_layer(g, SlotMask::droppable(), true, {});
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
  EXPECT_EQ(again.other_cpus, 0.0);
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
  FakeMachine idle({0.0});
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
        EXPECT_EQ(p.times.seconds, got[0].times.seconds)
            << "rank " << r << (together ? ", together" : ", after rank 0");
        EXPECT_EQ(p.base_seconds, got[0].base_seconds) << "rank " << r;
        EXPECT_EQ(p.optimizer_seconds, got[0].optimizer_seconds) << "rank " << r;
        EXPECT_EQ(p.times.flops_per_second, got[0].times.flops_per_second) << "rank " << r;
      }
    }
    std::filesystem::remove_all(dir.path() / ".profiles");
  }
}

// The tensor-parallel links are measured by every group at once (two groups of 2 here),
// then the data-parallel ones (two groups of 2 too), and every rank of the job takes rank
// 0's fit of each, bit for bit, so all of them plan alike.
TEST(TimeProfile, EveryRankTakesRankZerosMeasureOfTheLinks) {
  std::vector<LinkRate> tensor(4), data(4);
  testing::on_gloo_ranks(4, 2, [&](dist::Comm& comm) {
    const auto r = static_cast<size_t>(comm.rank());
    tensor[r] = measure_link_rate(comm, comm.tensor(), "the tensor-parallel links");
    data[r] = measure_link_rate(comm, comm.data(), "the data-parallel links");
  });
  for (const auto* got : {&tensor, &data}) {
    EXPECT_GT((*got)[0].bytes_per_second, 0);
    EXPECT_GE((*got)[0].latency_seconds, 0);
    for (size_t r = 1; r < 4; ++r) {
      EXPECT_EQ((*got)[r].bytes_per_second, (*got)[0].bytes_per_second) << "rank " << r;
      EXPECT_EQ((*got)[r].latency_seconds, (*got)[0].latency_seconds) << "rank " << r;
    }
  }
}

// A cache file cut short by a killed run, or of the wrong types, is measured again and
// rewritten instead of failing every later run.
TEST(TimeProfile, ADamagedCacheIsMeasuredAgainAndRewritten) {
  FakeMachine idle({0.0});
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

const data::TokenDataset tiny_data() {
  return data::TokenDataset(at::randint(64, {100}, at::detail::createCPUGenerator(1), at::kInt));
}

// The profile of `cfg` on `model` measured (or read), and what it said on stderr.
std::pair<TimeProfile, std::string> measure_saying(const Config& cfg, Model& model) {
  ::testing::internal::CaptureStderr();
  TimeProfile p = measure_time_profile(cfg, model, tiny_data());
  return {std::move(p), ::testing::internal::GetCapturedStderr()};
}

// Other processes busy every CPU of the machine (more than one thread on it tolerates): the
// profile is measured three times, used, not cached, and stderr says so with the load.
TEST(TimeProfile, ALoadedProfileIsMeasuredAgainThenUsedButNotCached) {
  const double load = util::machine_cpus();
  FakeMachine loaded({load});
  testing::TempDir dir;
  const Config cfg = tiny(dir, 1, 8);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  const auto [p, said] = measure_saying(cfg, *model);
  EXPECT_EQ(loaded.readings(), 2 * 3) << "the first try and two more";
  EXPECT_FALSE(p.cached);
  EXPECT_FALSE(std::filesystem::exists(p.path));
  EXPECT_DOUBLE_EQ(p.other_cpus.value(), load);
  EXPECT_GT(p.base_seconds, 0.0) << "this run plans from it";
  EXPECT_NE(said.find(fmt::format("Other processes used {:.1f} of this machine's {} CPUs", load, util::machine_cpus())),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("does not cache it"), std::string::npos) << said;
  EXPECT_FALSE(measure_time_profile(cfg, *model, tiny_data()).cached) << "the next run measures it again";
}

// A load that passes before the next try: that try's idle profile is cached.
TEST(TimeProfile, ALoadThatPassesIsMeasuredAgainAndCached) {
  FakeMachine passing({util::machine_cpus(), 0.0});
  testing::TempDir dir;
  const Config cfg = tiny(dir, 1, 8);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  const TimeProfile p = measure_time_profile(cfg, *model, tiny_data());
  EXPECT_EQ(passing.readings(), 2 * 2);
  EXPECT_EQ(p.other_cpus, 0.0);
  const TimeProfile again = measure_time_profile(cfg, *model, tiny_data());
  EXPECT_TRUE(again.cached);
  EXPECT_EQ(again.other_cpus, 0.0);
  EXPECT_EQ(again.base_seconds, p.base_seconds);
}

// Without /proc/stat the load is unknown: said, not taken for idle, and cached as measured
// (the profile cached as it always was; never caching would measure it every run).
TEST(TimeProfile, AnUnknownLoadIsSaidAndCached) {
  FakeMachine unknown({std::nullopt});
  testing::TempDir dir;
  const Config cfg = tiny(dir, 1, 8);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  const auto [p, said] = measure_saying(cfg, *model);
  EXPECT_EQ(unknown.readings(), 2);
  EXPECT_FALSE(p.other_cpus);
  EXPECT_NE(said.find("whether other processes slowed the time profile is unknown"), std::string::npos) << said;
  const TimeProfile again = measure_time_profile(cfg, *model, tiny_data());
  EXPECT_TRUE(again.cached);
  EXPECT_FALSE(again.other_cpus);
}

// The cache's file is named after the build that measured it (a digest of this test
// binary's path, size and modification time): a rebuilt remat, whose ops may run at other
// speeds, measures again instead of reading an older build's times.
TEST(TimeProfile, TheCacheKeyNamesTheBuild) {
  FakeMachine idle({0.0});
  testing::TempDir dir;
  const Config cfg = tiny(dir, 1, 8);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  const std::string name =
      std::filesystem::path(measure_time_profile(cfg, *model, tiny_data()).path).filename().string();
  const auto exe = std::filesystem::read_symlink("/proc/self/exe");
  const std::string build =
      util::sha256_hex(fmt::format("{}:{}:{}", exe.string(), std::filesystem::file_size(exe),
                                   std::filesystem::last_write_time(exe).time_since_epoch().count()))
          .substr(0, 8);
  EXPECT_NE(name.find("-build" + build), std::string::npos) << name;
}

// A cache written before the load and the links were recorded still reads, as it was.
TEST(TimeProfile, ACacheWithoutTheNewerFiguresStillReads) {
  FakeMachine idle({0.0});
  testing::TempDir dir;
  const Config cfg = tiny(dir, 1, 8);
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  const std::string path = measure_time_profile(cfg, *model, tiny_data()).path;
  std::ofstream(path) << R"({"node_seconds": {"attn": 0.25}, "flops_per_second": 1e9, "base_seconds": 0.5,
                            "optimizer_seconds": 0.125})";
  const TimeProfile old = measure_time_profile(cfg, *model, tiny_data());
  EXPECT_TRUE(old.cached);
  EXPECT_FALSE(old.other_cpus);
  EXPECT_EQ(old.times.seconds, (std::map<std::string, double>{{"attn", 0.25}}));
  EXPECT_EQ(old.base_seconds, 0.5);
  EXPECT_EQ(old.optimizer_seconds, 0.125);
  EXPECT_EQ(old.times.link_bytes_per_second, 0.0);
}

// Ranks measuring at once all cache the profile or all not, as rank 0's load decides, and
// so do ranks that wait for rank 0's measurement; rank 0's load is every rank's.
TEST(TimeProfile, EveryRankCachesOrNotAsRankZeroDoes) {
  const double load = util::machine_cpus() + 1;  // more than any thread count tolerates
  FakeMachine loaded({load});
  testing::TempDir dir;
  const Config cfg = tiny(dir, 1, 8);
  for (const bool together : {true, false}) {
    std::vector<TimeProfile> got(3);
    testing::on_gloo_ranks(3, 1, [&](dist::Comm& comm) {
      auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
      got[static_cast<size_t>(comm.rank())] = together ? measure_time_profile(cfg, *model, tiny_data(), &comm)
                                                       : rank_time_profile(cfg, *model, tiny_data(), &comm);
    });
    for (int r = 0; r < 3; ++r) {
      const TimeProfile& p = got[static_cast<size_t>(r)];
      EXPECT_FALSE(p.cached) << "rank " << r;
      EXPECT_FALSE(std::filesystem::exists(p.path)) << "rank " << r;
      EXPECT_DOUBLE_EQ(p.other_cpus.value(), load) << "rank " << r;
    }
  }
}

// Under tensor parallelism the links' fit is cached with the times and read back by every
// rank instead of measured (a fit measured again would not equal the one written in the
// file); a cache without it, as written before, gets it measured and added.
TEST(TimeProfile, TheLinksAreCachedWithTheProfile) {
  FakeMachine idle({0.0});
  testing::TempDir dir;
  Config cfg = tiny(dir, 1, 8);
  cfg.parallel.tp = 2;
  const auto on_ranks = [&] {
    std::vector<TimeProfile> got(2);
    testing::on_gloo_ranks(2, 2, [&](dist::Comm& comm) {
      Layout layout;
      layout.tp = 2;
      auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1, layout, &comm.tensor());
      got[static_cast<size_t>(comm.rank())] = measure_time_profile(cfg, *model, tiny_data(), &comm);
    });
    EXPECT_EQ(got[1].times.link_bytes_per_second, got[0].times.link_bytes_per_second);
    EXPECT_EQ(got[1].times.link_latency_seconds, got[0].times.link_latency_seconds);
    EXPECT_EQ(got[1].cached, got[0].cached);
    return got[0];
  };
  const TimeProfile first = on_ranks();
  EXPECT_FALSE(first.cached);
  EXPECT_GT(first.times.link_bytes_per_second, 0.0);
  const auto edit = [&](const std::function<void(nlohmann::json&)>& change) {
    std::ifstream in(first.path);
    nlohmann::json j = nlohmann::json::parse(in);
    change(j);
    std::ofstream(first.path) << j.dump();
  };
  edit([](nlohmann::json& j) {
    EXPECT_GT(j.at("link_bytes_per_second").get<double>(), 0.0);
    j["link_bytes_per_second"] = 123.0;
    j["link_latency_seconds"] = 4.5e-6;
  });
  const TimeProfile cached = on_ranks();
  EXPECT_TRUE(cached.cached);
  EXPECT_EQ(cached.times.link_bytes_per_second, 123.0);
  EXPECT_EQ(cached.times.link_latency_seconds, 4.5e-6);
  edit([](nlohmann::json& j) {
    j.erase("link_bytes_per_second");
    j.erase("link_latency_seconds");
  });
  const TimeProfile added = on_ranks();
  EXPECT_TRUE(added.cached) << "the times are read";
  EXPECT_GT(added.times.link_bytes_per_second, 0.0);
  EXPECT_NE(added.times.link_bytes_per_second, 123.0);
  std::ifstream in(first.path);
  EXPECT_EQ(nlohmann::json::parse(in).at("link_bytes_per_second").get<double>(), added.times.link_bytes_per_second);
}

}  // namespace
}  // namespace remat
