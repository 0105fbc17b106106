// What each attention op's kernels can run, in sentences that name the settings to change:
// apart from the kernels, so that a config is refused before anything is built (and the
// fuzz build's config harness links it without them).
#include "remat/ops/attention.h"

#include <fmt/format.h>

namespace remat::ops {

std::string attention_refusal(Attention a, double dropout, bool cuda, at::ScalarType dtype, int64_t head_dim) {
  if (a == Attention::tiled && cuda) {
    return "model.attention = tiled runs remat's own loops over tiles on the CPU, and run.device is CUDA; use "
           "model.attention = sdpa (ATen's flash kernel, bfloat16) or math there.";
  }
  if (a != Attention::sdpa) return "";
  if (!kSdpaBuilt) {
    return fmt::format(
        "model.attention = sdpa needs LibTorch 2.9 or later (ATen's fused attention, with grouped-query heads); this "
        "build has LibTorch {}.{}; use model.attention = math or tiled.",
        TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
  }
  if (cuda && dtype != at::kBFloat16 && dtype != at::kHalf) {
    return fmt::format(
        "model.attention = sdpa on CUDA runs ATen's flash kernel, which takes bfloat16 or float16, and run.dtype is "
        "{}; set run.dtype = bfloat16, or use model.attention = math or tiled.",
        dtype == at::kFloat ? "float32" : c10::toString(dtype));
  }
  if (cuda && head_dim % 8 != 0) {
    return fmt::format(
        "model.attention = sdpa on CUDA runs ATen's flash kernel, which takes heads of a multiple of 8 values, and "
        "model.d_model / model.n_head = {}; choose model.n_head so that it is, or use model.attention = math.",
        head_dim);
  }
  if (dropout > 0) {
    return fmt::format(
        "model.attention = sdpa cannot drop attention probabilities: ATen's fused attention draws its dropout mask "
        "inside the kernel (from the global generator, and not at all on the CPU), so a recompute could not draw "
        "the forward's mask again, and model.dropout = {} applies to them; set model.dropout = 0, or use "
        "model.attention = math or tiled (their masks are keyed, so a recompute is exact).",
        dropout);
  }
  return "";
}

}  // namespace remat::ops
