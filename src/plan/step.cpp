#include "plan/step_walk.h"

#include "remat/caching_allocator.h"
#include "remat/ops.h"
#include "remat/schedule.h"

#include <fmt/format.h>

#include <map>
#include <optional>
#include <tuple>

namespace remat::cost {
namespace {

using ops::nbytes;

void check_plan(const ModelConfig& cfg, const StepShape& shape, const ActivationPlan& plan) {
  TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == cfg.n_layer, "The activation plan has ", plan.layers.size(),
              " layers but the model has ", cfg.n_layer);
  TORCH_CHECK(shape.grad_accum >= 1, "A step runs at least one microbatch, got ", shape.grad_accum);
}

// The recompute of one whole layer of a uniform chunk: every node of `block` run again.
LayerCost rebuild_cost(const graph::BlockGraph& block, const NodeTimes& times, int64_t recomputed_bytes) {
  LayerCost rebuild;
  for (const auto& n : block.nodes) {
    if (n.op->kind()[0] != '\0') ++rebuild.ops[n.op->kind()];
    rebuild.recompute_seconds += times.node_seconds(n);
    rebuild.recompute_link_seconds += times.node_link_seconds(n);
  }
  rebuild.recompute_flops = block.forward_flops();
  rebuild.recomputed_bytes = recomputed_bytes;
  return rebuild;
}

}  // namespace

SlotMask first_forward_drops(const ActivationPlan& plan, int64_t l) {
  const LayerPlan& lp = plan.layers.at(static_cast<size_t>(l));
  if (plan.chunk_of(l) < 0) return lp.dropped;
  SlotMask all = SlotMask::droppable();
  if (lp.chunk_begin >= 0) all.add(Slot::input);
  return all;
}

namespace {

// Whether layer plan `lp` runs the attention op other than the model's.
bool runs_other(const ModelConfig& cfg, const LayerPlan& lp) { return lp.attention && *lp.attention != cfg.attention; }

// The layers of the stage [F, E) priced per distinct slot choice (layers of one policy
// mostly share a few), from the top: a layer that prefetches starts its copies back once
// the layer above's have ended, and has the rest of that layer's backward ahead of its own.
// A uniform chunk's layers: their first forward keeps only the chunk's input (its first
// layer), and the chunk's recompute rebuilds each whole. `whole`: a layer keeping all.
std::vector<LayerCost> price_layers(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                                    const ActivationPlan& plan, bool early_stop, const NodeTimes& times,
                                    const graph::BlockGraph& block, LayerCost& whole) {
  const int64_t F = layout.first_layer(cfg.n_layer), E = F + layout.stage_layers(cfg.n_layer);
  // Layers running the other attention op (LayerPlan::attention): its graph and times.
  std::optional<graph::BlockGraph> other_block;
  for (int64_t l = F; l < E; ++l) {
    if (!runs_other(cfg, plan.layers[l]) || other_block) continue;
    const OtherAttention* other = times.other_attention.get();
    TORCH_CHECK(other != nullptr && other->op == *plan.layers[l].attention, "The activation plan runs ",
                attention_name(*plan.layers[l].attention), " attention in layer ", l + 1, " of a model of ",
                attention_name(cfg.attention), " attention, but its times do not price that op");
    ModelConfig c = cfg;
    c.attention = other->op;
    other_block = shape_block(c, shape, layout);
  }
  const LayerPricer pricer(block, early_stop, times);
  std::optional<LayerPricer> other_pricer;
  if (other_block) other_pricer.emplace(*other_block, early_stop, times.other_attention->times);
  std::map<std::tuple<SlotMask, bool, SlotMask, bool, double>, LayerCost> priced;
  auto price = [&](const LayerPlan& lp, bool other, double fetch_ahead = 0) -> const LayerCost& {
    const auto key = std::tuple{lp.dropped, lp.input_sharded, lp.offloaded, other, fetch_ahead};
    auto it = priced.find(key);
    if (it == priced.end()) {
      const LayerPricer& by = other ? *other_pricer : pricer;
      it = priced.emplace(key, by.price(lp.dropped, lp.input_sharded, lp.offloaded, fetch_ahead)).first;
    }
    return it->second;
  };
  whole = price(LayerPlan{}, false);
  std::vector<LayerCost> layers(static_cast<size_t>(E - F));
  for (int64_t l = E - 1; l >= F; --l) {
    const LayerPlan& lp = plan.layers[l];
    LayerCost& c = layers[static_cast<size_t>(l - F)];
    if (plan.chunk_of(l) < 0) {
      const LayerCost* above = plan.prefetches(l, E) ? &layers[static_cast<size_t>(l + 1 - F)] : nullptr;
      c = price(lp, runs_other(cfg, lp), above ? above->backward_clock_seconds - above->fetched_by_seconds : 0.0);
      continue;
    }
    TORCH_CHECK(!runs_other(cfg, lp), "The activation plan runs ", attention_name(*lp.attention),
                " attention in layer ", l + 1,
                ", which is in a uniform chunk; a chunk's layers run the model's "
                "attention op");
    c = pricer.forward(first_forward_drops(plan, l), lp.input_sharded, lp.offloaded);
    c.backward_peak = whole.backward_peak;
  }
  return layers;
}

// Adds to `p` what the stage's actions take besides their bytes: each layer's priced
// recompute and copies, a chunk's rebuild of every layer (`whole` keeps all of one).
void add_times(StepPrediction& p, const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
               const ActivationPlan& plan, const NodeTimes& times, const graph::BlockGraph& block,
               const LayerCost& whole) {
  const int64_t F = p.first_layer, E = F + static_cast<int64_t>(p.layers.size());
  const LayerCost rebuild = rebuild_cost(block, times, whole.kept - block.slot_bytes(Slot::input));
  const auto add_recompute = [&](const LayerCost& c, bool first_microbatch) {
    for (const auto& [kind, n] : c.ops) p.ops[kind] += n;
    p.recompute_flops += c.recompute_flops;
    p.recompute_seconds += c.recompute_seconds;
    p.recompute_link_seconds += c.recompute_link_seconds;
    if (first_microbatch) p.recomputed_bytes += c.recomputed_bytes;
  };
  const schedule::Stage stage{F, E, layout.has_embedding(), layout.has_head()};
  for (const schedule::Action& a :
       schedule::step(plan, stage, layout.schedule, layout.pp, layout.stage, shape.grad_accum)) {
    const bool first_microbatch = a.microbatch == 0;
    if (a.kind == schedule::Kind::forward) {
      const LayerCost& c = p.layers[static_cast<size_t>(a.layer - F)];
      p.offloaded_bytes += c.host;
      p.copy_seconds += c.copy_seconds;
      p.copy_wait_seconds += c.copy_wait_seconds;
      p.copy_slowdown_seconds += c.copy_slowdown_seconds;
      if (runs_other(cfg, plan.layers[a.layer])) p.attention_seconds += times.other_attention->pass_delta;
    } else if (a.kind == schedule::Kind::recompute) {
      if (plan.layers[a.layer].input_sharded) {
        const double gather = times.input_gather_seconds(block);
        p.recompute_seconds += gather;
        p.recompute_link_seconds += gather;
      }
      for (int64_t j = a.layer; j <= a.last; ++j) add_recompute(rebuild, first_microbatch);
    } else if (a.kind == schedule::Kind::backward && plan.chunk_of(a.layer) < 0) {
      add_recompute(p.layers[static_cast<size_t>(a.layer - F)], first_microbatch);
    }
  }
}

}  // namespace

StepPrediction predict_step(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                            const ActivationPlan& plan, bool early_stop, const NodeTimes& times) {
  check_plan(cfg, shape, plan);
  const StepConstants k = step_constants(cfg, shape, layout);  // checks the stage
  const graph::BlockGraph block = shape_block(cfg, shape, layout);
  StepPrediction p;
  p.statics = k.statics;
  p.first_layer = layout.first_layer(cfg.n_layer);
  p.embedding = k.embed_saved;
  p.head = k.head_saved;
  LayerCost whole;
  p.layers = price_layers(cfg, shape, layout, plan, early_stop, times, block, whole);
  p.kept_activations = k.embed_saved + k.head_saved;
  for (const LayerCost& c : p.layers) p.kept_activations += c.kept;
  // The bytes: the walk, its layers outside chunks held as priced.
  Live live, host;
  StepWalk walk(cfg, shape, layout, plan, early_stop, live, host, &p.layers);
  walk.hold_statics(0, /*moments_made=*/true, p.statics.small);
  walk.step();
  p.peak = walk.peak().peak;
  p.peak_at = walk.peak().at;
  p.working_set = walk.peak().working_set;
  p.peak_kept_weights = walk.peak().gathered.kept;
  p.peak_running_weights = walk.peak().gathered.running;
  p.host_peak = host.peak();
  add_times(p, cfg, shape, layout, plan, times, block, whole);
  p.data_parallel = data_parallel_traffic(cfg, shape, layout, plan);
  p.data_parallel_seconds = times.data_link_seconds(p.data_parallel.fixed());
  p.regather_seconds = times.data_link_seconds(p.data_parallel.regathers);
  return p;
}

std::vector<memory::AllocatorEvent> step_allocations(const ModelConfig& cfg, const StepShape& shape,
                                                     const Layout& layout, const ActivationPlan& plan, bool early_stop,
                                                     int64_t steps, int64_t workspace) {
  check_plan(cfg, shape, plan);
  TORCH_CHECK(steps >= 1, "At least one step is simulated, got ", steps);
  static_bytes(cfg, shape, layout);  // checks the stage
  std::vector<memory::AllocatorEvent> events;
  {
    Live live(&events), host;
    StepWalk walk(cfg, shape, layout, plan, early_stop, live, host, nullptr);
    walk.hold_statics(workspace, /*moments_made=*/false, 0);
    for (int64_t step = 0; step < steps; ++step) walk.step();
    // What the steps hold throughout stays live: the list ends with the last step.
    std::vector<memory::AllocatorEvent> out;
    out.swap(events);
    return out;
  }
}

DeviceMemory highest(const std::vector<DeviceMemory>& stages) {
  DeviceMemory most;
  for (const DeviceMemory& d : stages) {
    most.allocated_peak = std::max(most.allocated_peak, d.allocated_peak);
    most.reserved_peak = std::max(most.reserved_peak, d.reserved_peak);
  }
  return most;
}

DeviceMemory predict_device_memory(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                                   const ActivationPlan& plan, bool early_stop, const memory::AllocatorRules& rules,
                                   int64_t workspace) {
  memory::CachingAllocatorModel allocator(rules);
  for (const auto& e : step_allocations(cfg, shape, layout, plan, early_stop, 2, workspace)) allocator.apply(e);
  return {allocator.peak_allocated(), allocator.peak_reserved()};
}

}  // namespace remat::cost
