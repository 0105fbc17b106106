// Activation checkpointing for any LibTorch C++ code: run a region without keeping the
// tensors autograd saves inside it, and regenerate them by re-running the region in
// backward. LibTorch's C++ frontend has nothing like Python's torch.utils.checkpoint;
// this is it, in two modes. docs/checkpoint.md has usage, limits and the differences
// from torch.utils.checkpoint.
//
// Non-reentrant (the default). While `fn` runs, every tensor that autograd saves for
// backward is replaced by a placeholder (a default saved-tensor hook). The first time
// backward unpacks one of them, `fn` is re-run once from the checkpoint's inputs; every
// tensor it saves is collected, and the re-run stops as soon as the last one needed
// exists (early stop). Each recomputed tensor is released as soon as backward has used
// it. The autograd graph is the graph `fn` built, so gradients are the un-checkpointed
// gradients, bitwise on CPU. Works when no input requires grad (parameters only), with
// torch::autograd::grad, with retain_graph (each backward recomputes) and nested.
//
// Reentrant. A torch::autograd::Function runs `fn` without grad in forward and keeps
// only the inputs; its backward re-runs `fn` with grad and calls backward on that
// recomputed graph from inside the outer backward. Parameter gradients are accumulated
// into `.grad` by that nested backward, which is why this mode refuses
// torch::autograd::grad (and backward with `inputs`), and refuses a call where no input
// requires grad (it would silently give parameters no gradient).
//
// In both modes, with grad mode off (NoGradGuard, InferenceMode) `fn` simply runs and
// nothing is kept, as in PyTorch.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace remat {

/// What a checkpoint verifies about what the recompute produced.
enum class DeterminismCheck {
  none,    ///< only what correctness needs: the number of saved tensors (and of outputs)
  meta,    ///< also each saved tensor's shape, dtype and device (the default)
  values,  ///< also a hash of each saved tensor's bytes, taken at forward (costs a read of
           ///< every saved tensor at forward and at recompute; for debugging)
};

struct CheckpointOptions {
  /// false: saved-tensor placeholders, recompute on first unpack (see the file comment).
  /// true: a torch::autograd::Function that re-runs `fn` and backwards through it.
  bool use_reentrant = false;
  /// Capture the CPU generator's state (and every CUDA generator's, when CUDA is
  /// available) before `fn` runs, and replay it for the recompute, so dropout draws the
  /// same mask bitwise. The generators are put back afterwards: the recompute does not
  /// disturb the random stream the rest of the program sees.
  bool preserve_rng_state = true;
  /// Non-reentrant: checked on every saved tensor. Reentrant: the forward pass saves no
  /// tensor inside `fn`, so the check applies to `fn`'s outputs instead.
  DeterminismCheck determinism_check = DeterminismCheck::meta;
  /// Non-reentrant only: stop re-running `fn` once every saved tensor it replaced has been
  /// regenerated. With false, `fn` runs to its end, and the recompute must also return the
  /// same number of outputs with the same shapes. Reentrant always runs `fn` to its end.
  bool early_stop = true;
  /// Names the checkpoint in every error it raises.
  std::string name;
};

/// The region to checkpoint: ordinary LibTorch autograd ops from tensors to tensors. It
/// is called once in forward and again (in backward) for each recompute, so it must be
/// deterministic given its inputs, the random generators (see preserve_rng_state) and
/// parameters that do not change in between; it must not modify its inputs in place.
/// Non-reentrant mode keeps `fn` until the graph is freed: capture what it uses by value.
using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs `fn(inputs)` as a checkpointed region and returns its outputs. The inputs are
/// kept (referenced, not copied) until backward has recomputed the region; nothing else
/// that `fn` computes is kept. Errors (all c10::Error, naming the checkpoint):
///  - a backward with create_graph=true reaches the checkpoint (double backward);
///  - the recompute saves a different number of tensors, returns a different number of
///    outputs or outputs of other shapes, or (per determinism_check) saved tensors of
///    other shapes/dtypes/values than the forward pass did;
///  - reentrant: no input requires grad, or torch::autograd::grad (or backward with
///    `inputs`) reaches the checkpoint;
///  - non-reentrant: the process's default autograd engine is not LibTorch's own (e.g.
///    LibTorch loaded inside Python), see install_checkpoint_engine(); or a backward run
///    inside `fn` needs a tensor saved by the same checkpoint before `fn` returned.
std::vector<at::Tensor> checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

/// One tensor in, one tensor out.
at::Tensor checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& input,
                      const CheckpointOptions& options = {});

/// Non-reentrant checkpoints need default saved-tensor hooks, which LibTorch asks of the
/// process's default autograd engine. The first non-reentrant checkpoint therefore makes
/// remat's engine (LibTorch's engine, unchanged, plus those hooks; outside a checkpoint
/// they return none) the default, through torch::autograd::set_default_engine_stub.
/// Calling this at start-up does it before any backward runs. Idempotent. Throws if
/// another engine than LibTorch's base engine is the default (PyTorch's Python engine).
void install_checkpoint_engine();

// ---------------------------------------------------------------------------------------
// Checkpointing a stack of modules by policy.

/// A run of consecutive modules [begin, end) (0-based indices into the container), either
/// checkpointed as one region or run plainly.
struct CheckpointSegment {
  size_t begin = 0;
  size_t end = 0;
  bool checkpointed = false;
};

/// Splits a stack of `num_modules` modules into segments by `policy`:
///  - `none`: one plain segment;
///  - `full`: every module is its own checkpoint;
///  - `every:K`: modules K, 2K, 3K, ... counted from 1 are checkpointed, one each, the
///    others run plainly; 1 <= K <= num_modules. The choice depends only on the module's
///    position (no counter that persists between calls);
///  - `uniform:N`: chunks of N consecutive modules, each checkpointed as one region (only
///    the chunk's input is kept); the last chunk may be shorter; 1 <= N <= num_modules.
/// Throws with a sentence saying what was wrong and what is valid.
std::vector<CheckpointSegment> plan_checkpoint_segments(const std::string& policy, size_t num_modules);

/// Runs a stack of modules with the segments a policy chose. It wraps calls, not modules:
/// it holds (shares) the user's container and calls its modules in order, checkpointing
/// each checkpointed segment; the user's module tree, its names, parameters and
/// train/eval state are left exactly as they were. Each checkpointed segment is named
/// "<options.name> modules[i]" or "... modules[i..j]" (0-based, inclusive) in errors.
class CheckpointedStack {
 public:
  /// Calls module i on the output of module i-1; one tensor flows through the stack.
  using Layer = std::function<at::Tensor(size_t index, const at::Tensor& x)>;

  /// Use apply_checkpointing() rather than this.
  CheckpointedStack(std::shared_ptr<torch::nn::Module> container, size_t num_modules, Layer layer,
                    std::vector<CheckpointSegment> segments, CheckpointOptions options);

  /// Runs the whole stack on `x`. Throws if the container's size changed since planning.
  at::Tensor forward(const at::Tensor& x) const;

  const std::vector<CheckpointSegment>& segments() const { return segments_; }

 private:
  std::shared_ptr<torch::nn::Module> container_;
  size_t num_modules_;
  Layer layer_;
  std::vector<CheckpointSegment> segments_;
  CheckpointOptions options_;
};

/// Checkpoints a Sequential by policy (see plan_checkpoint_segments). Every module must
/// take and return one tensor (Sequential's own forward requires the same).
CheckpointedStack apply_checkpointing(const torch::nn::Sequential& sequential, const std::string& policy,
                                      const CheckpointOptions& options = {});

/// How to call one module of a ModuleList (which has no forward of its own), e.g.
/// `[](torch::nn::Module& m, const at::Tensor& x) { return m.as<Block>()->forward(x); }`.
using ModuleCall = std::function<at::Tensor(torch::nn::Module& module, const at::Tensor& x)>;

/// Checkpoints a ModuleList by policy, calling each module through `call`.
CheckpointedStack apply_checkpointing(const torch::nn::ModuleList& list, const std::string& policy, ModuleCall call,
                                      const CheckpointOptions& options = {});

}  // namespace remat
