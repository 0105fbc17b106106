#include "run/saved_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "util/utf8.h"

namespace remat {

std::string saved_plan_json(const ActivationPlan& plan, const std::vector<int64_t>& split) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerPlan& l : plan.layers) {
    nlohmann::json layer{
        {"dropped", l.dropped.names()}, {"chunk_begin", l.chunk_begin}, {"input_sharded", l.input_sharded}};
    if (l.attention) layer["attention"] = attention_name(*l.attention);
    if (!l.offloaded.empty()) layer["offloaded"] = l.offloaded.names();
    if (l.prefetch) layer["prefetch"] = true;
    if (l.weights_kept) layer["weights_kept"] = true;
    layers.push_back(std::move(layer));
  }
  return nlohmann::json{{"policy", plan.policy}, {"split", split}, {"layers", layers}}.dump();
}

SavedPlan parse_saved_plan(const std::string& json, int64_t n_layers, int64_t stages) {
  const auto damaged = [](const std::string& why) {
    return std::invalid_argument("The checkpoint's plan (its \"plan\" metadata) " + why +
                                 "; resume from a checkpoint this model's run wrote, or start the run again.");
  };
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  SavedPlan saved;
  try {
    if (!j.is_object()) throw damaged("is not a JSON object");
    saved.plan.policy = j.at("policy").get<std::string>();
    // Printed in plan.txt and on the terminal as it is.
    if (util::find_control(saved.plan.policy) != std::string::npos) {
      throw damaged(fmt::format("names its policy '{}', with a control character", util::printable(saved.plan.policy)));
    }
    saved.split = j.at("split").get<std::vector<int64_t>>();
    for (const nlohmann::json& l : j.at("layers")) {
      LayerPlan layer;
      const auto dropped = l.at("dropped").get<std::vector<std::string>>();
      for (const std::string& slot : dropped) {
        if (std::find(block_slots().begin(), block_slots().end(), slot) == block_slots().end()) {
          throw damaged(fmt::format("drops '{}' in layer {}, which no block has", util::printable(slot),
                                    saved.plan.layers.size() + 1));
        }
      }
      layer.dropped = SlotMask::of_names(dropped);
      // Older checkpoints offload nothing and say nothing of it.
      const auto offloaded = l.value("offloaded", std::vector<std::string>{});
      for (const std::string& slot : offloaded) {
        if (slot != "input" && std::find(block_slots().begin(), block_slots().end(), slot) == block_slots().end()) {
          throw damaged(fmt::format("offloads '{}' in layer {}, which no block has", util::printable(slot),
                                    saved.plan.layers.size() + 1));
        }
        layer.offloaded.add(slot_of_name(slot));
      }
      layer.prefetch = l.value("prefetch", false);
      layer.weights_kept = l.value("weights_kept", false);
      layer.chunk_begin = l.at("chunk_begin").get<int64_t>();
      layer.input_sharded = l.at("input_sharded").get<bool>();
      if (l.contains("attention")) {
        const std::string op = l.at("attention").get<std::string>();
        const auto* known = std::find_if(std::begin(kAttentionOps), std::end(kAttentionOps),
                                         [&](Attention a) { return op == attention_name(a); });
        if (known == std::end(kAttentionOps)) {
          std::vector<std::string> names;
          for (Attention a : kAttentionOps) names.emplace_back(attention_name(a));
          throw damaged(fmt::format("runs attention '{}' in layer {}, which is none of this build's ops ({})",
                                    util::printable(op), saved.plan.layers.size() + 1, fmt::join(names, ", ")));
        }
        layer.attention = *known;
      }
      saved.plan.layers.push_back(std::move(layer));
    }
  } catch (const nlohmann::json::exception& e) {
    throw damaged(fmt::format("is damaged ({})", e.what()));
  }
  if (static_cast<int64_t>(saved.plan.layers.size()) != n_layers) {
    throw damaged(fmt::format("has {} layers where the model has {}", saved.plan.layers.size(), n_layers));
  }
  const bool split_ok = static_cast<int64_t>(saved.split.size()) == stages &&
                        std::all_of(saved.split.begin(), saved.split.end(), [](int64_t n) { return n >= 1; }) &&
                        std::accumulate(saved.split.begin(), saved.split.end(), int64_t{0}) == n_layers;
  if (!split_ok) {
    throw damaged(fmt::format("splits the layers as [{}], but this run puts its {} layers on {} pipeline stage{}",
                              fmt::join(saved.split, ","), n_layers, stages, stages == 1 ? "" : "s"));
  }
  for (size_t l = 0; l < saved.plan.layers.size(); ++l) {
    const LayerPlan& layer = saved.plan.layers[l];
    if (layer.chunk_begin < -1 || layer.chunk_begin > static_cast<int64_t>(l)) {
      throw damaged(fmt::format("begins layer {}'s chunk at layer {}", l + 1, layer.chunk_begin + 1));
    }
  }
  return saved;
}

}  // namespace remat
