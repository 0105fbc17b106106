#include "plan/block_sim.h"

namespace remat::cost {

double NodeTimes::link_seconds(const graph::LinkTraffic& traffic) const {
  if (link_bytes_per_second <= 0) return 0.0;
  return static_cast<double>(traffic.messages) * link_latency_seconds + traffic.bytes / link_bytes_per_second;
}

double NodeTimes::data_link_seconds(const graph::LinkTraffic& traffic) const {
  if (data_link_bytes_per_second <= 0) return 0.0;
  return static_cast<double>(traffic.messages) * data_link_latency_seconds + traffic.bytes / data_link_bytes_per_second;
}

double NodeTimes::node_seconds(const graph::Node& n) const {
  auto it = seconds.find(n.name);
  if (it != seconds.end()) return it->second;
  return (flops_per_second > 0 ? n.flops / flops_per_second : 0.0) + link_seconds(n.forward_link);
}

double NodeTimes::node_link_seconds(const graph::Node& n) const {
  if (n.forward_link.none()) return 0.0;
  const auto it = seconds.find(n.name);
  return it != seconds.end() ? it->second : link_seconds(n.forward_link);
}

double NodeTimes::input_gather_seconds(const graph::BlockGraph& block) const {
  const auto it = seconds.find(graph::kInputGather);
  return it == seconds.end() ? link_seconds(block.input_gather()) : it->second;
}

namespace {

// A block's walk under the slots `dropped`, its input held whole or as this rank's share,
// the slots `offloaded` in host memory between its forward and its backward.
LayerCost simulate(const graph::BlockGraph& g, const graph::Lifetimes& lt, const Folds* folds, SlotMask dropped,
                   bool early_stop, const NodeTimes& times, const std::vector<double>& backward_times, bool backward,
                   bool input_sharded, SlotMask offloaded, double fetch_ahead = 0) {
  const std::vector<bool> keep = keep_flags(dropped);
  LayerCost lc = simulate(g, lt, folds, keep, early_stop, times, backward_times, backward,
                          input_sharded ? graph::InputHold::sharded : graph::InputHold::whole, offloaded, fetch_ahead);
  const int64_t away = g.offload_bytes(keep, offloaded, input_sharded);
  const int64_t table = g.kept_bytes(keep, input_sharded) - away;
  TORCH_INTERNAL_ASSERT(lc.kept == table && lc.host == away, "the walk keeps ", lc.kept, " bytes on the device and ",
                        lc.host, " in host memory but the slot table ", table, " and ", away);
  return lc;
}

}  // namespace

// The walk of a graph no plan applies to (the embedding, the loss head).
LayerCost simulate_kept(const graph::BlockGraph& g) {
  const graph::Lifetimes lt(g);
  return simulate(g, lt, nullptr, std::vector<bool>(kSlotCount, true), true, NodeTimes{},
                  std::vector<double>(g.nodes.size(), 0.0), /*backward=*/true);
}

struct LayerPricer::Prepared {
  const graph::BlockGraph& g;
  graph::Lifetimes lt;
  Folds folds;
  bool early_stop;
  NodeTimes times;
  std::vector<double> backward_times;
  Prepared(const graph::BlockGraph& block, bool early, NodeTimes t)
      : g(block),
        lt(block),
        folds(block, lt),
        early_stop(early),
        times(std::move(t)),
        backward_times(backward_seconds(block, lt, times)) {}
};

LayerPricer::LayerPricer(const graph::BlockGraph& block, bool early_stop, NodeTimes times)
    : p_(std::make_shared<const Prepared>(block, early_stop, std::move(times))) {}

LayerCost LayerPricer::price(SlotMask dropped, bool input_sharded, SlotMask offloaded, double fetch_ahead) const {
  return simulate(p_->g, p_->lt, &p_->folds, dropped, p_->early_stop, p_->times, p_->backward_times,
                  /*backward=*/true, input_sharded, offloaded, fetch_ahead);
}

LayerCost LayerPricer::forward(SlotMask dropped, bool input_sharded, SlotMask offloaded) const {
  return simulate(p_->g, p_->lt, &p_->folds, dropped, p_->early_stop, p_->times, p_->backward_times,
                  /*backward=*/false, input_sharded, offloaded);
}

LayerCost price_layer(const graph::BlockGraph& g, SlotMask dropped, bool early_stop, const NodeTimes& times,
                      bool input_sharded, SlotMask offloaded) {
  const graph::Lifetimes lt(g);
  return simulate(g, lt, nullptr, dropped, early_stop, times, backward_seconds(g, lt, times), /*backward=*/true,
                  input_sharded, offloaded);
}

}  // namespace remat::cost
