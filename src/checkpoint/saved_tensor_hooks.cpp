#include "checkpoint/saved_tensor_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <vector>

namespace remat::detail {
namespace {

// A stack, not a single slot: a checkpoint inside a checkpoint's fn opens its own scope,
// and a recompute in backward opens one while the forward's scopes are long closed.
thread_local std::vector<HookFactory*> t_scopes;

// LibTorch's engine, unchanged, except that it hands out the open scope's hooks.
class HookEngine final : public torch::autograd::Engine {
 public:
  HookEngine() = default;
  // Engine's contract for subclasses: stop the worker threads before the vtable goes.
  ~HookEngine() override { stop(); }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (t_scopes.empty()) {
      return nullptr;
    }
    return t_scopes.back()->make_hooks();
  }
};

torch::autograd::Engine& hook_engine() {
  static HookEngine engine;
  return engine;
}

}  // namespace

void ensure_hook_engine() {
  using torch::autograd::Engine;
  Engine& current = Engine::get_default_engine();
  if (&current == &hook_engine()) {
    return;
  }
  TORCH_CHECK(&current == &Engine::get_base_engine(),
              "remat::checkpoint: use_reentrant=false needs remat's autograd engine (LibTorch's "
              "engine plus default saved-tensor hooks) as the process's default engine, but "
              "another engine is the default already (PyTorch's Python engine, when LibTorch runs "
              "inside Python). Use use_reentrant=true in this process.");
  torch::autograd::set_default_engine_stub(&hook_engine);
}

HookScope::HookScope(HookFactory& factory) { t_scopes.push_back(&factory); }

HookScope::~HookScope() { t_scopes.pop_back(); }

}  // namespace remat::detail
