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

SlotMask SlotMask::droppable() {
  SlotMask m;
  for (int s = 1; s < kSlotCount; ++s) m.add(static_cast<Slot>(s));
  return m;
}

SlotMask SlotMask::of_names(const std::vector<std::string>& names) {
  SlotMask m;
  for (const std::string& name : names) {
    const Slot s = slot_of_name(name);
    if (s == Slot::input) {
      throw std::invalid_argument(
          fmt::format("'{}' is not a slot of a block; the slots are {}.", name, fmt::join(block_slots(), ", ")));
    }
    m.add(s);
  }
  return m;
}

std::vector<Slot> SlotMask::slots() const {
  std::vector<Slot> out;
  for (int s = 0; s < kSlotCount; ++s) {
    if (has(static_cast<Slot>(s))) out.push_back(static_cast<Slot>(s));
  }
  return out;
}

std::vector<std::string> SlotMask::names() const {
  std::vector<std::string> out;
  for (Slot s : slots()) out.push_back(slot_name(s));
  return out;
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

int64_t ActivationPlan::chunk_of(int64_t l) const {
  const auto n = static_cast<int64_t>(layers.size());
  if (layers.at(static_cast<size_t>(l)).chunk_begin >= 0) return layers[static_cast<size_t>(l)].chunk_begin;
  return l + 1 < n && layers[static_cast<size_t>(l + 1)].chunk_begin == l ? l : -1;
}

int64_t ActivationPlan::chunk_end(int64_t first) const {
  int64_t end = first;
  while (end + 1 < static_cast<int64_t>(layers.size()) && layers[static_cast<size_t>(end + 1)].chunk_begin == first) {
    ++end;
  }
  return end;
}

bool ActivationPlan::may_prefetch(int64_t l, int64_t end) const {
  return !layers.at(static_cast<size_t>(l)).offloaded.empty() && l + 1 < end && chunk_of(l) < 0 && chunk_of(l + 1) < 0;
}

}  // namespace remat
