// The canonical policy grammar (remat/policy.h's ac.policy) and the text rules the
// frameworks' aliases (aliases.h) share with it: private to src/policy.
#pragma once

#include "remat/plan.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace remat::policy {

/// Throws std::invalid_argument: every refusal of the policy is a sentence for the user.
[[noreturn]] void fail(const std::string& msg);

std::string join(const std::vector<std::string>& parts, const std::string& sep);
/// "a, b" (an override) or the comma-joined TOML array: the entries, spaces removed.
std::vector<std::string> split_list(const std::string& s);
/// The whole numbers of list key `key` ("4,4" or [4, 4]); refuses anything else naming it.
std::vector<int64_t> int_list(const std::string& key, const std::string& value);
/// "[4, 4]", as a message quotes a list.
std::string list_text(const std::vector<int64_t>& v);

/// How the layers are split across pipeline stages.
struct StageSplit {
  std::vector<int64_t> first;  ///< first layer of each stage
  std::vector<int64_t> size;   ///< layers of each stage
  int64_t smallest() const;
};

/// A per-layer slot choice of a selective policy (the layer index matters for matmul/2).
struct Selective {
  std::string canonical;
  std::function<SlotMask(int64_t)> dropped;
};

/// One spelling's policy text -> its plan for `n_layers` layers split as `split`; every
/// refusal names `origin` (e.g. `ac.policy = "every:0"`).
class Parser {
 public:
  Parser(std::string origin, int64_t n_layers, StageSplit split);

  /// The plan of a whole policy (recompute terms, then an optional offload term), with its
  /// canonical spelling in plan.policy.
  ActivationPlan parse(const std::string& raw);

  /// "offload:[...]" or "offload(S):[...]": each layer (each layer S selects) offloads the
  /// named slots (a module: its slots) that it keeps; a slot it recomputes is not kept, so
  /// not offloaded. Appends the canonical term to plan.policy.
  void offload(const std::string& term, ActivationPlan& plan) const;

 private:
  ActivationPlan recompute(const std::string& s);
  std::string model_size() const;
  int64_t count(const std::string& kind, const char* letter, const std::string& text, const std::string& meaning,
                const std::string& none = "use none to recompute nothing") const;
  std::optional<std::pair<std::string, std::vector<bool>>> select(const std::string& s,
                                                                  const std::string& verb = "recomputes") const;
  std::vector<std::string> names(const std::string& s, size_t prefix, const std::string& what,
                                 const std::vector<std::string>& valid) const;
  std::optional<Selective> selective(const std::string& s) const;
  ActivationPlan layers(const std::string& s) const;

  std::string origin_;
  int64_t n_;
  StageSplit split_;
};

/// Compiles one spelling's policy text, naming `origin` in its refusals: the step each
/// framework's aliases (aliases.h) end in.
using Compile = std::function<ActivationPlan(const std::string& policy, const std::string& origin)>;

}  // namespace remat::policy
