#include "policy/aliases.h"

#include "util/number.h"

#include <fmt/format.h>

#include <algorithm>

namespace remat::policy {
namespace {

std::string quoted(const std::optional<std::string>& v) { return "\"" + *v + "\""; }
// ac.ac_option as written: a number bare, a word quoted.
std::string option_text(const std::optional<std::string>& v) { return util::parse_int(*v) ? *v : quoted(v); }
std::string boolean(bool b) { return b ? "true" : "false"; }

// Megatron's --offload-modules names that have a remat counterpart, and the slots each
// moves: what its module saves for the backward (core attention: q, k, v and the softmax).
const std::vector<std::pair<std::string, SlotMask>>& megatron_offload_names() {
  static const std::vector<std::pair<std::string, SlotMask>> modules = {
      {"attn_norm", {Slot::input, Slot::attn_norm}},
      {"qkv_linear", {Slot::attn_qkv_in, Slot::attn_gathered}},
      {"core_attn", {Slot::attn_qkv, Slot::attn_probs, Slot::attn_dropout}},
      {"attn_proj", {Slot::attn_proj_in}},
      {"mlp_norm", {Slot::mlp_norm}},
      {"layer_input", {Slot::input}},
  };
  return modules;
}

// Every slot a layer keeps: torchtune's and TransformerEngine's whole-layer offload.
const char* const kEveryKeptSlot = ":[input,attn,mlp,mlp.norm]";

OffloadAsk offload_modules_alias(const std::string& value, const ActivationPlan& plan) {
  const std::string origin = "ac.offload_modules = \"" + value + "\"";
  std::vector<std::string> mapped;
  for (const auto& m : megatron_offload_names()) mapped.push_back(m.first);
  const auto names = split_list(value);
  if (names.empty()) {
    fail(
        fmt::format("ac.offload_modules is empty; list the modules whose saved inputs go to host memory ({}), "
                    "or drop it.",
                    join(mapped, ", ")));
  }
  SlotMask slots;
  for (const auto& n : names) {
    const auto m = std::find_if(megatron_offload_names().begin(), megatron_offload_names().end(),
                                [&](const auto& module) { return module.first == n; });
    if (m != megatron_offload_names().end()) {
      slots |= m->second;
      continue;
    }
    const bool moe = n == "expert_fc1" || n == "moe_act" || n == "fused_group_mlp";
    fail(fmt::format("{}: {}; the names that map are {} (the dense MLP's slots: ac.policy = \"P+offload:[mlp]\").",
                     origin,
                     moe ? n + " offloads activations of MoE experts, and remat's blocks have none"
                         : "'" + n + "' is not one of Megatron's offload modules",
                     join(mapped, ", ")));
  }
  if (std::find(names.begin(), names.end(), "layer_input") != names.end()) {
    // Megatron's layer_input is the input a full recompute restarts from; it needs full
    // granularity, where every input a layer keeps is one.
    const auto everything = SlotMask::droppable();
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      if (plan.layers[i].chunk_begin < 0 && plan.layers[i].dropped != everything) {
        fail(
            fmt::format("{}: layer_input moves the input each recomputed layer restarts from, but the policy {} "
                        "keeps layer {}'s input without recomputing that layer whole; Megatron allows layer_input "
                        "only with full recompute, so choose full or uniform:N (ac.recompute_granularity = "
                        "\"full\" with ac.recompute_method = \"uniform\"), or drop layer_input.",
                        origin, plan.policy, i + 1));
      }
    }
  }
  return {origin, "offload:[" + join(slots.names(), ",") + "]"};
}

}  // namespace

void torchtune(const AcConfig& ac, std::vector<Candidate>& out, const Compile& compile) {
  const bool mode_or_option = ac.ac_mode || ac.ac_option;
  const std::string what = ac.ac_mode     ? "ac.ac_mode = " + quoted(ac.ac_mode)
                           : ac.ac_option ? "ac.ac_option = " + option_text(ac.ac_option)
                                          : "";
  if (!ac.enable_activation_checkpointing) {
    if (mode_or_option) {
      fail(
          fmt::format("{} is given without ac.enable_activation_checkpointing; set "
                      "ac.enable_activation_checkpointing = true with it (or use ac.policy).",
                      what));
    }
    return;
  }
  if (!*ac.enable_activation_checkpointing) {
    if (mode_or_option) {
      fail(
          fmt::format("ac.enable_activation_checkpointing = false turns recompute off, but {} asks for it: two "
                      "spellings of the same setting disagree. Set ac.enable_activation_checkpointing = true to use "
                      "it, or drop {}.",
                      what, ac.ac_mode ? "ac.ac_mode" : "ac.ac_option"));
    }
    out.push_back(
        {"ac.enable_activation_checkpointing = false", compile("none", "ac.enable_activation_checkpointing = false")});
    return;
  }
  if (!ac.ac_mode) {
    if (ac.ac_option) {
      fail(
          fmt::format("ac.ac_option = {} needs ac.ac_mode = \"selective\"; it chooses which layers or ops "
                      "selective recompute covers.",
                      option_text(ac.ac_option)));
    }
    out.push_back(
        {"ac.enable_activation_checkpointing = true", compile("full", "ac.enable_activation_checkpointing = true")});
    return;
  }
  if (*ac.ac_mode == "full") {
    if (ac.ac_option) {
      fail(
          fmt::format("ac.ac_option = {} applies only to ac.ac_mode = \"selective\"; with ac.ac_mode = \"full\" "
                      "every layer is recomputed. Drop ac.ac_option or set ac.ac_mode = \"selective\".",
                      option_text(ac.ac_option)));
    }
    out.push_back({"ac.ac_mode = \"full\"", compile("full", "ac.ac_mode = \"full\"")});
    return;
  }
  if (*ac.ac_mode != "selective") {
    fail(fmt::format("ac.ac_mode must be \"full\" or \"selective\", got {}.", quoted(ac.ac_mode)));
  }
  if (!ac.ac_option) {
    fail(
        "ac.ac_mode = \"selective\" needs ac.ac_option: a whole number K (recompute every K-th layer, every:K) "
        "or \"op\" (keep matmul and attention outputs, ops:[matmul,attention]).");
  }
  const std::string origin = "ac.ac_option = " + option_text(ac.ac_option);
  if (*ac.ac_option == "op") {
    out.push_back({origin, compile("ops:[matmul,attention]", origin)});
    return;
  }
  if (!util::parse_int(*ac.ac_option)) {
    fail(fmt::format("{}: ac.ac_option must be a whole number K (every K-th layer) or \"op\".", origin));
  }
  out.push_back({origin, compile("every:" + *ac.ac_option, origin)});
}

void megatron(const AcConfig& ac, std::vector<Candidate>& out, const Compile& compile) {
  std::optional<std::string> gran = ac.recompute_granularity;
  std::string gran_origin = gran ? "ac.recompute_granularity = " + quoted(gran) : "";
  if (ac.recompute_activations && *ac.recompute_activations) {
    if (gran && *gran != "selective") {
      fail(
          fmt::format("ac.recompute_activations = true means selective recompute, but {} asks for another "
                      "granularity: two spellings of the same setting disagree. Drop one of them.",
                      gran_origin));
    }
    if (!gran) gran_origin = "ac.recompute_activations = true";
    gran = "selective";
  }
  if (gran && *gran != "full" && *gran != "selective") {
    fail(fmt::format("ac.recompute_granularity must be \"full\" or \"selective\", got {}.", quoted(gran)));
  }
  if (ac.recompute_num_layers && *ac.recompute_num_layers < 1) {
    fail(
        fmt::format("ac.recompute_num_layers must be at least 1, got {}; it is the chunk size of "
                    "recompute_method = \"uniform\" or the layers per stage of \"block\".",
                    *ac.recompute_num_layers));
  }
  const bool selective = gran && *gran == "selective";
  if (ac.recompute_method && (selective || !gran)) {
    fail(
        fmt::format("ac.recompute_method = {} is given with {}; a recompute method chooses layers to recompute "
                    "whole, which only full granularity does. Set ac.recompute_granularity = \"full\" with the "
                    "method, or drop ac.recompute_method (to combine both, write e.g. "
                    "ac.policy = \"block:2+modules:[core_attn]\").",
                    quoted(ac.recompute_method),
                    selective ? "selective granularity (" + gran_origin + ")" : "no ac.recompute_granularity"));
  }
  if (ac.recompute_num_layers && (selective || !gran)) {
    fail(
        fmt::format("ac.recompute_num_layers = {} is given with {}; it only counts layers for full granularity "
                    "with a recompute method. Drop it, or set ac.recompute_granularity = \"full\" and "
                    "ac.recompute_method.",
                    *ac.recompute_num_layers,
                    selective ? "selective granularity (" + gran_origin + ")" : "no ac.recompute_granularity"));
  }
  if (gran && *gran == "full") {
    if (ac.recompute_modules) {
      fail(
          fmt::format("ac.recompute_modules = {} applies only to selective granularity, but "
                      "ac.recompute_granularity = \"full\" recomputes whole layers. Drop one of them.",
                      quoted(ac.recompute_modules)));
    }
    if (!ac.recompute_method || !ac.recompute_num_layers) {
      fail(fmt::format(
          "ac.recompute_granularity = \"full\" needs {}: \"uniform\" with N recomputes chunks of N "
          "layers, \"block\" with N the first N layers of each stage (e.g. recompute_method = "
          "\"uniform\", recompute_num_layers = 1). To recompute every layer, use ac.policy = \"full\".",
          !ac.recompute_method && !ac.recompute_num_layers ? "ac.recompute_method and ac.recompute_num_layers"
          : !ac.recompute_method                           ? "ac.recompute_method"
                                                           : "ac.recompute_num_layers"));
    }
    if (*ac.recompute_method != "uniform" && *ac.recompute_method != "block") {
      fail(fmt::format("ac.recompute_method must be \"uniform\" or \"block\", got {}.", quoted(ac.recompute_method)));
    }
    const std::string origin = fmt::format("ac.recompute_method = {} with ac.recompute_num_layers = {}",
                                           quoted(ac.recompute_method), *ac.recompute_num_layers);
    out.push_back({origin, compile(*ac.recompute_method + ":" + std::to_string(*ac.recompute_num_layers), origin)});
  } else if (selective || ac.recompute_modules) {
    std::string mods = "core_attn";
    std::string origin = gran_origin;
    if (ac.recompute_modules) {
      mods = join(split_list(*ac.recompute_modules), ",");
      origin = "ac.recompute_modules = " + quoted(ac.recompute_modules);
      if (mods.empty()) {
        fail("ac.recompute_modules is empty; list the submodules to recompute (e.g. \"core_attn\"), or drop it.");
      }
    }
    out.push_back({origin, compile("modules:[" + mods + "]", origin)});
  }
}

void colossalai(const AcConfig& ac, const StageSplit& split, std::vector<Candidate>& out, const Compile& compile) {
  if (ac.gradient_checkpointing_ratio) {
    const double r = *ac.gradient_checkpointing_ratio;
    const std::string origin = fmt::format("ac.gradient_checkpointing_ratio = {}", r);
    if (!(r >= 0.0 && r <= 1.0)) {
      fail(
          fmt::format("{} is outside [0, 1]; it is the share of each pipeline stage's layers that is recomputed, "
                      "e.g. 0.5 for half of them.",
                      origin));
    }
    out.push_back({origin, compile(fmt::format("ratio:{}", r), origin)});
  }
  if (ac.num_ckpt_layers_per_stage) {
    const auto counts = int_list("ac.num_ckpt_layers_per_stage", *ac.num_ckpt_layers_per_stage);
    const std::string origin = "ac.num_ckpt_layers_per_stage = " + list_text(counts);
    if (counts.size() != split.size.size()) {
      fail(fmt::format("{} lists {} stages but ac.stages = {}; give one entry per pipeline stage.", origin,
                       counts.size(), split.size.size()));
    }
    for (size_t s = 0; s < counts.size(); ++s) {
      if (counts[s] < 0 || counts[s] > split.size[s]) {
        fail(
            fmt::format("{} asks for {} recomputed layers in stage {}, which has {} layers; each entry must be "
                        "between 0 and its stage's layer count.",
                        origin, counts[s], s + 1, split.size[s]));
      }
    }
    const bool same = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts.front(); });
    std::string policy;
    if (same) {
      policy = counts.front() == 0 ? "none" : "block:" + std::to_string(counts.front());
    } else {
      std::vector<std::string> entries;
      for (size_t s = 0; s < counts.size(); ++s) {
        for (int64_t j = 0; j < split.size[s]; ++j) entries.push_back(j < counts[s] ? "full" : "none");
      }
      policy = "layers:[" + join(entries, ",") + "]";
    }
    out.push_back({origin, compile(policy, origin)});
  }
}

void nanotron(const AcConfig& ac, std::vector<Candidate>& out, const Compile& compile) {
  if (ac.recompute_layer) {
    const std::string origin = "ac.recompute_layer = " + boolean(*ac.recompute_layer);
    out.push_back({origin, compile(*ac.recompute_layer ? "full" : "none", origin)});
  }
}

std::vector<OffloadAsk> offload_aliases(const AcConfig& ac, const StageSplit& split, const ActivationPlan& plan) {
  std::vector<OffloadAsk> out;
  if (ac.enable_activation_offloading && *ac.enable_activation_offloading) {
    out.push_back({"ac.enable_activation_offloading = true", fmt::format("offload{}", kEveryKeptSlot)});
  }
  if (ac.offload_modules) out.push_back(offload_modules_alias(*ac.offload_modules, plan));
  if (ac.cpu_offloading_num_layers) {
    // Megatron's --cpu-offloading: TransformerEngine offloads every activation of the first
    // N layers and allows 0 <= N < layers; N = 0 would offload nothing.
    const int64_t n = *ac.cpu_offloading_num_layers;
    const std::string origin = fmt::format("ac.cpu_offloading_num_layers = {}", n);
    const int64_t most = split.smallest() - 1;
    const std::string where =
        split.size.size() == 1 ? "the model's layers" : "the layers of the smallest pipeline stage";
    if (n < 1) {
      fail(
          fmt::format("{} offloads no layer; give N of at least 1 (the first N layers of each pipeline stage keep "
                      "every slot in host memory), or drop it.",
                      origin));
    }
    if (n > most) {
      fail(
          fmt::format("{} is not less than {} ({}): Megatron offloads all but the last layer at most, whose "
                      "backward follows its forward at once; give N below {}, or offload every layer with "
                      "ac.enable_activation_offloading = true.",
                      origin, where, split.smallest(), split.smallest()));
    }
    out.push_back({origin, fmt::format("offload(block:{}){}", n, kEveryKeptSlot)});
  }
  return out;
}

}  // namespace remat::policy
