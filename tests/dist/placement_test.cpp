// Which GPU each rank binds and which backend the ranks agree on, from the launcher's
// variables and CUDA_VISIBLE_DEVICES, and the sentences for layouts that cannot run.
#include "remat/config.h"
#include "remat/dist.h"
#include "util/error_of.h"
#include "util/gloo_ranks.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace remat {
namespace {

using dist::Backend;

std::string error_of(const std::function<void()>& f) { return testing::error_of<std::invalid_argument>(f); }

dist::LaunchEnv local(int local_rank, int local_world) {
  dist::LaunchEnv env;
  env.rank = local_rank;
  env.world_size = local_world;
  env.local_rank = local_rank;
  env.local_world_size = local_world;
  return env;
}

// What each of `n` ranks on host "h" holds: its bound GPU's identity, as the ranks tell
// each other, with CUDA showing each `gpus` GPUs listed by `visible(rank)`.
std::vector<std::string> identities(int n, int gpus, const std::function<const char*(int)>& visible,
                                    std::optional<int> asked = std::nullopt) {
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.push_back(dist::gpu_identity("h", visible(r), dist::bind_gpu(local(r, n), asked, gpus)));
  return out;
}

const dist::NcclSupport kNccl222{2, 22, false};
const dist::NcclSupport kNccl230{2, 30, false};
const dist::NcclSupport kNccl230Multi{2, 30, true};
const dist::NcclSupport kNoNccl{};

TEST(Placement, EachRankBindsTheGpuOfItsLocalRankOrTheOneRunDeviceNames) {
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(dist::bind_gpu(local(r, 4), std::nullopt, 8), r);
    EXPECT_EQ(dist::bind_gpu(local(r, 4), std::nullopt, 4), r);
    EXPECT_EQ(dist::bind_gpu(local(r, 4), std::nullopt, 2), r % 2) << "four ranks share two GPUs evenly";
    EXPECT_EQ(dist::bind_gpu(local(r, 4), std::nullopt, 1), 0) << "a rank shown one GPU binds it";
    EXPECT_EQ(dist::bind_gpu(local(r, 4), 1, 2), 1) << "run.device = cuda:1 puts every rank there";
  }
  EXPECT_EQ(error_of([] { dist::bind_gpu(local(1, 2), std::nullopt, 0); }),
            "Rank 1 asks for a GPU (run.device = cuda), but CUDA shows this process none (CUDA_VISIBLE_DEVICES, the "
            "driver, or a LibTorch built without CUDA); set run.device = cpu, or start the ranks where GPUs are.");
  EXPECT_EQ(error_of([] { dist::bind_gpu(local(0, 2), 3, 2); }),
            "run.device = cuda:3 names no GPU rank 0 sees: CUDA shows it 2 (cuda:0 to cuda:1); name one of them, or "
            "run.device = cuda to give each rank the GPU of its local rank.");
}

TEST(Placement, AGpusIdentityIsTheDeviceCudaVisibleDevicesNames) {
  EXPECT_EQ(dist::gpu_identity("h", nullptr, 1), "h GPU 1");
  EXPECT_EQ(dist::gpu_identity("h", "", 1), "h GPU 1");
  EXPECT_EQ(dist::gpu_identity("h", "2,3", 1), "h GPU 3");
  EXPECT_EQ(dist::gpu_identity("h", "GPU-5f1c", 0), "h GPU GPU-5f1c");
  EXPECT_NE(dist::gpu_identity("h", nullptr, 0), dist::gpu_identity("g", nullptr, 0));
}

// torchrun leaves CUDA_VISIBLE_DEVICES alone, so each rank sees every GPU and binds its
// local rank's; Slurm's --gpus-per-task shows each rank its own one as index 0; ranks
// started on a one-GPU machine all see that GPU.
TEST(Placement, AutoTakesNcclForRanksOnTheirOwnGpusAndGlooForRanksSharingOne) {
  const auto all = [](int) { return "0,1,2,3"; };
  const auto own = [](int r) {
    static const char* const kOne[] = {"0", "1", "2", "3"};
    return kOne[r];
  };
  const auto none = [](int) { return static_cast<const char*>(nullptr); };
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(4, 4, all), kNccl222), Backend::nccl);
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(4, 1, own), kNccl222), Backend::nccl);
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(2, 1, none), kNccl222), Backend::gloo);
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(4, 2, none), kNccl222), Backend::gloo);
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(4, 4, all), kNoNccl), Backend::gloo);
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(2, 1, none), kNccl230), Backend::gloo);
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(2, 1, none), kNccl230Multi), Backend::nccl)
      << "NCCL's multi-rank mode lets two ranks share a GPU";
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, identities(3, 1, none), kNccl230Multi), Backend::gloo)
      << "but not three";
  EXPECT_EQ(dist::choose_backend(CommBackend::nccl, identities(4, 1, own), kNccl222), Backend::nccl);
  EXPECT_EQ(dist::choose_backend(CommBackend::gloo, identities(4, 4, all), kNccl222), Backend::gloo);
  const std::vector<std::string> cpu(3);
  EXPECT_EQ(dist::choose_backend(CommBackend::automatic, cpu, kNccl222), Backend::gloo);
  EXPECT_EQ(dist::choose_backend(CommBackend::gloo, cpu, kNoNccl), Backend::gloo);
}

TEST(Placement, RefusesWhatTheAskedBackendCannotRunInASentence) {
  const auto none = [](int) { return static_cast<const char*>(nullptr); };
  EXPECT_EQ(error_of([&] { dist::choose_backend(CommBackend::nccl, identities(4, 2, none), kNccl222); }),
            "Ranks 0, 2 share h GPU 0, but NCCL 2.22 refuses two ranks on one GPU (2.30 and later allow two with "
            "NCCL_MULTI_RANK_GPU_ENABLE=1); start one rank per GPU, or set parallel.backend = gloo (or auto), which "
            "lets ranks share a GPU through the host.");
  EXPECT_EQ(error_of([&] { dist::choose_backend(CommBackend::nccl, identities(2, 1, none), kNccl230); }),
            "Ranks 0, 1 share h GPU 0, but NCCL 2.30 refuses two ranks on one GPU unless "
            "NCCL_MULTI_RANK_GPU_ENABLE=1 allows two; start one rank per GPU, or set parallel.backend = gloo (or "
            "auto), which lets ranks share a GPU through the host.");
  EXPECT_EQ(error_of([&] { dist::choose_backend(CommBackend::nccl, identities(3, 1, none), kNccl230Multi); }),
            "Ranks 0, 1, 2 share h GPU 0, but NCCL 2.30 lets at most two ranks share a GPU "
            "(NCCL_MULTI_RANK_GPU_ENABLE=1); start one rank per GPU, or set parallel.backend = gloo (or auto), which "
            "lets ranks share a GPU through the host.");
  EXPECT_EQ(error_of([&] { dist::choose_backend(CommBackend::nccl, identities(2, 2, none), kNoNccl); }),
            "parallel.backend = nccl, but this build of remat has no NCCL (its LibTorch was built without it, or "
            "nccl.h was not found when remat was built); set parallel.backend = gloo or auto, which run CUDA ranks "
            "over Gloo.");
  EXPECT_EQ(error_of([&] { dist::choose_backend(CommBackend::nccl, std::vector<std::string>(2), kNccl222); }),
            "parallel.backend = nccl moves CUDA tensors only, but the ranks train on the CPU; set parallel.backend = "
            "auto or gloo, or run.device = cuda.");
}

TEST(Placement, AConfigAsksForABackendByName) {
  EXPECT_EQ(load_config("", {"parallel.backend=gloo"}).parallel.backend, CommBackend::gloo);
  EXPECT_EQ(load_config("", {}).parallel.backend, CommBackend::automatic);
  EXPECT_EQ(error_of([] { load_config("", {"parallel.backend=mpi"}); }),
            "parallel.backend must be auto (NCCL for ranks on distinct GPUs where this build has it, Gloo otherwise), "
            "nccl (CUDA ranks, one per GPU) or gloo (CPU ranks, or CUDA ranks through the host, several to a GPU if "
            "need be), got 'mpi'.");
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.backend=nccl", "run.device=cpu"});
            }),
            "parallel.backend = nccl moves CUDA tensors only, but run.device = cpu; CPU ranks talk over Gloo: set "
            "parallel.backend = auto or gloo, or run.device = cuda.");
}

// CPU ranks connect over Gloo whatever they ask but NCCL, which every rank refuses alike
// before any group connects (rank 0, which hosts the store, waits for the others to read).
TEST(Placement, CpuRanksJoinOverGlooAndRefuseNcclAlike) {
  testing::on_gloo_ranks(2, 1, [](dist::Comm& comm) {
    EXPECT_EQ(comm.backend(), Backend::gloo);
    EXPECT_EQ(comm.device(), at::Device(at::kCPU));
    EXPECT_EQ(comm.device_sharers(), 1);
  });
  const std::vector<std::string> errors =
      testing::gloo_rank_errors(2, 1, 1, std::chrono::seconds(30), [](dist::Comm&) {}, {at::kCPU, CommBackend::nccl});
  for (const std::string& e : errors) {
    EXPECT_EQ(e,
              "parallel.backend = nccl moves CUDA tensors only, but the ranks train on the CPU; set parallel.backend "
              "= auto or gloo, or run.device = cuda.");
  }
}

}  // namespace
}  // namespace remat
