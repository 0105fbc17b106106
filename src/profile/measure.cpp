#include "dist/ranks.h"
#include "model/adamw.h"
#include "profile/cache.h"
#include "remat/cost.h"
#include "remat/memory.h"
#include "remat/policy.h"
#include "util/cpu_load.h"
#include "util/device.h"
#include "util/stop_signals.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include <unistd.h>

namespace remat {
namespace {

using profile::rank0s;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// What the profile reads the clocks with; tests give their own readings.
std::function<util::CpuTimes()>& cpu_times_reader() {
  static std::function<util::CpuTimes()> reader = util::read_cpu_times;
  return reader;
}

}  // namespace

util::CpuTimes cpu_times() { return cpu_times_reader()(); }

MachineLoad machine_load(dist::Comm* together, const util::CpuTimes& from, const util::CpuTimes& to) {
  const double own = to.own_seconds - from.own_seconds;
  double job_seconds = own;
  int job_threads = at::get_num_threads();
  if (together != nullptr && together->size() > 1) {
    std::array<char, 256> host{};
    gethostname(host.data(), host.size() - 1);
    const auto host_id = static_cast<int64_t>(std::hash<std::string>{}(host.data()));
    const auto all = together->all_gather({host_id, static_cast<int64_t>(getpid()), std::llround(own * 1e6)},
                                          "sharing how busy the machine was");
    // Rank 0's host's processes by id, each with its first rank's time (rank 0's for its
    // own: its window is the one measured).
    std::map<int64_t, double> processes;
    job_threads = 0;
    for (const auto& r : all) {
      if (r[0] != all[0][0]) continue;
      job_threads += at::get_num_threads();
      processes.emplace(r[1], static_cast<double>(r[2]) * 1e-6);
    }
    job_seconds = 0;
    for (const auto& [pid, seconds] : processes) job_seconds += seconds;
  }
  MachineLoad load;
  load.other_cpus = util::other_cpus(from, to, job_seconds);
  load.tolerated = util::tolerated_other_cpus(util::machine_cpus(), job_threads, to.wall_seconds - from.wall_seconds);
  if (together != nullptr && together->size() > 1) {
    constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();
    const double other = rank0s(*together, load.other_cpus.value_or(kUnknown), "sharing how busy the machine was");
    load.other_cpus = std::isnan(other) ? std::nullopt : std::optional<double>(other);
    load.tolerated = rank0s(*together, load.tolerated, "sharing how busy the machine was");
  }
  return load;
}

namespace {

// Times the update around the passes twice into `p` (measure_time_profile says how).
void measure_update(const Config& cfg, Model& model, TimeProfile& p) {
  const at::Device device = model.device();
  const TrainConfig& t = cfg.train;
  // The update on scratch copies: the same tensors' sizes, the model untouched. Under
  // ZeRO-1, those of data-parallel rank 0's share (the ranks' shares differ by less than
  // the largest parameter); the clipping still reads every gradient.
  std::vector<int64_t> numels;
  for (const auto& prm : model.params()) numels.push_back(prm.value.numel());
  const std::vector<int> owner = cost::zero_owners(numels, profile::zero_ranks(cfg));
  std::vector<at::Tensor> grads;
  std::vector<AdamWParam> copies;
  for (size_t i = 0; i < model.params().size(); ++i) {
    const Param& prm = model.params()[i];
    grads.push_back(at::zeros_like(prm.grad));
    if (owner[i] == 0) copies.push_back({prm.value.detach().clone(), grads.back(), prm.decay});
  }
  AdamW scratch(std::move(copies), AdamWSettings{.beta1 = t.beta1, .beta2 = t.beta2, .weight_decay = t.weight_decay});
  for (int rep = 0; rep < 2; ++rep) {
    synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    model.zero_grad();
    std::vector<at::Tensor> squares;
    for (const auto& g : grads) squares.push_back(g.pow(2).sum());
    at::stack(squares).sum().item<double>();
    scratch.step(t.lr);
    // An update changes every weight, so the next pass casts them to the compute dtype anew.
    model.cast_compute_copies();
    synchronize(device);
    p.optimizer_seconds = seconds_since(t0);  // the second: state already allocated
  }
}

// Measures `p`'s times once: a few passes with every layer recomputed and two updates
// (measure_time_profile says how).
void measure_times(const Config& cfg, Model& model, const data::TokenDataset& data, TimeProfile& p) {
  const at::Device device = model.device();
  const TrainConfig& t = cfg.train;
  // Every layer fully recomputed: each node runs once per layer and is timed by the store.
  StoreOptions options;
  options.early_stop = cfg.ac.early_stop;
  options.time_nodes = true;
  Layout layout;
  layout.tp = model.tp_size();
  layout.sp = model.sequence_parallel();
  const graph::BlockGraph block = graph::block_graph(cfg.model, t.batch, t.seq, model.compute_dtype(), layout);
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
    model.zero_grad();  // each pass writes the gradients, as a step's first microbatch does
    synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    model.forward_backward(tokens, targets, StepContext{static_cast<uint64_t>(cfg.run.seed), 0, 0}, 1.0, t.ce_chunk);
    synchronize(device);
    const double seconds = seconds_since(t0);
    model.store()->settle_node_times();
    if (rep > 0) reps.emplace_back(seconds, model.store()->counters());  // rep 0 warms caches
  }
  model.grad_buffer().zero_();
  std::sort(reps.begin(), reps.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const auto& [pass_seconds, counters] = reps[reps.size() / 2];
  double recompute = 0;
  p.times.seconds.clear();
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
  measure_update(cfg, model, p);
}

// Whether every rank of `together` (if any) says `yes`.
bool all_say(dist::Comm* together, bool yes, const std::string& what) {
  if (together == nullptr) return yes;
  for (const auto& said : together->all_gather({yes ? 1 : 0}, what)) yes = yes && said[0] == 1;
  return yes;
}

// measure_time_profile, with the tensor-parallel links measured and cached with it where
// `links` (then `together` is the job).
TimeProfile profile_of(const Config& cfg, Model& model, const data::TokenDataset& data, dist::Comm* together,
                       bool links) {
  TimeProfile p = profile::unmeasured(cfg, model, together != nullptr ? together->size() : 1);
  p.cached =
      all_say(together, std::filesystem::exists(p.path) && profile::read_cached(p), "reading the cached time profile");
  bool store = false;
  if (!p.cached) {
    // Times measured beside other work can be several times slow: a loaded try is measured
    // again, at most kTries in all, each costing about what the first did.
    constexpr int kTries = 3;
    const auto t0 = std::chrono::steady_clock::now();
    MachineLoad load;
    int tries = 0;
    while (tries == 0 || (load.suspect() && tries < kTries)) {
      const util::CpuTimes from = cpu_times();
      measure_times(cfg, model, data, p);
      util::CpuTimes to = cpu_times();
      // The busy time counts whole ticks, which a window of a few milliseconds (a small
      // model's passes) cannot tell from a load: a short one is padded by waiting. Waiting
      // leaves this run's CPUs to the others, so it reads no less load than the passes met.
      constexpr double kWindow = 0.5;
      if (to.wall_seconds - from.wall_seconds < kWindow) {
        std::this_thread::sleep_for(std::chrono::duration<double>(kWindow - (to.wall_seconds - from.wall_seconds)));
        to = cpu_times();
      }
      load = machine_load(together, from, to);
      ++tries;
    }
    p.other_cpus = load.other_cpus;
    const bool rank0 = together == nullptr || together->rank() == 0;
    if (rank0 && !load.other_cpus) {
      fmt::print(stderr,
                 "This machine's CPU time could not be read from /proc/stat, so whether other processes slowed the "
                 "time profile is unknown; it is cached as measured: if other work ran beside this run, delete {} "
                 "to measure it again.\n",
                 p.path);
    } else if (rank0 && load.suspect()) {
      fmt::print(stderr,
                 "Other processes used {:.1f} of this machine's {} CPUs while the time profile was measured ({} "
                 "tries, {:.1f} s; more than {:.1f} slows this run's threads): times measured beside other work can "
                 "be several times slow and a cached profile would mislead later plans, so this run plans from it "
                 "but does not cache it; run on an idle machine, and the profile will be measured again next run.\n",
                 *load.other_cpus, util::machine_cpus(), tries, seconds_since(t0), load.tolerated);
    }
    store = !load.suspect();
  }
  // The links are measured where the profile has none: measured now, or cached before
  // they were (then added to the cache).
  if (links && !all_say(together, p.times.link_bytes_per_second > 0, "reading the cached links")) {
    const LinkRate link = measure_link_rate(*together, together->tensor(), "the tensor-parallel links");
    p.times.link_bytes_per_second = link.bytes_per_second;
    p.times.link_latency_seconds = link.latency_seconds;
    store = store || p.cached;
  }
  if (store && (together == nullptr || together->rank() == 0)) profile::write_cached(p);
  profile::take_rank0s(together, p);
  return p;
}

}  // namespace

void set_cpu_times_reader(std::function<util::CpuTimes()> reader) {
  cpu_times_reader() = reader ? std::move(reader) : util::read_cpu_times;
}

TimeProfile measure_time_profile(const Config& cfg, Model& model, const data::TokenDataset& data,
                                 dist::Comm* together) {
  return profile_of(cfg, model, data, together, cfg.parallel.tp > 1);
}

TimeProfile rank_time_profile(const Config& cfg, Model& model, const data::TokenDataset& data, dist::Comm* ranks) {
  // A tensor-parallel rank's passes run its group's collectives: every rank measures.
  if (cfg.parallel.tp > 1) return measure_time_profile(cfg, model, data, ranks);
  // Rank 0 measures alone while the others wait (measuring beside it, they would be other
  // processes slowing it), and every rank takes its profile.
  TimeProfile p = profile::unmeasured(cfg, model, 1);
  rank0_first(ranks, "measuring the time profile", [&] {
    if (ranks == nullptr || ranks->rank() == 0) p = measure_time_profile(cfg, model, data);
  });
  profile::take_rank0s(ranks, p);
  return p;
}

TimeProfile probe_time_profile(const Config& cfg, at::Device device, at::ScalarType dtype,
                               const data::TokenDataset& data, dist::Comm* ranks) {
  const auto measure = [&](int64_t layers, bool links) {
    Config probe = cfg;
    probe.model.n_layer = layers;
    probe.parallel.pp = 1;
    probe.ac.stages = 1;
    // Under tensor parallelism the probe is split over this rank's group, as a stage is.
    Layout layout;
    layout.tp = cfg.parallel.tp;
    layout.sp = cfg.parallel.sp;
    auto model = Model::create(probe.model, device, dtype, static_cast<uint64_t>(cfg.run.seed), layout,
                               cfg.parallel.tp > 1 ? &ranks->tensor() : nullptr);
    // Every rank measures at once: the stages will share the host's cores and memory so.
    return profile_of(probe, *model, data, ranks, links);
  };
  // The links are measured (and cached) with the first probe alone.
  TimeProfile p = measure(std::min<int64_t>(cfg.model.n_layer, 2), cfg.parallel.tp > 1);
  if (cfg.model.n_layer < 2) return p;
  const TimeProfile one = measure(1, false);
  const double layer = p.base_seconds - one.base_seconds, ends = one.base_seconds - layer;
  // Noise can make a difference of small times meaningless: then the node times decide.
  if (layer > 0 && ends > 0) {
    p.times.layer_pass_seconds = layer;
    p.times.ends_pass_seconds = ends;
  }
  return p;
}

LinkRate measure_link_rate(dist::Comm& ranks, dist::Group& group, const std::string& links) {
  const int64_t t = group.size();
  const std::string what = "measuring " + links;
  // A small tensor's time is mostly latency, a large one's mostly bytes; both whole
  // tensors of `whole` bytes, each rank giving its 1/t.
  const auto time = [&](int64_t whole) {
    const at::Tensor share = at::zeros({1, whole / t}, at::kByte);
    std::vector<double> reps;
    for (int rep = 0; rep <= 5; ++rep) {
      ranks.barrier(what);
      const auto t0 = std::chrono::steady_clock::now();
      group.all_gather(share, 1, what);
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
    fit.latency_seconds = std::max(
        0.0, (small_s - part * static_cast<double>(small) / fit.bytes_per_second) / static_cast<double>(t - 1));
  } else {  // noise swamped the difference: all of the large one's time is bytes
    fit.bytes_per_second = part * static_cast<double>(large) / large_s;
  }
  // Rank 0's fit: every rank plans with the same numbers.
  fit.bytes_per_second = rank0s(ranks, fit.bytes_per_second, "sharing rank 0's measure of " + links);
  fit.latency_seconds = rank0s(ranks, fit.latency_seconds, "sharing rank 0's measure of " + links);
  return fit;
}

namespace {

// How much longer `dtype` matmuls take while a copy of `bytes` (taking `copy_seconds`)
// runs beside them, as a share of the copy's time (NodeTimes::host_copy_slowdown): the
// mean of a copy to host memory and one back, each beside matmuls that outlast it.
double measure_copy_slowdown(at::Device device, at::ScalarType dtype, int64_t bytes, double copy_seconds) {
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  const at::Tensor a = at::randn({4096, 4096}, opts), b = at::randn({4096, 4096}, opts);
  at::Tensor c = at::mm(a, b);
  const auto matmuls = [&](int n) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) at::mm_out(c, a, b);
    synchronize(device);
    return seconds_since(t0);
  };
  synchronize(device);
  const int n = std::max(1, static_cast<int>(std::ceil(2 * copy_seconds / (matmuls(8) / 8))));
  memory::HostPool pool;
  const at::Tensor source = at::zeros({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  memory::HostPool::Moved host = pool.to_host({source});  // fills the pool
  pool.await(host.ticket);
  synchronize(device);
  std::vector<double> alone, out, back;
  for (int rep = 0; rep < 5; ++rep) {
    alone.push_back(matmuls(n));
    const memory::HostPool::Moved to_host = pool.to_host({source});
    out.push_back(matmuls(n));
    pool.await(to_host.ticket);
    const memory::HostPool::Moved to_device = pool.to_device(host.tensors, device);
    back.push_back(matmuls(n));
    pool.await(to_device.ticket);
    synchronize(device);
  }
  const double base = median(alone);
  // Below 1, or compute beside a copy would never end; noise can make it lie outside.
  const auto slowdown = [&](const std::vector<double>& beside) {
    return std::clamp((median(beside) - base) / copy_seconds, 0.0, 0.9);
  };
  return (slowdown(out) + slowdown(back)) / 2;
}

}  // namespace

HostCopy measure_host_copy(at::Device device, at::ScalarType dtype) {
  // One round trip of `count` tensors of `bytes` each, the median of a few.
  const auto time = [&](int64_t bytes, int count) {
    memory::HostPool pool;
    std::vector<at::Tensor> tensors;
    for (int i = 0; i < count; ++i) {
      tensors.push_back(at::zeros({bytes}, at::TensorOptions().dtype(at::kByte).device(device)));
    }
    std::vector<double> reps;
    for (int rep = 0; rep <= 3; ++rep) {
      synchronize(device);
      const auto t0 = std::chrono::steady_clock::now();
      const memory::HostPool::Moved host = pool.to_host(tensors);
      pool.await(host.ticket);
      const memory::HostPool::Moved back = pool.to_device(host.tensors, device);
      pool.await(back.ticket);
      synchronize(device);
      if (rep > 0) reps.push_back(seconds_since(t0));  // rep 0 fills the pool
    }
    return median(reps);
  };
  const int64_t small = 4096, large = int64_t{64} << 20;
  const int count = 64;
  const double small_s = time(small, count), large_s = time(large, 1);
  // A round trip of n storages of B bytes in all: 2 x (n x latency + B / rate). The large
  // one is almost all bytes, the small ones almost all latency; one refinement separates them.
  const auto bytes = [](int64_t b) { return static_cast<double>(b); };
  HostCopy fit;
  fit.bytes_per_second = 2.0 * bytes(large) / large_s;
  fit.latency_seconds = std::max(0.0, (small_s - 2.0 * bytes(count * small) / fit.bytes_per_second) / (2.0 * count));
  if (large_s > 2.0 * fit.latency_seconds)
    fit.bytes_per_second = 2.0 * bytes(large) / (large_s - 2.0 * fit.latency_seconds);
  // The CPU's copies take the compute's cores and are priced whole (host_copies_overlap).
  if (device.is_cuda()) {
    const int64_t beside = int64_t{256} << 20;
    fit.compute_slowdown = measure_copy_slowdown(device, dtype, beside, bytes(beside) / fit.bytes_per_second);
    memory::release_cached(device);  // the measure's segments are not the run's to reserve
  }
  return fit;
}

Prices run_prices(const Config& cfg, at::Device device, at::ScalarType dtype, const data::TokenDataset& data,
                  dist::Comm* ranks, double matmul_rate, const std::function<std::unique_ptr<Model>()>& create,
                  std::unique_ptr<Model>& model) {
  const util::Phase phase("measuring the time profile");
  Prices prices;
  if (cfg.ac.profile && cfg.parallel.pp == 1) {
    model.reset();
    model = create();
    prices = rank_time_profile(cfg, *model, data, ranks);
  } else if (cfg.ac.profile) {
    prices = probe_time_profile(cfg, device, dtype, data, ranks);
  } else {
    // Rank 0's matmul rate, as a profile is rank 0's: ranks pricing by their own rates
    // could choose different plans (bytes weighed against FLOPs otherwise; a sum rounded
    // otherwise), whose collectives would never meet.
    const bool shared = ranks != nullptr && ranks->size() > 1;
    prices.times.flops_per_second = shared ? rank0s(*ranks, matmul_rate, "sharing rank 0's matmul rate") : matmul_rate;
  }
  // A profile of its own measured (and cached) the links with its times.
  if (cfg.parallel.tp > 1 && !cfg.ac.profile) {
    const LinkRate link = measure_link_rate(*ranks, ranks->tensor(), "the tensor-parallel links");
    prices.times.link_bytes_per_second = link.bytes_per_second;
    prices.times.link_latency_seconds = link.latency_seconds;
  }
  // Measured each run, not cached: the data-parallel group is not the profile's to time.
  if (ranks != nullptr && ranks->data().size() > 1) {
    const LinkRate link = measure_link_rate(*ranks, ranks->data(), "the data-parallel links");
    prices.times.data_link_bytes_per_second = link.bytes_per_second;
    prices.times.data_link_latency_seconds = link.latency_seconds;
  }
  return prices;
}

void add_host_copy(Prices& prices, at::Device device, at::ScalarType dtype, dist::Comm* ranks) {
  HostCopy copy = measure_host_copy(device, dtype);
  if (ranks != nullptr && ranks->size() > 1) {
    const char* what = "sharing rank 0's measure of host copies";
    copy.bytes_per_second = rank0s(*ranks, copy.bytes_per_second, what);
    copy.latency_seconds = rank0s(*ranks, copy.latency_seconds, what);
    copy.compute_slowdown = rank0s(*ranks, copy.compute_slowdown, what);
  }
  prices.times.host_bytes_per_second = copy.bytes_per_second;
  prices.times.host_copies_overlap = device.is_cuda();
  prices.times.host_copy_latency_seconds = copy.latency_seconds;
  prices.times.host_copy_slowdown = copy.compute_slowdown;
}

}  // namespace remat
