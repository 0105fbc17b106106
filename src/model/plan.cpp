#include "remat/plan.h"

namespace remat {

const std::vector<std::string>& block_slots() {
  static const std::vector<std::string> slots = {
      "attn.norm", "attn.qkv_in", "attn.qkv",  "attn.probs", "attn.dropout", "attn.proj_in",
      "attn.resid", "mlp.norm",   "mlp.fc_in", "mlp.act_in", "mlp.proj_in",  "mlp.resid"};
  return slots;
}

const std::vector<std::pair<std::string, std::vector<std::string>>>& block_modules() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> modules = {
      {"core_attn", {"attn.probs", "attn.dropout"}},
      {"qkv", {"attn.qkv"}},
      {"norm", {"attn.norm", "attn.qkv_in", "mlp.fc_in"}},
      {"attn", {"attn.norm", "attn.qkv_in", "attn.qkv", "attn.probs", "attn.dropout", "attn.proj_in", "attn.resid"}},
      {"act", {"mlp.proj_in"}},
      {"mlp", {"mlp.fc_in", "mlp.act_in", "mlp.proj_in", "mlp.resid"}},
  };
  return modules;
}

}  // namespace remat
