#include "remat/checkpoint.h"

#include "checkpoint/rng_state.h"
#include "checkpoint/saved_tensor_hooks.h"
#include "checkpoint/tensor_record.h"

#include <c10/core/GradMode.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <optional>
#include <utility>

namespace remat {
namespace {

using detail::RngFork;
using detail::RngStates;
using detail::TensorRecord;
using torch::autograd::SavedVariable;
using torch::autograd::SavedVariableHooks;
using torch::autograd::variable_list;

std::string label(const CheckpointOptions& o) {
  return o.name.empty() ? std::string("remat::checkpoint") : "remat::checkpoint '" + o.name + "'";
}

void check_not_double_backward(const CheckpointOptions& o) {
  // The engine runs a backward with grad mode on exactly when create_graph=true.
  TORCH_CHECK(!c10::GradMode::is_enabled(), label(o),
              ": double backward through a checkpoint is not supported: backward ran with "
              "create_graph=true, and the activations a checkpoint recomputes in backward are not "
              "recorded for a second differentiation. Leave this region un-checkpointed to take "
              "higher-order gradients.");
}

// The recompute's outputs against the forward pass's: count and shapes always (reentrant
// mode maps grad_outputs onto them), dtype/device and bytes as o.determinism_check asks.
void check_outputs(const CheckpointOptions& o, const std::vector<TensorRecord>& forward,
                   const std::vector<at::Tensor>& recomputed) {
  TORCH_CHECK(recomputed.size() == forward.size(), label(o), ": fn returned ", recomputed.size(),
              " outputs on recompute but ", forward.size(),
              " in the forward pass; fn must return the same outputs every time it runs.");
  const bool values = o.determinism_check == DeterminismCheck::values;
  for (const auto i : c10::irange(forward.size())) {
    const TensorRecord now = TensorRecord::of(recomputed[i], values);
    const bool meta_ok =
        o.determinism_check == DeterminismCheck::none ? now.same_shape(forward[i]) : now.same_meta(forward[i]);
    TORCH_CHECK(meta_ok, label(o), ": output ", i, " is ", now.describe(), " on recompute but was ",
                forward[i].describe(), " in the forward pass; fn must return the same outputs every time it runs.");
    TORCH_CHECK(!values || now.hash == forward[i].hash, label(o), ": output ", i, " (", now.describe(),
                ") has different values on recompute (determinism_check=values): fn is not "
                "deterministic. It may draw from a random generator that preserve_rng_state does "
                "not restore, or read state that changed since the forward pass.");
  }
}

// Detached copies for a recompute, requiring grad as the originals did, so that fn saves
// exactly the tensors it saved in the forward pass and the recomputed graph stays apart
// from the outer one.
std::vector<at::Tensor> recompute_inputs(const variable_list& originals) {
  std::vector<at::Tensor> args;
  args.reserve(originals.size());
  for (const at::Tensor& x : originals) {
    args.push_back(x.defined() ? x.detach().requires_grad_(x.requires_grad()) : x);
  }
  return args;
}

// ---------------------------------------------------------------------------------------
// Non-reentrant

// Thrown by the recompute's hook when the last tensor needed has been saved; it unwinds fn
// (and any scopes or generator forks it opened) back to Frame::recompute.
struct RecomputeComplete {};

// Collects what fn saves while it is being recomputed.
struct Recompute {
  size_t expected = 0;
  bool early_stop = true;
  std::vector<at::Tensor> tensors;
  size_t extra = 0;  // saves beyond `expected` (fn ran to its end, with early_stop off)
};

class Collector final : public SavedVariableHooks {
 public:
  explicit Collector(Recompute& r) : r_(r) {}

  void call_pack_hook(const at::Tensor& t) override {
    if (r_.tensors.size() < r_.expected) {
      // Detached: the recomputed graph is thrown away, and an output saved by its own
      // grad_fn would otherwise keep that graph alive.
      r_.tensors.push_back(t.detach());
    } else {
      ++r_.extra;
    }
    if (r_.early_stop && r_.tensors.size() == r_.expected) {
      throw RecomputeComplete{};
    }
  }

  at::Tensor call_unpack_hook() override {
    TORCH_INTERNAL_ASSERT(false, "a tensor saved while recomputing a checkpoint was unpacked");
  }

 private:
  // Only used in call_pack_hook, which runs while the Recompute is alive; the hook object
  // itself may outlive it inside a graph that fn leaked.
  Recompute& r_;
};

class CollectorFactory final : public detail::HookFactory {
 public:
  explicit CollectorFactory(Recompute& r) : r_(r) {}
  std::unique_ptr<SavedVariableHooks> make_hooks() override { return std::make_unique<Collector>(r_); }

 private:
  Recompute& r_;
};

// One non-reentrant checkpoint call: what its recompute needs, shared by the placeholders
// that replaced its saved tensors; it dies with the last of them.
class Frame : public std::enable_shared_from_this<Frame> {
 public:
  Frame(CheckpointFn fn, CheckpointOptions options, const std::vector<at::Tensor>& inputs)
      : fn_(std::move(fn)), options_(std::move(options)) {
    // Saved as autograd saves them, so an enclosing checkpoint replaces them by its own
    // placeholders (a nested checkpoint then keeps only the outermost inputs), and an
    // input modified in place before backward is reported by LibTorch's version check.
    inputs_.reserve(inputs.size());
    for (const at::Tensor& x : inputs) {
      // SavedVariable holds a leaf's gradient accumulator weakly, counting on the graph
      // node that used the leaf to hold it; these inputs are saved before anything used
      // them, so the frame holds it, as that node would.
      if (x.defined() && x.requires_grad() && x.is_leaf()) {
        accumulators_.push_back(torch::autograd::impl::grad_accumulator(x));
      }
      inputs_.emplace_back(x, /*is_output=*/false);
    }
    if (options_.preserve_rng_state) {
      rng_ = RngStates::capture(inputs);
    }
  }

  std::vector<at::Tensor> run_forward(const std::vector<at::Tensor>& inputs);

  // Pack hook of a placeholder: records the tensor's metadata, not the tensor.
  size_t record_saved(const at::Tensor& t) {
    if (options_.determinism_check != DeterminismCheck::none) {
      saved_.push_back(TensorRecord::of(t, options_.determinism_check == DeterminismCheck::values));
    }
    return num_saved_++;
  }

  at::Tensor unpack(size_t index) {
    check_not_double_backward(options_);
    // Engine threads of several devices may unpack this frame's tensors concurrently.
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(forward_done_, label(options_),
                ": a backward inside fn needed a tensor saved inside the same checkpoint before "
                "fn returned (e.g. torch::autograd::grad called within the checkpointed region); "
                "a checkpoint cannot recompute a region that is still running. Take such "
                "gradients outside the region, or do not checkpoint it.");
    if (!recomputed_[index].defined()) {
      recompute();
    }
    // Handed over, not kept: backward frees it as soon as the node that saved it has run.
    // A second backward through a retained graph finds the slot empty and recomputes.
    at::Tensor t = std::move(recomputed_[index]);
    recomputed_[index].reset();
    return t;
  }

 private:
  void recompute();
  void check_saved(const Recompute& r) const;

  CheckpointFn fn_;
  CheckpointOptions options_;
  // Whatever owning pointer LibTorch hands out: std::shared_ptr<Node> up to 2.x's early
  // releases, c10::intrusive_ptr<Node> in current ones (2.14).
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()))> accumulators_;
  std::vector<SavedVariable> inputs_;
  std::optional<RngStates> rng_;
  size_t num_saved_ = 0;
  std::vector<TensorRecord> saved_;    // per saved tensor, unless determinism_check=none
  std::vector<TensorRecord> outputs_;  // shapes of fn's outputs in the forward pass
  std::mutex mutex_;
  bool forward_done_ = false;
  std::vector<at::Tensor> recomputed_;  // slot i: saved tensor i, between recompute and unpack
};

class Placeholder final : public SavedVariableHooks {
 public:
  explicit Placeholder(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  void call_pack_hook(const at::Tensor& t) override { index_ = frame_->record_saved(t); }
  at::Tensor call_unpack_hook() override { return frame_->unpack(index_); }

 private:
  std::shared_ptr<Frame> frame_;
  size_t index_ = 0;
};

class PlaceholderFactory final : public detail::HookFactory {
 public:
  explicit PlaceholderFactory(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  std::unique_ptr<SavedVariableHooks> make_hooks() override { return std::make_unique<Placeholder>(frame_); }

 private:
  std::shared_ptr<Frame> frame_;
};

std::vector<at::Tensor> Frame::run_forward(const std::vector<at::Tensor>& inputs) {
  PlaceholderFactory factory(shared_from_this());
  std::vector<at::Tensor> outputs;
  {
    detail::HookScope scope(factory);
    outputs = fn_(inputs);
  }
  recomputed_.resize(num_saved_);
  forward_done_ = true;
  for (const at::Tensor& o : outputs) {
    outputs_.push_back(TensorRecord::of(o, /*with_hash=*/false));
  }
  return outputs;
}

void Frame::recompute() {
  // Unpacked before grad mode is turned on: an enclosing checkpoint's placeholder may
  // recompute that checkpoint here, and must see the backward's grad mode.
  variable_list originals;
  originals.reserve(inputs_.size());
  for (const SavedVariable& sv : inputs_) {
    originals.push_back(sv.unpack());
  }
  const std::vector<at::Tensor> args = recompute_inputs(originals);
  originals.clear();

  Recompute r;
  r.expected = num_saved_;
  r.early_stop = options_.early_stop;
  std::vector<at::Tensor> outputs;
  bool ran_to_end = false;
  {
    std::optional<RngFork> fork;
    if (rng_) {
      fork.emplace(*rng_);
    }
    c10::AutoGradMode grad_on(true);
    CollectorFactory factory(r);
    detail::HookScope scope(factory);
    try {
      outputs = fn_(args);
      ran_to_end = true;
    } catch (const RecomputeComplete&) {
    }
  }
  check_saved(r);
  if (ran_to_end) {
    CheckpointOptions shapes_only = options_;
    shapes_only.determinism_check = DeterminismCheck::none;
    check_outputs(shapes_only, outputs_, outputs);
  }
  recomputed_ = std::move(r.tensors);
}

void Frame::check_saved(const Recompute& r) const {
  const size_t got = r.tensors.size() + r.extra;
  TORCH_CHECK(got == num_saved_, label(options_), ": the forward pass saved ", num_saved_,
              " tensors for backward but the recompute saved ", got,
              "; fn must run the same operations when it is re-run in backward, and it took "
              "another path (data-dependent control flow, or state that changed since the "
              "forward pass).");
  if (options_.determinism_check == DeterminismCheck::none) {
    return;
  }
  const bool values = options_.determinism_check == DeterminismCheck::values;
  for (const auto i : c10::irange(num_saved_)) {
    const TensorRecord now = TensorRecord::of(r.tensors[i], values);
    TORCH_CHECK(now.same_meta(saved_[i]), label(options_), ": saved tensor ", i, " of ", num_saved_, " is ",
                now.describe(), " on recompute but was ", saved_[i].describe(),
                " in the forward pass (determinism_check=meta); fn took another path on "
                "recompute.");
    TORCH_CHECK(!values || now.hash == saved_[i].hash, label(options_), ": saved tensor ", i, " of ", num_saved_, " (",
                now.describe(),
                ") has different values on recompute (determinism_check=values): fn is not "
                "deterministic. It may draw from a random generator that preserve_rng_state does "
                "not restore, or read state that changed since the forward pass.");
  }
}

std::vector<at::Tensor> checkpoint_non_reentrant(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                                 const CheckpointOptions& options) {
  detail::ensure_hook_engine();
  auto frame = std::make_shared<Frame>(std::move(fn), options, inputs);
  return frame->run_forward(inputs);
}

// ---------------------------------------------------------------------------------------
// Reentrant

// ctx->saved_data holds IValues; a capsule is how a C++ object rides in one.
struct ReentrantState : torch::CustomClassHolder {
  CheckpointFn fn;
  CheckpointOptions options;
  std::optional<RngStates> rng;
  std::vector<TensorRecord> outputs;
};

struct ReentrantCheckpoint : public torch::autograd::Function<ReentrantCheckpoint> {
  // Function::apply runs this with grad mode off, so fn records nothing.
  static variable_list forward(torch::autograd::AutogradContext* ctx, const c10::intrusive_ptr<ReentrantState>& state,
                               at::TensorList inputs) {
    if (state->options.preserve_rng_state) {
      state->rng = RngStates::capture(inputs);
    }
    const std::vector<at::Tensor> args(inputs.begin(), inputs.end());
    variable_list outputs = state->fn(args);
    const bool values = state->options.determinism_check == DeterminismCheck::values;
    for (const at::Tensor& o : outputs) {
      state->outputs.push_back(TensorRecord::of(o, values));
    }
    ctx->save_for_backward(args);
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return outputs;
  }

  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grad_outputs) {
    const auto state = c10::static_intrusive_pointer_cast<ReentrantState>(ctx->saved_data["state"].toCapsule());
    const CheckpointOptions& o = state->options;
    check_not_double_backward(o);
    // False inside torch::autograd::grad and backward(inputs=...): those collect gradients
    // only at the requested tensors, and the nested backward below writes .grad instead.
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(), label(o),
                ": use_reentrant=true does not work with torch::autograd::grad or with backward "
                "given `inputs`: its backward runs a nested backward that accumulates parameter "
                "gradients into .grad, which those calls never read. Use use_reentrant=false, or "
                "call backward() without `inputs`.");

    const std::vector<at::Tensor> args = recompute_inputs(ctx->get_saved_variables());
    variable_list outputs;
    {
      std::optional<RngFork> fork;
      if (state->rng) {
        fork.emplace(*state->rng);
      }
      c10::AutoGradMode grad_on(true);
      outputs = state->fn(args);
    }
    check_outputs(o, state->outputs, outputs);

    variable_list roots;
    variable_list grads;
    for (const auto i : c10::irange(outputs.size())) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) {
      torch::autograd::backward(roots, grads);
    }
    variable_list result;
    result.reserve(args.size() + 1);
    result.emplace_back();  // the state argument
    for (const at::Tensor& a : args) {
      result.push_back(a.defined() && a.requires_grad() ? a.grad() : at::Tensor());
    }
    return result;
  }
};

std::vector<at::Tensor> checkpoint_reentrant(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                             const CheckpointOptions& options) {
  bool any_requires_grad = false;
  for (const at::Tensor& x : inputs) {
    any_requires_grad = any_requires_grad || (x.defined() && x.requires_grad());
  }
  TORCH_CHECK(any_requires_grad, label(options),
              ": use_reentrant=true needs at least one input that requires grad. A reentrant "
              "checkpoint is reached in backward only through its inputs, so the parameters used "
              "inside fn would silently get no gradient. Use use_reentrant=false (the default), "
              "which works when only parameters require grad.");
  auto state = c10::make_intrusive<ReentrantState>();
  state->fn = std::move(fn);
  state->options = options;
  return ReentrantCheckpoint::apply(state, at::TensorList(inputs));
}

}  // namespace

std::vector<at::Tensor> checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  TORCH_CHECK(fn, label(options), ": fn is empty.");
  if (!c10::GradMode::is_enabled()) {
    return fn(inputs);
  }
  return options.use_reentrant ? checkpoint_reentrant(std::move(fn), inputs, options)
                               : checkpoint_non_reentrant(std::move(fn), inputs, options);
}

at::Tensor checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& input,
                      const CheckpointOptions& options) {
  TORCH_CHECK(fn, label(options), ": fn is empty.");
  auto wrapped = [fn = std::move(fn)](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; };
  return checkpoint(std::move(wrapped), {input}, options)[0];
}

void install_checkpoint_engine() { detail::ensure_hook_engine(); }

}  // namespace remat
