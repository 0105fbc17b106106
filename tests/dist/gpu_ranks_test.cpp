// Ranks on a GPU: Gloo's collectives on CUDA tensors and its sends and receives through
// the host, for ranks sharing one GPU, and a NCCL group. They need a GPU (REMAT_WITH_CUDA
// builds); scripts/gpu-check.sh runs them where one is.
#include "remat/dist.h"
#include "util/gloo_ranks.h"

#include <gtest/gtest.h>

#include <chrono>

namespace remat {
namespace {

const char* const kNoGpu = "no GPU here; scripts/gpu-check.sh runs this where one is";

// Two ranks on GPU 0, as on a one-GPU machine: the values each collective and transfer
// brings are exact (small integers), on the device they were given on.
TEST(GpuRanks, OnAGpuGlooRanksSharingItReduceGatherAndSendCudaTensors) {
  if (!at::hasCUDA()) GTEST_SKIP() << kNoGpu;
  const at::Device gpu(at::kCUDA, 0);
  const std::vector<std::string> errors = testing::gloo_rank_errors(
      2, 1, 1, std::chrono::seconds(60),
      [&](dist::Comm& comm) {
        EXPECT_EQ(comm.backend(), dist::Backend::gloo);
        EXPECT_EQ(comm.device_sharers(), 2);
        const auto on_gpu = at::TensorOptions().device(gpu).dtype(at::kFloat);
        std::vector<at::Tensor> sum{at::full({5}, comm.rank() + 1.0, on_gpu)};
        comm.world().all_reduce(sum, dist::Reduce::sum, "the test's all-reduce");
        EXPECT_TRUE(sum[0].is_cuda());
        EXPECT_TRUE(at::equal(sum[0].cpu(), at::full({5}, 3.0)));
        std::vector<at::Tensor> flag{at::tensor({static_cast<int64_t>(comm.rank())}, at::kLong)};
        comm.world().all_reduce(flag, dist::Reduce::max, "the test's flag");
        EXPECT_EQ(flag[0].item<int64_t>(), 1);
        const at::Tensor gathered =
            comm.world().all_gather(at::full({2, 3}, comm.rank(), on_gpu), 0, "the test's all-gather");
        EXPECT_TRUE(gathered.is_cuda());
        EXPECT_TRUE(at::equal(gathered.cpu(), at::cat({at::zeros({2, 3}), at::ones({2, 3})})));
        const at::Tensor sent = at::arange(12, on_gpu).to(at::kBFloat16);
        if (comm.rank() == 0) {
          comm.world().send(sent, 1, 0, "the test's send")->wait();
        } else {
          at::Tensor got = at::empty_like(sent);
          comm.world().recv(got, 0, 0, "the test's receive")->wait();
          EXPECT_TRUE(got.is_cuda());
          EXPECT_TRUE(at::equal(got.cpu(), sent.cpu()));
        }
      },
      {gpu, CommBackend::gloo});
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// One rank over NCCL: its world is a NCCL group of one, whose collectives run NCCL's
// kernels and leave the values as they were, a CPU tensor's too (moved through the GPU).
TEST(GpuRanks, OnAGpuANcclGroupOfOneRankReducesCudaAndCpuTensors) {
  if (!at::hasCUDA()) GTEST_SKIP() << kNoGpu;
  if (dist::nccl_support().major == 0) GTEST_SKIP() << "this build has no NCCL";
  const at::Device gpu(at::kCUDA, 0);
  const std::vector<std::string> errors = testing::gloo_rank_errors(
      1, 1, 1, std::chrono::seconds(60),
      [&](dist::Comm& comm) {
        EXPECT_EQ(comm.backend(), dist::Backend::nccl);
        const at::Tensor values = at::arange(7, at::TensorOptions().dtype(at::kFloat)) - 3;
        std::vector<at::Tensor> both{values.to(gpu), values.clone()};
        comm.world().all_reduce(both, dist::Reduce::sum, "the test's all-reduce");
        EXPECT_TRUE(both[0].is_cuda());
        EXPECT_FALSE(both[1].is_cuda());
        EXPECT_TRUE(at::equal(both[0].cpu(), values));
        EXPECT_TRUE(at::equal(both[1], values));
        const at::Tensor gathered = comm.world().all_gather(values.to(gpu), 0, "the test's all-gather");
        EXPECT_TRUE(at::equal(gathered.cpu(), values));
      },
      {gpu, CommBackend::nccl});
  EXPECT_EQ(errors[0], "");
}

}  // namespace
}  // namespace remat
