// Independent references for the model tests: GPT-2 and Llama written with plain
// differentiable ATen ops and trained by LibTorch autograd.
#pragma once

#include "remat/config.h"
#include "remat/model.h"

#include <ATen/ATen.h>

#include <map>
#include <string>

namespace remat::testing {

/// Mean cross-entropy loss of the model described by `cfg`, computed from `params`
/// (Hugging Face names; internal [out, in] layouts) with autograd-differentiable ops.
/// Dropout masks are regenerated from the same counter keys the engine uses.
at::Tensor reference_loss(const ModelConfig& cfg, const std::map<std::string, at::Tensor>& params,
                          const at::Tensor& tokens, const at::Tensor& targets, const StepContext& ctx);

}  // namespace remat::testing
