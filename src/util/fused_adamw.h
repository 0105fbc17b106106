// Whether this LibTorch has ATen's fused AdamW kernel on every device (2.4 added the CPU
// one): the optimizer runs it, and the cost model counts its temporaries (none) by it.
#pragma once

#include <torch/version.h>

namespace remat::util {

#define REMAT_FUSED_ADAMW (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
inline constexpr bool kFusedAdamW = REMAT_FUSED_ADAMW;

}  // namespace remat::util
