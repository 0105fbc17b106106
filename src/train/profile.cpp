#include "train/profile.h"

#include "remat/cost.h"
#include "remat/policy.h"
#include "train/data_parallel.h"
#include "train/device.h"
#include "util/atomic_file.h"
#include "util/sha256.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace remat {
namespace {

namespace fs = std::filesystem;

// The data-parallel ranks ZeRO-1 shards the optimizer over (1: none).
int64_t zero_ranks(const Config& cfg) { return cfg.parallel.zero == 1 ? std::max<int64_t>(1, cfg.parallel.dp) : 1; }

// Everything a measured time depends on, as a file name.
// `at_once`: the ranks measuring together, sharing the host as they will train.
std::string profile_key(const Config& cfg, const Model& model, int at_once) {
  const ModelConfig& m = cfg.model;
  const TrainConfig& t = cfg.train;
  // The BLAS and its threading change every matmul's time: a digest of their description.
  // "ig": tensor parallelism alone, whose profile times the gather of a sharded input.
  std::string key = fmt::format(
      "{}-{}-{}-L{}-C{}-H{}-KV{}-F{}-V{}-p{}-{}{}-B{}-T{}-tp{}{}-ce{}{}-es{}-threads{}-blas{}", model.device().str(),
      cfg.run.dtype, arch_name(m.arch), m.n_layer, m.d_model, m.n_head, m.n_kv_head, m.d_ff, m.vocab_size, m.dropout,
      attention_name(m.attention), m.attention == Attention::tiled ? m.attention_tile : 0, t.batch, t.seq,
      model.tp_size(), model.sequence_parallel() ? "sp" : model.tp_size() > 1 ? "ig" : "", t.ce_chunk,
      loss_head_name(m.loss_head), cfg.ac.early_stop ? 1 : 0, at::get_num_threads(),
      util::sha256_hex(blas_name()).substr(0, 8));
  // ZeRO-1 updates a share of the parameters; without it the key is as it always was.
  if (zero_ranks(cfg) > 1) key += fmt::format("-zero{}", zero_ranks(cfg));
  if (at_once > 1) key += fmt::format("-ranks{}", at_once);
  std::replace(key.begin(), key.end(), ':', '_');
  return key + ".json";
}

// Fills `p`'s times from a profile's JSON `text` when it is whole and sane; else says why.
bool parse_profile(const std::string& text, TimeProfile& p, std::string& why) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  why = "it is not a JSON object";
  if (!j.is_object()) return false;
  try {
    const auto seconds = j.at("node_seconds").get<std::map<std::string, double>>();
    const double flops = j.at("flops_per_second").get<double>();
    const double base = j.at("base_seconds").get<double>(), optimizer = j.at("optimizer_seconds").get<double>();
    const auto time = [](double s) { return std::isfinite(s) && s >= 0; };
    const bool times_ok = std::all_of(seconds.begin(), seconds.end(), [&](const auto& e) { return time(e.second); });
    if (times_ok && time(base) && time(optimizer) && std::isfinite(flops) && flops > 0) {
      p.times.seconds = seconds;
      p.times.flops_per_second = flops;
      p.base_seconds = base;
      p.optimizer_seconds = optimizer;
      return true;
    }
    why = "a time in it is negative or not finite";
  } catch (const nlohmann::json::exception& e) {
    why = e.what();
  }
  return false;
}

std::string profile_json(const TimeProfile& p) {
  return nlohmann::json{{"node_seconds", p.times.seconds},
                        {"flops_per_second", p.times.flops_per_second},
                        {"base_seconds", p.base_seconds},
                        {"optimizer_seconds", p.optimizer_seconds}}
             .dump(2) +
         "\n";
}

// Fills `p` from the cache file at `path` when it is whole and sane. A damaged one (a
// killed write, a hand edit) is said on stderr and measured again, rather than failing
// every later run with a bare JSON error.
bool read_cached(const std::string& path, TimeProfile& p) {
  std::ifstream in(path);
  std::string why;
  if (parse_profile(std::string(std::istreambuf_iterator<char>(in), {}), p, why)) return true;
  fmt::print(stderr, "The cached time profile {} is damaged ({}); measuring it again.\n", path, why);
  return false;
}

// Every rank of `ranks` takes rank 0's times: each plans from them, and ranks that plan
// from their own measurements (or their own hosts' caches) may choose other plans, which
// the stages' split, the tensor-parallel collectives and the predictions all need alike.
void take_rank0s(dist::Comm* ranks, TimeProfile& p) {
  if (ranks == nullptr || ranks->size() == 1) return;
  const std::string key = "time-profile/" + fs::path(p.path).filename().string();
  if (ranks->rank() == 0) {
    ranks->post(key, profile_json(p));
    return;
  }
  std::string why;
  if (!parse_profile(ranks->await(key, "sharing rank 0's time profile"), p, why)) {
    throw std::runtime_error("The time profile rank 0 shared could not be read (" + why + ").");
  }
}

// Rank 0's `value`, bit for bit, on every rank of `ranks`.
double rank0s(dist::Comm& ranks, double value, const std::string& what) {
  static_assert(sizeof(double) == sizeof(int64_t));
  std::vector<int64_t> bits(1);
  std::memcpy(bits.data(), &value, sizeof(double));
  bits = ranks.all_gather(bits, what)[0];
  std::memcpy(&value, bits.data(), sizeof(double));
  return value;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TimeProfile measure_time_profile(const Config& cfg, Model& model, const data::TokenDataset& data,
                                 dist::Comm* together) {
  TimeProfile p;
  const fs::path dir = fs::path(cfg.run.out_dir) / ".profiles";
  p.path = (dir / profile_key(cfg, model, together != nullptr ? together->size() : 1)).string();
  for (const auto& prm : model.params()) p.optimizer_bytes += static_cast<int64_t>(prm.value.nbytes());
  if (zero_ranks(cfg) > 1) {
    std::vector<int64_t> numels;
    for (const auto& prm : model.params()) numels.push_back(prm.value.numel());
    const std::vector<int> owner = cost::zero_owners(numels, zero_ranks(cfg));
    p.optimizer_bytes = 0;
    for (size_t i = 0; i < owner.size(); ++i) {
      if (owner[i] == 0) p.optimizer_bytes += static_cast<int64_t>(model.params()[i].value.nbytes());
    }
  }
  p.cached = fs::exists(p.path) && read_cached(p.path, p);
  if (together != nullptr) {
    for (const auto& found : together->all_gather({p.cached ? 1 : 0}, "reading the cached time profile")) {
      p.cached = p.cached && found[0] == 1;
    }
  }
  if (p.cached) {
    take_rank0s(together, p);
    return p;
  }

  const at::Device device = model.device();
  const TrainConfig& t = cfg.train;
  // Every layer fully recomputed: each node runs once per layer and is timed by the store.
  StoreOptions options;
  options.early_stop = cfg.ac.early_stop;
  options.time_nodes = true;
  const graph::BlockGraph block = graph::block_graph(cfg.model, t.batch, t.seq, model.compute_dtype(),
                                                     model.tp_size(), model.sequence_parallel());
  ActivationPlan full = compile_policy("full", cfg.model.n_layer, cfg.model.dropout);
  // Where a layer may keep its input as a share, each does, so that the all-gather a plan
  // may choose (graph::kInputGather) is timed too.
  for (auto& l : full.layers) l.input_sharded = block.input_shardable();
  model.set_activation_plan(full, options);
  const auto batch = data.sequential(0, t.batch, t.seq);
  const at::Tensor tokens = batch.tokens.to(device), targets = batch.targets.to(device);
  constexpr int kReps = 3;
  std::vector<std::pair<double, StoreCounters>> reps;
  for (int rep = 0; rep <= kReps; ++rep) {
    model.store()->reset_counters();
    synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    model.forward_backward(tokens, targets, StepContext{static_cast<uint64_t>(cfg.run.seed), 0, 0}, 1.0,
                           t.ce_chunk);
    synchronize(device);
    if (rep > 0) reps.emplace_back(seconds_since(t0), model.store()->counters());  // rep 0 warms caches
  }
  model.zero_grad();
  std::sort(reps.begin(), reps.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const auto& [pass_seconds, counters] = reps[reps.size() / 2];
  double recompute = 0;
  for (const auto& [name, seconds] : counters.node_seconds) {
    p.times.seconds[name] = seconds / static_cast<double>(counters.node_runs.at(name));
    recompute += seconds;
  }
  p.base_seconds = pass_seconds - recompute;
  // Nodes a full recompute never runs (the block's last ops, which feed no slot) are
  // priced by FLOPs at the rate the timed nodes reached.
  double flops = 0, timed = 0;
  for (const auto& n : block.nodes) {
    auto it = p.times.seconds.find(n.name);
    if (it == p.times.seconds.end()) continue;
    flops += n.flops;
    timed += it->second;
  }
  p.times.flops_per_second = timed > 0 ? flops / timed : 0.0;

  // The update on scratch copies: the same tensors' sizes, the model untouched. Under
  // ZeRO-1, those of data-parallel rank 0's share (the ranks' shares differ by less than
  // the largest parameter); the clipping still reads every gradient.
  std::vector<int64_t> numels;
  for (const auto& prm : model.params()) numels.push_back(prm.value.numel());
  const std::vector<int> owner = cost::zero_owners(numels, zero_ranks(cfg));
  std::vector<at::Tensor> copies, grads;
  for (size_t i = 0; i < model.params().size(); ++i) {
    grads.push_back(at::zeros_like(model.params()[i].grad));
    if (owner[i] != 0) continue;
    at::Tensor c = model.params()[i].value.detach().clone();
    c.mutable_grad() = grads.back();
    copies.push_back(c);
  }
  torch::optim::AdamW scratch(copies, torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
  for (int rep = 0; rep < 2; ++rep) {
    synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<at::Tensor> squares;
    for (const auto& g : grads) squares.push_back(g.pow(2).sum());
    at::stack(squares).sum().item<double>();
    scratch.step();
    synchronize(device);
    p.optimizer_seconds = seconds_since(t0);  // the second: state already allocated
  }

  if (together == nullptr || together->rank() == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    util::write_file_atomically(p.path, profile_json(p));
  }
  take_rank0s(together, p);
  return p;
}

TimeProfile rank_time_profile(const Config& cfg, Model& model, const data::TokenDataset& data, dist::Comm* ranks) {
  // A tensor-parallel rank's passes run its group's collectives: every rank measures.
  if (cfg.parallel.tp > 1) return measure_time_profile(cfg, model, data, ranks);
  TimeProfile profile;
  rank0_first(ranks, "measuring the time profile", [&] { profile = measure_time_profile(cfg, model, data); });
  take_rank0s(ranks, profile);
  return profile;
}

TimeProfile probe_time_profile(const Config& cfg, at::Device device, at::ScalarType dtype,
                               const data::TokenDataset& data, dist::Comm* ranks) {
  const auto measure = [&](int64_t layers) {
    Config probe = cfg;
    probe.model.n_layer = layers;
    probe.parallel.pp = 1;
    probe.ac.stages = 1;
    // Under tensor parallelism the probe is split over this rank's group, as a stage is.
    auto model = Model::create(probe.model, device, dtype, static_cast<uint64_t>(cfg.run.seed),
                               cfg.parallel.tp > 1 ? &ranks->tensor() : nullptr, cfg.parallel.sp);
    // Every rank measures at once: the stages will share the host's cores and memory so.
    return measure_time_profile(probe, *model, data, ranks);
  };
  TimeProfile p = measure(std::min<int64_t>(cfg.model.n_layer, 2));
  if (cfg.model.n_layer < 2) return p;
  const TimeProfile one = measure(1);
  const double layer = p.base_seconds - one.base_seconds, ends = one.base_seconds - layer;
  // Noise can make a difference of small times meaningless: then the node times decide.
  if (layer > 0 && ends > 0) {
    p.times.layer_pass_seconds = layer;
    p.times.ends_pass_seconds = ends;
  }
  return p;
}

LinkRate measure_link_rate(dist::Comm& ranks) {
  dist::Group& group = ranks.tensor();
  const int64_t t = group.size();
  // A small tensor's time is mostly latency, a large one's mostly bytes; both whole
  // tensors of `whole` bytes, each rank giving its 1/t.
  const auto time = [&](int64_t whole) {
    const at::Tensor share = at::zeros({1, whole / t}, at::kByte);
    std::vector<double> reps;
    for (int rep = 0; rep <= 5; ++rep) {
      ranks.barrier("measuring the tensor-parallel links");
      const auto t0 = std::chrono::steady_clock::now();
      group.all_gather(share, 1, "measuring the tensor-parallel links");
      if (rep > 0) reps.push_back(seconds_since(t0));  // rep 0 connects and warms
    }
    std::sort(reps.begin(), reps.end());
    return reps[reps.size() / 2];
  };
  const int64_t small = 4096 * t, large = (int64_t{16} << 20) / t * t;
  const double small_s = time(small), large_s = time(large);
  const double part = static_cast<double>(t - 1) / static_cast<double>(t);  // of the whole a rank sends
  LinkRate fit;
  if (large_s > small_s) {
    fit.bytes_per_second = part * static_cast<double>(large - small) / (large_s - small_s);
    fit.latency_seconds =
        std::max(0.0, (small_s - part * static_cast<double>(small) / fit.bytes_per_second) / static_cast<double>(t - 1));
  } else {  // noise swamped the difference: all of the large one's time is bytes
    fit.bytes_per_second = part * static_cast<double>(large) / large_s;
  }
  // Rank 0's fit: every rank plans with the same numbers.
  fit.bytes_per_second = rank0s(ranks, fit.bytes_per_second, "sharing rank 0's measure of the links");
  fit.latency_seconds = rank0s(ranks, fit.latency_seconds, "sharing rank 0's measure of the links");
  return fit;
}

TimeProfile run_time_profile(const Config& cfg, at::Device device, at::ScalarType dtype,
                             const data::TokenDataset& data, dist::Comm* ranks, double matmul_rate,
                             const std::function<std::unique_ptr<Model>()>& create, std::unique_ptr<Model>& model) {
  TimeProfile profile;
  if (cfg.ac.profile && cfg.parallel.pp == 1) {
    model.reset();
    model = create();
    profile = rank_time_profile(cfg, *model, data, ranks);
  } else if (cfg.ac.profile) {
    profile = probe_time_profile(cfg, device, dtype, data, ranks);
  } else {
    // Rank 0's matmul rate, as a profile is rank 0's: ranks pricing by their own rates
    // could choose different plans (bytes weighed against FLOPs otherwise; a sum rounded
    // otherwise), whose collectives would never meet.
    const bool shared = ranks != nullptr && ranks->size() > 1;
    profile.times.flops_per_second = shared ? rank0s(*ranks, matmul_rate, "sharing rank 0's matmul rate") : matmul_rate;
  }
  if (cfg.parallel.tp > 1) {
    const LinkRate link = measure_link_rate(*ranks);
    profile.times.link_bytes_per_second = link.bytes_per_second;
    profile.times.link_latency_seconds = link.latency_seconds;
  }
  return profile;
}

}  // namespace remat
