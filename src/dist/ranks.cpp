#include "dist/ranks.h"

#include "remat/memory.h"
#include "util/device.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>

namespace remat {

std::unique_ptr<dist::Comm> join_ranks(const Config& cfg, const std::string& subcommand) {
  const std::optional<dist::LaunchEnv> env = dist::launch_env();
  const int world = env ? env->world_size : 1;
  const int64_t tp = cfg.parallel.tp;
  const int64_t pp = cfg.parallel.pp;
  if ((cfg.parallel.dp > 0 && cfg.parallel.dp * tp * pp != world) || (!env && tp * pp > 1)) {
    const int64_t want = std::max<int64_t>(cfg.parallel.dp, 1) * tp * pp;
    throw std::invalid_argument(fmt::format(
        "parallel.dp = {} x parallel.tp = {}{} asks for {} ranks, but {}; start the run with `remat launch --nproc {} "
        "{} ...` (or torchrun --nproc_per_node {}), or set parallel.dp = 0 to use every rank started.",
        cfg.parallel.dp, tp, pp > 1 ? fmt::format(" x parallel.pp = {}", pp) : "", want,
        env ? fmt::format("the launcher started {}", world) : "this process runs alone", want, subcommand, want));
  }
  if (data_parallel_ranks(cfg) * tp * pp == 1) return nullptr;
  dist::RankDevice device{cfg.run.device, cfg.parallel.backend};
  if (cfg.run.device.is_cuda()) {
    const int gpus = at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
    const std::optional<int> asked =
        cfg.run.device.has_index() ? std::optional<int>(cfg.run.device.index()) : std::nullopt;
    device.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(dist::bind_gpu(*env, asked, gpus)));
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(std::llround(cfg.parallel.timeout * 1000)));
  return dist::Comm::connect(*env, timeout, static_cast<int>(tp), static_cast<int>(pp), device);
}

at::Device rank_device(const Config& cfg, const dist::Comm* ranks) {
  return ranks != nullptr ? ranks->device() : cfg.run.device;
}

int64_t data_parallel_ranks(const Config& cfg) {
  const std::optional<dist::LaunchEnv> env = dist::launch_env();
  // The ranks sharing one data-parallel replica: a tensor-parallel group per pipeline stage.
  const int64_t tp = cfg.parallel.tp * cfg.parallel.pp;
  if (env && env->world_size % tp != 0) {
    throw std::invalid_argument(fmt::format(
        "parallel.tp = {} x parallel.pp = {} ranks hold one copy of the model, so they must divide the {} ranks "
        "started; start a multiple of {} ranks.",
        cfg.parallel.tp, cfg.parallel.pp, env->world_size, tp));
  }
  const int64_t ranks = cfg.parallel.dp > 0 ? cfg.parallel.dp : env ? env->world_size / tp : 1;
  if (cfg.train.batch % ranks != 0) {
    throw std::invalid_argument(fmt::format(
        "train.batch = {} sequences cannot be split evenly over {} data-parallel ranks; make train.batch a multiple "
        "of {} (it counts the sequences of all ranks together).",
        cfg.train.batch, ranks, ranks));
  }
  return ranks;
}

Config rank_share(const Config& cfg) {
  Config local = cfg;
  local.parallel.dp = data_parallel_ranks(cfg);
  local.train.batch = cfg.train.batch / local.parallel.dp;
  return local;
}

std::string describe_ranks(const Config& local) {
  const ParallelConfig& p = local.parallel;
  std::string text;
  if (p.dp > 1) {
    text += fmt::format(", data parallel over {} ranks of {} sequences{}", p.dp, local.train.batch,
                        p.zero == 1   ? ", AdamW's moments sharded over them (parallel.zero = 1)"
                        : p.zero == 2 ? ", AdamW's moments and the gradients sharded over them (parallel.zero = 2)"
                        : p.zero == 3 ? ", AdamW's moments, the gradients and the weights sharded over them "
                                        "(parallel.zero = 3)"
                                      : "");
  }
  if (p.tp > 1) {
    text += fmt::format(", each layer split over {} tensor-parallel ranks{}", p.tp,
                        p.sp ? ", and the positions between them (parallel.sp)" : "");
  }
  if (p.pp > 1) {
    text += fmt::format(", the layers in {} pipeline stages ({} schedule)", p.pp, pipeline::schedule_name(p.schedule));
  }
  return text;
}

RankStep gather_step(dist::Comm* ranks, int64_t peak_bytes, int signal, int64_t step) {
  RankStep s{{peak_bytes}, signal};
  if (ranks == nullptr) return s;
  s.peaks.clear();
  for (const std::vector<int64_t>& peak_and_signal :
       ranks->all_gather({peak_bytes, signal}, fmt::format("gathering the peaks of step {}", step))) {
    s.peaks.push_back(peak_and_signal[0]);
    if (s.stop == 0) s.stop = static_cast<int>(peak_and_signal[1]);
  }
  return s;
}

int agreed_signal(dist::Group* group, int signal) {
  if (group == nullptr) return signal;
  std::vector<at::Tensor> flag{at::tensor({static_cast<int64_t>(signal)}, at::kLong)};
  group->all_reduce(flag, dist::Reduce::max, "agreeing whether a signal stops the sample");
  return static_cast<int>(flag[0].item<int64_t>());
}

void keep_highest(std::vector<int64_t>& highest, const std::vector<int64_t>& peaks) {
  highest.resize(std::max(highest.size(), peaks.size()));
  for (size_t i = 0; i < peaks.size(); ++i) highest[i] = std::max(highest[i], peaks[i]);
}

std::string format_rank_peaks(const std::vector<int64_t>& peaks, const std::vector<int64_t>& predicted) {
  TORCH_CHECK(!peaks.empty() && peaks.size() == predicted.size(), "[format_rank_peaks] ", peaks.size(),
              " peaks beside ", predicted.size(), " predictions");
  const bool alike = std::all_of(predicted.begin(), predicted.end(), [&](int64_t p) { return p == predicted[0]; });
  std::vector<std::string> each;
  for (size_t i = 0; i < peaks.size(); ++i) {
    each.push_back(alike ? fmt::format("rank {} {}", i, memory::format_bytes(peaks[i]))
                         : fmt::format("rank {} {} (predicted {})", i, memory::format_bytes(peaks[i]),
                                       memory::format_bytes(predicted[i])));
  }
  return alike ? fmt::format("{} (each predicted {})", fmt::join(each, ", "), memory::format_bytes(predicted[0]))
               : fmt::format("{}", fmt::join(each, ", "));
}

int64_t rank_threads(const Config& cfg) {
  const std::optional<dist::LaunchEnv> env = dist::launch_env();
  if (cfg.run.threads > 0 || !env || env->local_world_size <= 1) return cfg.run.threads;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / env->local_world_size);
}

int64_t rank_memory(at::Device device, dist::Comm* ranks) {
  int64_t available = memory_available(device);
  const std::optional<dist::LaunchEnv> env = dist::launch_env();
  if (available >= 0 && !device.is_cuda() && env) available /= std::max<int64_t>(1, env->local_world_size);
  if (available >= 0 && device.is_cuda() && ranks != nullptr) available /= ranks->device_sharers();
  if (ranks == nullptr || ranks->size() == 1) return available;
  const auto all = ranks->all_gather(std::vector<int64_t>{available}, "sharing the memory each rank has free");
  for (const auto& r : all) available = r[0] < 0 ? -1 : std::min(available, r[0]);
  return available;
}

void rank0_first(dist::Comm* comm, const std::string& what, const std::function<void()>& work) {
  if (comm == nullptr) {
    work();
    return;
  }
  const std::string key = "done/" + what;
  if (comm->rank() == 0) {
    try {
      work();
    } catch (const std::exception& e) {
      // Through the job's abort, which outlives this rank's exit until the others have
      // read it: a plain post could be gone with rank 0's store before they look.
      comm->abort(fmt::format("Rank 0 failed in {}: {}", what, e.what()));
      throw;
    }
    comm->post(key, "");
    return;
  }
  comm->await(key, what + " on rank 0");
  work();
}

}  // namespace remat
