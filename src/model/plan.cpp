#include "remat/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace remat {

const std::vector<std::string>& block_slots() {
  static const std::vector<std::string> slots = {
      "attn.norm",  "attn.qkv_in", "attn.gathered", "attn.qkv",     "attn.probs", "attn.dropout", "attn.proj_in",
      "attn.resid", "mlp.norm",    "mlp.fc_in",     "mlp.gathered", "mlp.act_in", "mlp.proj_in",  "mlp.resid"};
  return slots;
}

const std::string& slot_name(Slot s) {
  static const std::string input = "input";
  return s == Slot::input ? input : block_slots().at(static_cast<size_t>(s) - 1);
}

Slot slot_of_name(const std::string& name) {
  if (name == slot_name(Slot::input)) return Slot::input;
  const auto& names = block_slots();
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<Slot>(i + 1);
  }
  throw std::invalid_argument(
      fmt::format("'{}' is not a slot of a block; the slots are {}.", name, fmt::join(names, ", ")));
}

const std::vector<std::pair<std::string, std::vector<std::string>>>& block_modules() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> modules = {
      {"core_attn", {"attn.probs", "attn.dropout"}},
      {"qkv", {"attn.qkv"}},
      {"norm", {"attn.norm", "attn.qkv_in", "attn.gathered", "mlp.fc_in", "mlp.gathered"}},
      {"attn",
       {"attn.norm", "attn.qkv_in", "attn.gathered", "attn.qkv", "attn.probs", "attn.dropout", "attn.proj_in",
        "attn.resid"}},
      {"act", {"mlp.proj_in"}},
      {"mlp", {"mlp.fc_in", "mlp.gathered", "mlp.act_in", "mlp.proj_in", "mlp.resid"}},
      {"gathered", {"attn.gathered", "mlp.gathered"}},
  };
  return modules;
}

}  // namespace remat
