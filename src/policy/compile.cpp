#include "remat/policy.h"

#include "policy/aliases.h"
#include "remat/budget.h"
#include "remat/layout.h"
#include "remat/ops/attention.h"

#include <fmt/format.h>

#include <algorithm>

namespace remat {
namespace policy {
namespace {

StageSplit stage_split(const AcConfig& ac, int64_t n) {
  if (ac.stages < 1) fail(fmt::format("ac.stages must be at least 1 (pipeline stages), got {}.", ac.stages));
  if (ac.stages > n) {
    fail(fmt::format("ac.stages = {} is more pipeline stages than the model has layers ({}); use at most {}.",
                     ac.stages, n, n));
  }
  StageSplit split;
  if (ac.num_layers_per_stage) {
    const auto sizes = int_list("ac.num_layers_per_stage", *ac.num_layers_per_stage);
    if (static_cast<int64_t>(sizes.size()) != ac.stages) {
      fail(
          fmt::format("ac.num_layers_per_stage = {} lists {} stages but ac.stages = {}; give one entry per "
                      "pipeline stage.",
                      list_text(sizes), sizes.size(), ac.stages));
    }
    int64_t sum = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 1) {
        fail(fmt::format("ac.num_layers_per_stage = {}: stage {} has {} layers; every stage needs at least one.",
                         list_text(sizes), i + 1, sizes[i]));
      }
      sum += sizes[i];
    }
    if (sum != n) {
      fail(
          fmt::format("ac.num_layers_per_stage = {} sums to {} layers but the model has {}; the stages must "
                      "split exactly the model's layers.",
                      list_text(sizes), sum, n));
    }
    split.size = sizes;
  } else {
    split.size = pipeline::even_split(n, ac.stages);  // the first stages take one more layer
  }
  int64_t first = 0;
  for (auto s : split.size) {
    split.first.push_back(first);
    first += s;
  }
  return split;
}

bool recomputes_anything(const ActivationPlan& p) {
  return std::any_of(p.layers.begin(), p.layers.end(),
                     [](const LayerPlan& l) { return !l.dropped.empty() || l.chunk_begin >= 0; });
}

// The recompute plan ac.policy and the frameworks' policy keys agree on, with the offload
// an offload key adds to it; spellings that disagree, or a second offload, are refused.
ActivationPlan agreed_plan(const AcConfig& ac, int64_t n_layers, const StageSplit& split) {
  const Compile compile = [&](const std::string& policy, const std::string& origin) {
    return Parser(origin, n_layers, split).parse(policy);
  };
  std::vector<Candidate> asked;
  if (ac.policy) {
    const std::string origin = "ac.policy = \"" + *ac.policy + "\"";
    asked.push_back({origin, compile(*ac.policy, origin)});
  }
  torchtune(ac, asked, compile);
  megatron(ac, asked, compile);
  colossalai(ac, split, asked, compile);
  nanotron(ac, asked, compile);

  ActivationPlan plan = asked.empty() ? compile("none", "ac.policy") : asked.front().plan;
  for (size_t i = 1; i < asked.size(); ++i) {
    if (!same_layers(asked.front().plan, asked[i].plan)) {
      fail(
          fmt::format("{} asks for {} but {} asks for {}: two spellings of the recompute policy disagree. "
                      "Set only one of them.",
                      asked.front().origin, asked.front().plan.policy, asked[i].origin, asked[i].plan.policy));
    }
  }
  const auto offloads = offload_aliases(ac, split, plan);
  if (!offloads.empty()) {
    const std::string first = plan.offloads() ? asked.front().origin : offloads[0].origin;
    const std::string second = plan.offloads() ? offloads[0].origin : offloads.size() > 1 ? offloads[1].origin : "";
    if (!second.empty()) {
      fail(
          fmt::format("{} and {} both choose what moves to host memory; give the offload once (ac.policy = "
                      "\"P+offload:[...]\" or one of the offload keys).",
                      first, second));
    }
    Parser(offloads[0].origin, n_layers, split).offload(offloads[0].term, plan);
  }
  return plan;
}

// nanotron's tp_recompute_allgather (its default): the gathered inputs of the
// column-parallel linears are never kept (so not offloaded either).
void gather_again(ActivationPlan& plan) {
  for (auto& l : plan.layers) {
    for (const auto& m : block_modules()) {
      if (m.first != "gathered") continue;
      for (const Slot s : SlotMask::of_names(m.second).slots()) {
        l.dropped.add(s);
        l.offloaded.remove(s);
      }
    }
  }
  plan.policy += " (tp_recompute_allgather)";
}

// Megatron's distribute_saved_activations: the input of every layer recomputed whole (a
// uniform chunk's first layer, a block:N layer, a full layer) is kept as this rank's share.
void distribute_inputs(ActivationPlan& plan) {
  const auto everything = SlotMask::droppable();
  // With no recompute it has nothing to act on (a sweep's `none`); a selective policy
  // alone is a misunderstanding: it keeps every input whole.
  for (auto& l : plan.layers) l.input_sharded = l.chunk_begin < 0 && l.dropped == everything;
  if (std::none_of(plan.layers.begin(), plan.layers.end(), [](const LayerPlan& l) { return l.input_sharded; })) {
    if (recomputes_anything(plan)) {
      fail(
          fmt::format("ac.distribute_saved_activations = true keeps the input of each layer recomputed whole as a "
                      "share per tensor-parallel rank, but the policy {} recomputes no layer whole; choose full, "
                      "uniform:N or block:N (Megatron: ac.recompute_granularity = \"full\" with a method), or "
                      "drop ac.distribute_saved_activations.",
                      plan.policy));
    }
  } else {
    plan.policy += " (distribute_saved_activations)";
  }
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    if (plan.layers[i].input_sharded && plan.layers[i].offloaded.has(Slot::input)) {
      fail(
          fmt::format("ac.distribute_saved_activations = true keeps layer {}'s input as a share per "
                      "tensor-parallel rank, and the policy {} offloads that input to host memory: a kept input "
                      "is held one way. Drop input from offload:[...], or drop "
                      "ac.distribute_saved_activations.",
                      i + 1, plan.policy));
    }
  }
}

// ac.offload_prefetch: each layer that may starts its copies back during the backward of
// the layer above.
void prefetch_offloads(const AcConfig& ac, const StageSplit& split, ActivationPlan& plan) {
  if (!ac.budget.empty()) {
    fail(
        fmt::format("ac.budget = \"{}\" lets the planner choose, per layer, when offloaded slots come back, but "
                    "ac.offload_prefetch = true fixes that choice; keep one of them.",
                    ac.budget));
  }
  for (size_t s = 0; s < split.first.size(); ++s) {
    const int64_t end = split.first[s] + split.size[s];
    for (int64_t l = split.first[s]; l < end; ++l) {
      plan.layers[static_cast<size_t>(l)].prefetch = plan.may_prefetch(l, end);
    }
  }
  if (std::none_of(plan.layers.begin(), plan.layers.end(), [](const LayerPlan& l) { return l.prefetch; })) {
    fail(
        fmt::format("ac.offload_prefetch = true brings a layer's offloaded slots back during the backward of the "
                    "layer above, but under the policy {} no layer offloads below another of its stage outside a "
                    "uniform chunk; add an offload term (ac.policy = \"P+offload:[input,mlp]\") or drop "
                    "ac.offload_prefetch.",
                    plan.policy));
  }
  plan.policy += " (offload_prefetch)";
}

}  // namespace
}  // namespace policy

bool same_layers(const ActivationPlan& a, const ActivationPlan& b) {
  if (a.layers.size() != b.layers.size()) return false;
  for (size_t i = 0; i < a.layers.size(); ++i) {
    if (a.layers[i].dropped != b.layers[i].dropped || a.layers[i].chunk_begin != b.layers[i].chunk_begin ||
        a.layers[i].input_sharded != b.layers[i].input_sharded || a.layers[i].attention != b.layers[i].attention ||
        a.layers[i].offloaded != b.layers[i].offloaded || a.layers[i].prefetch != b.layers[i].prefetch) {
      return false;
    }
  }
  return true;
}

std::vector<int64_t> stage_sizes(const AcConfig& ac, int64_t n_layers) {
  return policy::stage_split(ac, n_layers).size;
}

ActivationPlan compile_policy(const AcConfig& ac, int64_t n_layers, double dropout) {
  using namespace policy;
  if (n_layers < 1) fail(fmt::format("A recompute plan needs at least one layer, got {}.", n_layers));
  if (ac.check != "none" && ac.check != "meta" && ac.check != "values") {
    fail(fmt::format("ac.check must be \"none\", \"meta\" or \"values\", got \"{}\".", ac.check));
  }
  const StageSplit split = stage_split(ac, n_layers);
  ActivationPlan plan = agreed_plan(ac, n_layers, split);
  if (ac.tp_recompute_allgather && *ac.tp_recompute_allgather) gather_again(plan);
  if (ac.distribute_saved_activations && *ac.distribute_saved_activations) distribute_inputs(plan);
  if (ac.offload_prefetch) prefetch_offloads(ac, split, plan);
  if (dropout > 0.0 && !ac.preserve_rng_state && !ac.allow_rng_mismatch && recomputes_anything(plan)) {
    fail(
        fmt::format("ac.preserve_rng_state = false with dropout {} makes recomputed dropout draw other masks than "
                    "the forward did, which silently changes training; keep ac.preserve_rng_state = true, or set "
                    "ac.allow_rng_mismatch = true to accept the mismatch.",
                    dropout));
  }
  return plan;
}

// GCC 12 warns, wrongly, that assigning the empty optional reads an uninitialized string.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
ActivationPlan compile_policy(const std::string& policy, int64_t n_layers, double dropout) {
  AcConfig ac;
  ac.policy = policy;
  return compile_policy(ac, n_layers, dropout);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

std::string explain_plan(const ActivationPlan& plan) {
  struct Row {
    std::string layers, keeps, drops, chunk, attention, offloads;
  };
  // The attention column only where the plan chooses the op per layer (model.attention =
  // auto), the offload column only where it offloads.
  const bool per_layer_op =
      std::any_of(plan.layers.begin(), plan.layers.end(), [](const LayerPlan& l) { return l.attention.has_value(); });
  const bool offloads = plan.offloads();
  std::vector<Row> rows;
  const auto n = static_cast<int64_t>(plan.layers.size());
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j + 1 < n && plan.layers[j + 1].dropped == plan.layers[i].dropped &&
           plan.layers[j + 1].chunk_begin == plan.layers[i].chunk_begin &&
           plan.layers[j + 1].input_sharded == plan.layers[i].input_sharded &&
           plan.layers[j + 1].attention == plan.layers[i].attention &&
           plan.layers[j + 1].offloaded == plan.layers[i].offloaded &&
           plan.layers[j + 1].prefetch == plan.layers[i].prefetch && plan.chunk_of(j + 1) == plan.chunk_of(i)) {
      ++j;
    }
    const LayerPlan& l = plan.layers[i];
    Row r;
    r.layers = i == j ? std::to_string(i + 1) : fmt::format("{}-{}", i + 1, j + 1);
    std::vector<std::string> kept, dropped;
    for (const auto& s : block_slots()) (l.dropped.has(slot_of_name(s)) ? dropped : kept).push_back(s);
    if (l.chunk_begin >= 0) {
      r.keeps = fmt::format("nothing (recomputed from layer {}'s input)", l.chunk_begin + 1);
    } else {
      const std::string input = l.input_sharded ? "block input (a share per tensor-parallel rank)" : "block input";
      if (dropped.empty()) {
        r.keeps = l.input_sharded ? "all, " + input : "all";
      } else if (kept.empty()) {
        r.keeps = input + " only";
      } else {
        r.keeps = input + ", " + policy::join(kept, ", ");
      }
    }
    r.drops = dropped.empty() ? "-" : kept.empty() ? "all" : policy::join(dropped, ", ");
    r.attention = l.attention ? attention_name(*l.attention) : "-";
    r.offloads = l.offloaded.empty() ? "-" : policy::join(l.offloaded.names(), ", ");
    if (l.prefetch) r.offloads += " (back during the backward of the layer above)";
    const int64_t chunk = plan.chunk_of(i);
    if (chunk >= 0) {
      r.chunk = fmt::format("{}-{}", chunk + 1, plan.chunk_end(chunk) + 1);
    } else {
      r.chunk = "-";
    }
    rows.push_back(r);
    i = j + 1;
  }
  size_t w_layers = 6, w_keeps = 5, w_drops = 5;
  for (const auto& r : rows) {
    w_layers = std::max(w_layers, r.layers.size());
    w_keeps = std::max(w_keeps, r.keeps.size());
    w_drops = std::max(w_drops, r.drops.size());
  }
  std::string out = fmt::format("policy: {} ({} layers, numbered from 1)\n", plan.policy, n);
  const auto line = [&](const Row& r) {
    std::string text =
        fmt::format("{:<{}}  {:<{}}  {:<{}}  {:<5}", r.layers, w_layers, r.keeps, w_keeps, r.drops, w_drops, r.chunk);
    if (per_layer_op) text += fmt::format("  {:<9}", r.attention);
    if (offloads) text += "  " + r.offloads;
    while (!text.empty() && text.back() == ' ') text.pop_back();
    return text + "\n";
  };
  out += line({"layers", "keeps", "drops", "chunk", "attention", "offloaded to host"});
  for (const auto& r : rows) out += line(r);
  return out;
}

ActivationPlan validate_plan(const Config& c) {
  const std::string why = ops::attention_refusal(c.model.attention, c.model.dropout, c.run.device.is_cuda(),
                                                 dtype_of(c.run.dtype), c.model.head_dim());
  if (!why.empty()) policy::fail(why);
  const ActivationPlan plan = compile_policy(c.ac, c.model.n_layer, c.model.dropout);
  if (!c.ac.host_budget.empty()) parse_host_budget(c.ac.host_budget, 1);
  if (!c.ac.budget.empty()) {
    parse_budget(c.ac.budget, 1);
    if (c.ac.policy || plan.policy != "none") {
      policy::fail(
          fmt::format("ac.budget = \"{}\" asks the planner for the plan, but the ac settings also choose the policy "
                      "\"{}\"; keep one of them.",
                      c.ac.budget, plan.policy));
    }
  }
  return plan;
}

Config load_run_config(const std::string& toml_path, const std::vector<std::string>& overrides) {
  Config c = load_config(toml_path, overrides);
  validate_plan(c);
  return c;
}

}  // namespace remat
