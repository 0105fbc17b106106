// The planner's layer options: every keep-set of the block priced, with the other
// attention op and the offload sets where the times and the host budget allow, and the
// Pareto frontier the programs choose from.
#include "plan/planner_detail.h"

#include <map>
#include <numeric>
#include <tuple>

namespace remat {
namespace {

// Whether `a` is no worse than `b` in every measure the program weighs.
bool no_worse(const LayerOption& a, const LayerOption& b) {
  return a.cost.kept <= b.cost.kept && detail::top(a) <= detail::top(b) && a.seconds <= b.seconds &&
         a.cost.host <= b.cost.host;
}

// The options no other is better than, in their given order. Taken by ascending measures,
// an option can only be bettered by one taken before it, so each is checked against the
// frontier so far; of equal ones the first given stands for all (the model's op, fewest
// dropped, least offloaded).
std::vector<LayerOption> pareto(const std::vector<LayerOption>& all) {
  std::vector<size_t> order(all.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const auto measures = [&](size_t i) {
    return std::make_tuple(all[i].cost.kept, detail::top(all[i]), all[i].seconds, all[i].cost.host);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return measures(a) < measures(b); });
  std::vector<size_t> taken;
  for (const size_t i : order) {
    if (std::none_of(taken.begin(), taken.end(), [&](size_t j) { return no_worse(all[j], all[i]); })) {
      taken.push_back(i);
    }
  }
  std::sort(taken.begin(), taken.end());
  std::vector<LayerOption> out;
  for (const size_t i : taken) out.push_back(all[i]);
  return out;
}

// Every subset of `block`'s slots that hold bytes, as dropped sets.
std::vector<SlotMask> keep_sets(const graph::BlockGraph& block) {
  std::vector<Slot> slots;
  for (const Slot s : SlotMask::droppable().slots()) {
    if (block.slot_bytes(s) > 0) slots.push_back(s);
  }
  std::vector<SlotMask> out;
  for (uint32_t mask = 0; mask < (1u << slots.size()); ++mask) {
    SlotMask dropped;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (mask & (1u << i)) dropped.add(slots[i]);
    }
    out.push_back(dropped);
  }
  return out;
}

}  // namespace

std::vector<bool> Planner::weight_holds() const {
  if (gathered_ == 0 || options_.reshard == Reshard::always) return {false};
  if (options_.reshard == Reshard::never) return {true};
  return {false, true};
}

std::vector<LayerOption> Planner::price_options(bool offload) const {
  std::vector<LayerOption> all;
  const auto add = [&](const graph::BlockGraph& block, const cost::LayerPricer& pricer, std::optional<Attention> op,
                       double delta) {
    const auto candidates = options_.candidates.empty() ? keep_sets(block) : options_.candidates;
    for (const bool sharded : input_holds()) {
      for (const auto& d : candidates) {
        for (const SlotMask moved : offload ? offload_sets(block, pricer, d, sharded) : std::vector<SlotMask>{{}}) {
          LayerOption o{d, moved, pricer.price(d, sharded, moved), sharded, op};
          o.cost.forward_peak += gathered_;
          o.cost.backward_peak += grad_buffers_ + gathered_;
          // A set whose every slot shares memory the device keeps moves nothing.
          if (!moved.empty() && o.cost.host == 0) continue;
          o.seconds = o.cost.recompute_seconds + delta + o.cost.copy_added_seconds();
          // The weights kept from the forward are in the layer's kept bytes, and in both its
          // peaks already; gathered again, they take one more gather.
          for (const bool kept : weight_holds()) {
            LayerOption w = o;
            w.weights_kept = kept;
            if (kept) {
              w.cost.kept += gathered_;
            } else {
              w.seconds += regather_;
            }
            all.push_back(std::move(w));
          }
        }
      }
    }
  };
  add(block_, cost::LayerPricer(block_, options_.early_stop, times_), per_layer_op_, 0);
  if (per_layer_op_) {
    const cost::OtherAttention& other = *times_.other_attention;
    ModelConfig c = cfg_;
    c.attention = other.op;
    const graph::BlockGraph block = cost::shape_block(c, shape_, layout_);
    add(block, cost::LayerPricer(block, options_.early_stop, other.times), other.op, other.pass_delta);
  }
  return pareto(all);
}

const std::vector<LayerOption>& Planner::offload_frontier() const {
  if (!offload_frontier_) offload_frontier_ = std::make_shared<const std::vector<LayerOption>>(price_options(true));
  return *offload_frontier_;
}

Planner::Options Planner::options(int64_t host) const {
  // Copies priced at no rate would look free: without one nothing is offloaded.
  const bool offload = host > 0 && times_.host_bytes_per_second > 0;
  Options o;
  o.frontier = offload ? &offload_frontier() : &device_frontier_;
  o.host = host;
  o.split = layout_.split;
  int64_t most_host = 0;
  for (const auto& opt : *o.frontier) most_host = std::max(most_host, opt.cost.host);
  o.host_binds = most_host * cfg_.n_layer > host;
  return o;
}

std::vector<bool> Planner::input_holds() const {
  if (block_.input_shardable()) return {false, true};
  return {false};
}

Planner::ChunkCost Planner::chunk_cost(int64_t n, bool sharded) const {
  const int64_t fwd = whole_.cost.forward_peak, input = block_.slot_bytes(Slot::input), full = whole_.cost.kept;
  ChunkCost c;
  c.kept = sharded ? input / block_.tp : input;
  c.top =
      std::max({input + fwd, block_.output_bytes() + (n - 1) * full + fwd, (n - 1) * full + whole_.cost.backward_peak});
  // Each layer's weights are gathered again for the recompute and for its backward.
  c.seconds = static_cast<double>(n) * (block_seconds_ + 2 * regather_);
  if (sharded) {
    // Gloo's all-gather holds the parts and its receive buffer beside the share and the
    // output gradient (graph::all_gather_events).
    c.top = std::max(c.top, block_.output_bytes() + c.kept + 2 * input);
    c.seconds += times_.input_gather_seconds(block_);
  }
  return c;
}

void Planner::place(ActivationPlan& plan, int64_t pos, const Choice& c, const Options& o) const {
  if (c.option >= 0) {
    const LayerOption& opt = (*o.frontier)[static_cast<size_t>(c.option)];
    plan.layers[pos].dropped = opt.dropped;
    plan.layers[pos].offloaded = opt.offloaded;
    plan.layers[pos].input_sharded = opt.input_sharded;
    plan.layers[pos].attention = opt.attention;
    plan.layers[pos].weights_kept = opt.weights_kept;
    return;
  }
  const SlotMask everything = SlotMask::droppable();
  for (int64_t j = pos; j < pos + c.chunk; ++j) {
    plan.layers[j].dropped = everything;
    plan.layers[j].chunk_begin = j == pos ? -1 : pos;
    plan.layers[j].attention = per_layer_op_;
  }
  plan.layers[pos].input_sharded = c.sharded;
}

std::vector<SlotMask> offload_sets(const graph::BlockGraph& block, const cost::LayerPricer& pricer, SlotMask dropped,
                                   bool input_sharded) {
  std::vector<Slot> kept;
  if (!input_sharded && block.slot_bytes(Slot::input) > 0) kept.push_back(Slot::input);
  for (const Slot s : SlotMask::droppable().slots()) {
    if (!dropped.has(s) && block.slot_bytes(s) > 0) kept.push_back(s);
  }
  std::map<Slot, double> added_per_byte;
  for (const Slot s : kept) {
    const cost::LayerCost c = pricer.price(dropped, input_sharded, SlotMask{s});
    added_per_byte[s] = c.host > 0 ? c.copy_added_seconds() / static_cast<double>(c.host) : 0.0;
  }
  std::stable_sort(kept.begin(), kept.end(), [&](Slot a, Slot b) {
    if (added_per_byte[a] != added_per_byte[b]) return added_per_byte[a] < added_per_byte[b];
    return block.slot_bytes(a) > block.slot_bytes(b);
  });
  std::vector<SlotMask> out{SlotMask{}};
  SlotMask moved;
  for (const Slot s : kept) {
    moved.add(s);
    out.push_back(moved);
  }
  return out;
}

std::vector<int> sweep_order(int points) {
  std::vector<int> order;
  if (points <= 0) return order;
  std::vector<bool> taken(static_cast<size_t>(points), false);
  const auto take = [&](int i) {
    if (!taken[static_cast<size_t>(i)]) order.push_back(i);
    taken[static_cast<size_t>(i)] = true;
  };
  take(0);
  take(points - 1);
  // Halve the gaps between taken indices until none is left.
  for (int step = points - 1; step > 1; step = (step + 1) / 2) {
    for (int lo = 0; lo + 1 < points; lo += step) take(std::min(points - 1, lo + step / 2));
  }
  for (int i = 0; i < points; ++i) take(i);
  return order;
}

}  // namespace remat
