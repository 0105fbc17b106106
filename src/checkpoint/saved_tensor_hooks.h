// Default saved-tensor hooks from C++. While a HookScope is open on a thread, every
// tensor autograd saves for backward on that thread gets its SavedVariableHooks from the
// scope's factory (innermost scope wins) instead of being stored in the graph.
//
// LibTorch asks for default hooks through the process's default autograd engine
// (SavedVariable's constructor calls Engine::get_default_engine()
// .get_default_saved_variable_hooks(); the base engine returns none, and only PyTorch's
// Python engine overrides it, for Python hooks). remat therefore installs an engine
// subclass that overrides that one method, with torch::autograd::set_default_engine_stub.
#pragma once

#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <memory>

namespace remat::detail {

class HookFactory {
 public:
  virtual ~HookFactory() = default;
  /// Called once per saved tensor, on the thread that saves it.
  virtual std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() = 0;
};

/// Makes remat's engine the default engine if LibTorch's base engine is; no-op if it
/// already is. Throws if some other engine is the default.
void ensure_hook_engine();

/// Routes this thread's saved tensors to `factory` until destroyed (RAII, nestable).
class HookScope {
 public:
  explicit HookScope(HookFactory& factory);
  ~HookScope();
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;
};

}  // namespace remat::detail
