// Which GPU a rank binds and which library its collectives run on: decisions made from the
// launcher's environment and the identities the ranks exchange, before any group connects.
#include "remat/dist.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>

namespace remat::dist {

const char* backend_name(Backend b) { return b == Backend::nccl ? "NCCL" : "Gloo"; }

int bind_gpu(const LaunchEnv& env, std::optional<int> asked, int gpus) {
  if (gpus < 1) {
    throw std::invalid_argument(fmt::format(
        "Rank {} asks for a GPU (run.device = cuda), but CUDA shows this process none (CUDA_VISIBLE_DEVICES, the "
        "driver, or a LibTorch built without CUDA); set run.device = cpu, or start the ranks where GPUs are.",
        env.rank));
  }
  if (asked) {
    if (*asked >= gpus) {
      throw std::invalid_argument(fmt::format(
          "run.device = cuda:{} names no GPU rank {} sees: CUDA shows it {} (cuda:0 to cuda:{}); name one of them, "
          "or run.device = cuda to give each rank the GPU of its local rank.",
          *asked, env.rank, gpus, gpus - 1));
    }
    return *asked;
  }
  return env.local_rank % gpus;
}

std::string gpu_identity(const std::string& host, const char* visible_devices, int index) {
  std::string device = std::to_string(index);
  if (visible_devices != nullptr && *visible_devices != '\0') {
    std::istringstream list(visible_devices);
    std::string entry;
    for (int i = 0; std::getline(list, entry, ','); ++i) {
      if (i == index) device = entry;
    }
  }
  return host + " GPU " + device;
}

Backend choose_backend(CommBackend asked, const std::vector<std::string>& gpus, const NcclSupport& nccl) {
  const bool cpu = std::all_of(gpus.begin(), gpus.end(), [](const std::string& g) { return g.empty(); });
  if (cpu) {
    if (asked == CommBackend::nccl) {
      throw std::invalid_argument(
          "parallel.backend = nccl moves CUDA tensors only, but the ranks train on the CPU; set parallel.backend = "
          "auto or gloo, or run.device = cuda.");
    }
    return Backend::gloo;
  }
  // The ranks each GPU holds, to find the most crowded.
  std::map<std::string, std::vector<int>> held;
  for (size_t r = 0; r < gpus.size(); ++r) held[gpus[r]].push_back(static_cast<int>(r));
  const auto crowded = std::max_element(held.begin(), held.end(),
                                        [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
  const size_t most = crowded->second.size();
  const bool has_nccl = nccl.major > 0;
  const size_t nccl_allows = nccl.multi_rank ? 2 : 1;
  if (asked == CommBackend::gloo) return Backend::gloo;
  if (asked == CommBackend::automatic) return has_nccl && most <= nccl_allows ? Backend::nccl : Backend::gloo;
  if (!has_nccl) {
    throw std::invalid_argument(
        "parallel.backend = nccl, but this build of remat has no NCCL (its LibTorch was built without it, or "
        "nccl.h was not found when remat was built); set parallel.backend = gloo or auto, which run CUDA ranks over "
        "Gloo.");
  }
  if (most > nccl_allows) {
    throw std::invalid_argument(fmt::format(
        "Ranks {} share {}, but NCCL {}.{} {}; start one rank per GPU, or set parallel.backend = gloo (or auto), "
        "which lets ranks share a GPU through the host.",
        fmt::join(crowded->second, ", "), crowded->first, nccl.major, nccl.minor,
        nccl.multi_rank ? "lets at most two ranks share a GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)"
        : nccl.major > 2 || (nccl.major == 2 && nccl.minor >= 30)
            ? "refuses two ranks on one GPU unless NCCL_MULTI_RANK_GPU_ENABLE=1 allows two"
            : "refuses two ranks on one GPU (2.30 and later allow two with NCCL_MULTI_RANK_GPU_ENABLE=1)"));
  }
  return Backend::nccl;
}

}  // namespace remat::dist
