// The walk of one block: forward (keeping by the plan), recompute of dropped values and
// backward, written once over a backend. The engine's backend runs the ops' kernels on
// tensors (src/model/transformer.h); the cost model's backend replays the ops' declared
// allocations on byte counters (src/plan/cost.cpp). Both release every value at the same
// point of the same walk, so the simulated peak is the engine's by construction.
//
// A backend B provides:
//   using Tensor;                                   at::Tensor or a simulated buffer
//   std::vector<Tensor> forward(int node, const std::vector<Tensor>& in, bool recompute);
//   std::vector<Tensor> backward(int node, const std::vector<Tensor>& grad_out,
//                                const std::vector<Tensor>& saved_in, const std::vector<Tensor>& saved_out);
//   Tensor add(const Tensor& a, const Tensor& b);   gradient fan-in
//   void dropped(int value, const Tensor& t);       a value of a dropped slot dies in the forward
//   void refilled(Slot s, const std::vector<Tensor>& ts);  a dropped slot is whole again
//   template <class F> void recompute(F&& f);      runs a recompute (pool, trace, store)
//   bool early_stop() const;
//   Tensor shard(const Tensor& whole);              this rank's share of a kept input
//   Tensor gather(const Tensor& share);             the whole input from every rank's share
//   M offload(const std::vector<Tensor>& group);  starts copying values sharing memory to host
//   M fetch(const std::vector<Tensor>& group);    and back to the device
//     (M has `tensors`, the copies, and `ticket`: copies run in the order they started)
//   void await(uint64_t ticket);                  the copy `ticket` and those before it are done
#pragma once

#include "remat/graph.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>

namespace remat::graph {

inline bool defined(const at::Tensor& t) { return t.defined(); }
template <class P>
bool defined(const std::shared_ptr<P>& p) {
  return p != nullptr;
}

/// Where each value dies, derived from the graph alone.
struct Lifetimes {
  std::vector<int> last_forward_reader;        ///< per value: last node reading it, -1: none
  std::vector<int> last_backward_reader;       ///< per value: lowest node whose backward reads it
  std::vector<std::vector<int>> grad_readers;  ///< per value: nodes it feeds a gradient from, ascending
  std::vector<bool> runs_backward;             ///< per node: whether any output carries a gradient
  explicit Lifetimes(const BlockGraph& g);
};

/// How a kept block input is held between the forward and the backward (LayerPlan::input_sharded).
enum class InputHold { whole, sharded };

template <class B>
class BlockRun {
 public:
  using T = typename B::Tensor;

  /// `keep`: per Slot, whether the forward keeps it; `training`: false keeps nothing and
  /// records nothing (inference); `hold`: sharded keeps the input (when kept) as this
  /// rank's share from its last forward reader on, until restore; `offloaded`: the slots
  /// whose memory waits in host memory from the forward's end until restore. A group of
  /// them starts its copy to host memory once its values are all produced, and the
  /// forward's end awaits them all; restore starts the copies back, the group the
  /// backward reads first first, and each is awaited where the backward first reads it.
  BlockRun(const BlockGraph& g, const Lifetimes& lt, std::vector<bool> keep, bool training = true,
           InputHold hold = InputHold::whole, SlotMask offloaded = {})
      : g_(g),
        lt_(lt),
        keep_(std::move(keep)),
        training_(training),
        hold_(hold),
        vals_(g.values.size()),
        missing_(g.values.size(), false),
        slot_missing_(kSlotCount, 0) {
    TORCH_INTERNAL_ASSERT(hold_ == InputHold::whole || g_.input_shardable(),
                          "a sharded block input needs tensor parallelism without sequence parallelism");
    if (training_ && !offloaded.empty()) order_copies(offloaded);
  }

  /// The forward from the block input (and the graph's side inputs, in order);
  /// `recompute` marks a re-execution (uniform chunks).
  T forward(B& b, T x, bool recompute = false, std::vector<T> side = {}) {
    TORCH_INTERNAL_ASSERT(side.size() == g_.side_inputs.size(), "the graph takes ", g_.side_inputs.size(),
                          " side inputs, given ", side.size());
    vals_[g_.input] = std::move(x);
    for (size_t k = 0; k < side.size(); ++k) vals_[g_.side_inputs[k]] = std::move(side[k]);
    start_offloads(b, -1);
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      const Node& n = g_.nodes[i];
      {
        std::vector<T> in;
        for (int v : n.inputs) in.push_back(vals_[v]);
        std::vector<T> out = b.forward(static_cast<int>(i), in, recompute);
        for (size_t j = 0; j < out.size(); ++j) vals_[n.outputs[j]] = std::move(out[j]);
      }
      start_offloads(b, static_cast<int>(i));
      for (int v : n.inputs) {
        if (lt_.last_forward_reader[v] == static_cast<int>(i)) release_forward(b, v);
      }
      for (int v : n.outputs) {
        if (lt_.last_forward_reader[v] < 0) release_forward(b, v);
      }
    }
    if (!groups_.empty()) {
      b.await(last_ticket_);
      for (size_t k = 0; k < groups_.size(); ++k) move(groups_[k], std::exchange(copies_[k], {}));
      on_host_ = true;
    }
    return std::exchange(vals_[g_.output], T());
  }

  /// The backward from the output gradient; returns the input gradient.
  T backward(B& b, T dy) {
    restore(b);
    std::vector<T> grads(g_.values.size());
    std::vector<std::vector<T>> parts(g_.values.size());
    grads[g_.output] = std::move(dy);
    for (int i = static_cast<int>(g_.nodes.size()) - 1; i >= 0; --i) {
      if (!lt_.runs_backward[i]) continue;
      const Node& n = g_.nodes[i];
      const auto si = n.op->saves_inputs(n.attrs, n.inputs.size());
      const auto so = n.op->saves_outputs(n.attrs, n.outputs.size());
      std::vector<int> need;
      for (size_t j = 0; j < n.inputs.size(); ++j) {
        if (si[j]) need.push_back(n.inputs[j]);
      }
      for (size_t j = 0; j < n.outputs.size(); ++j) {
        if (so[j]) need.push_back(n.outputs[j]);
      }
      ensure(b, need);
      for (int v : need) ready(b, v);
      std::vector<T> gin;
      {
        std::vector<T> gout, in(n.inputs.size()), out(n.outputs.size());
        for (int v : n.outputs) gout.push_back(std::exchange(grads[v], T()));
        for (size_t j = 0; j < n.inputs.size(); ++j) {
          if (si[j]) in[j] = vals_[n.inputs[j]];
        }
        for (size_t j = 0; j < n.outputs.size(); ++j) {
          if (so[j]) out[j] = vals_[n.outputs[j]];
        }
        gin = b.backward(i, gout, in, out);
      }
      for (int v : need) {
        if (lt_.last_backward_reader[v] == i) vals_[v] = T();
      }
      for (size_t j = 0; j < n.inputs.size(); ++j) {
        const int v = n.inputs[j];
        if (!n.op->differentiable(j) || !defined(gin[j])) continue;
        const auto& readers = lt_.grad_readers[v];
        auto& p = parts[v];
        p.resize(readers.size());
        p[std::find(readers.begin(), readers.end(), i) - readers.begin()] = std::exchange(gin[j], T());
        // Complete once its first reader (the last backward) delivered: summed in forward
        // reader order, whatever order the backward visits them in.
        if (readers.front() != i) continue;
        T sum = std::move(p[0]);
        for (size_t k = 1; k < p.size(); ++k) {
          if (defined(p[k])) sum = defined(sum) ? b.add(sum, p[k]) : p[k];
          p[k] = T();
        }
        p.clear();
        grads[v] = std::move(sum);
      }
    }
    settle(b);
    return std::exchange(grads[g_.input], T());
  }

  /// Starts bringing the offloaded memory back to the device, the group the backward reads
  /// first first; nothing if none is away. restore's first step, which a prefetch
  /// (schedule::Kind::fetch) takes earlier, alone.
  void start_fetch(B& b) {
    if (!on_host_) return;
    for (const size_t k : fetch_order_) {
      auto m = b.fetch(take(groups_[k]));
      move(groups_[k], std::move(m.tensors));
      tickets_[k] = m.ticket;
      pending_[k] = true;
    }
    on_host_ = false;
  }

  /// start_fetch, and makes a kept input held as this rank's share whole again (the
  /// backward's first step, and a chunk recompute's before it reads the input).
  void restore(B& b) {
    start_fetch(b);
    if (!input_is_share_) return;
    vals_[g_.input] = b.gather(vals_[g_.input]);
    input_is_share_ = false;
  }

  /// Awaits every copy back that restore started.
  void settle(B& b) {
    for (size_t k = 0; k < groups_.size(); ++k) {
      if (pending_[k]) await_through(b, tickets_[k]);
    }
  }

  /// Values the plan dropped and no recompute has refilled yet, per slot.
  bool missing(Slot s) const { return slot_missing_[static_cast<size_t>(s)] > 0; }
  /// The current handle of value v (kept or recomputed), for the chunk recompute (after
  /// restore and settle).
  const T& value(int v) const {
    TORCH_INTERNAL_ASSERT(group_of_.empty() || group_of_[v] < 0 || !pending_[group_of_[v]],
                          "a value read while its copy back to the device may still run");
    return vals_[v];
  }
  /// Every value held on the device now: after the forward, what the layer keeps there
  /// for its backward.
  std::vector<T> held() const {
    std::vector<bool> away(vals_.size(), false);
    if (on_host_) {
      for (const auto& group : groups_) {
        for (int v : group) away[v] = true;
      }
    }
    std::vector<T> out;
    for (size_t v = 0; v < vals_.size(); ++v) {
      if (defined(vals_[v]) && !away[v]) out.push_back(vals_[v]);
    }
    return out;
  }

 private:
  // The offloaded slots' groups (BlockGraph::offload_groups), when each starts its copy to
  // host memory and the order the copies back start in.
  void order_copies(SlotMask offloaded) {
    groups_ = g_.offload_groups(keep_, offloaded, hold_ == InputHold::sharded);
    const size_t n = groups_.size();
    group_of_.assign(g_.values.size(), -1);
    produced_by_.assign(n, -1);
    std::vector<int> first_read(n, -1);  // the highest node reading the group: the backward's first
    for (size_t k = 0; k < n; ++k) {
      for (int v : groups_[k]) {
        group_of_[v] = static_cast<int>(k);
        produced_by_[k] = std::max(produced_by_[k], g_.values[v].producer);
      }
    }
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      for (const auto* vs : {&g_.nodes[i].inputs, &g_.nodes[i].outputs}) {
        for (int v : *vs) {
          if (group_of_[v] >= 0) first_read[group_of_[v]] = static_cast<int>(i);
        }
      }
    }
    for (size_t k = 0; k < n; ++k) fetch_order_.push_back(k);
    std::stable_sort(fetch_order_.begin(), fetch_order_.end(),
                     [&](size_t a, size_t c) { return first_read[a] > first_read[c]; });
    copies_.resize(n);
    tickets_.assign(n, 0);
    pending_.assign(n, false);
  }

  // Starts the copies to host memory of the groups whose last value node `i` produced (-1:
  // the block's inputs); the values stay until the forward's end awaits them.
  void start_offloads(B& b, int i) {
    for (size_t k = 0; k < groups_.size(); ++k) {
      if (produced_by_[k] != i) continue;
      std::vector<T> ts;
      for (int v : groups_[k]) ts.push_back(vals_[v]);
      auto m = b.offload(ts);
      copies_[k] = std::move(m.tensors);
      last_ticket_ = m.ticket;
    }
  }

  // Awaits the copy back of value v's group, if it may still run.
  void ready(B& b, int v) {
    if (group_of_.empty() || group_of_[v] < 0 || !pending_[group_of_[v]]) return;
    await_through(b, tickets_[group_of_[v]]);
  }
  void await_through(B& b, uint64_t ticket) {
    b.await(ticket);
    for (size_t k = 0; k < groups_.size(); ++k) {
      if (tickets_[k] <= ticket) pending_[k] = false;
    }
  }

  // The group's values, released from the run (the backend's copy replaces them).
  std::vector<T> take(const std::vector<int>& group) {
    std::vector<T> ts;
    for (int v : group) ts.push_back(std::exchange(vals_[v], T()));
    return ts;
  }
  void move(const std::vector<int>& group, std::vector<T> ts) {
    for (size_t k = 0; k < group.size(); ++k) vals_[group[k]] = std::move(ts[k]);
  }

  // A value's last forward reader ran: kept values stay, dropped ones are recorded and freed.
  void release_forward(B& b, int v) {
    if (v == g_.output) return;
    // A saved value in no slot belongs to a graph without a plan: always kept.
    if (training_ && g_.kept(v, keep_)) {
      if (v == g_.input && hold_ == InputHold::sharded) {
        vals_[v] = b.shard(vals_[v]);
        input_is_share_ = true;
      }
      return;
    }
    if (training_ && g_.saved[v]) {
      missing_[v] = true;
      ++slot_missing_[g_.slot_of[v]];
      b.dropped(v, vals_[v]);
    }
    vals_[v] = T();
  }

  // Recomputes the missing values among `need` (whole slots), as the backward slice from
  // the values still held (early stop) or as the whole block forward.
  void ensure(B& b, const std::vector<int>& need) {
    std::vector<int> want;
    for (int v : need) {
      if (!missing_[v]) continue;
      for (int u : g_.slots[g_.slot_of[v]]) {
        if (missing_[u] && std::find(want.begin(), want.end(), u) == want.end()) want.push_back(u);
      }
    }
    if (want.empty()) return;
    std::vector<bool> run(g_.nodes.size(), !b.early_stop());
    if (b.early_stop()) {
      while (!want.empty()) {
        const int v = want.back();
        want.pop_back();
        const int p = g_.values[v].producer;
        TORCH_INTERNAL_ASSERT(p >= 0, "a recompute needs the block input, which the plan did not keep");
        if (defined(vals_[v]) || run[p]) continue;
        run[p] = true;
        for (int u : g_.nodes[p].inputs) {
          if (!defined(vals_[u])) want.push_back(u);
        }
      }
    }
    b.recompute([&] { rerun(b, run); });
  }

  void rerun(B& b, const std::vector<bool>& run) {
    std::vector<int> last(g_.values.size(), -1);  // last reader among the re-run nodes
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      if (!run[i]) continue;
      for (int u : g_.nodes[i].inputs) last[u] = static_cast<int>(i);
    }
    std::vector<T> fresh(g_.values.size());
    std::vector<Slot> complete;
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      if (!run[i]) continue;
      const Node& n = g_.nodes[i];
      {
        std::vector<T> in;
        for (int u : n.inputs) {
          if (!defined(fresh[u])) ready(b, u);
          in.push_back(defined(fresh[u]) ? fresh[u] : vals_[u]);
        }
        std::vector<T> out = b.forward(static_cast<int>(i), in, true);
        for (size_t j = 0; j < out.size(); ++j) {
          const int v = n.outputs[j];
          if (missing_[v]) {
            missing_[v] = false;
            vals_[v] = out[j];
            const int s = g_.slot_of[v];
            if (--slot_missing_[s] == 0) complete.push_back(static_cast<Slot>(s));
          }
          if (last[v] > static_cast<int>(i)) fresh[v] = std::move(out[j]);
        }
      }
      for (int u : n.inputs) {
        if (last[u] == static_cast<int>(i)) fresh[u] = T();
        // A shard kept only to be gathered again (BlockGraph::gathered) goes once it was.
        const int whole = g_.gathered[u];
        if (whole >= 0 && !g_.saved[u] && !missing_[whole]) vals_[u] = T();
      }
      for (Slot s : complete) {
        std::vector<T> ts;
        for (int u : g_.slot(s)) ts.push_back(vals_[u]);
        b.refilled(s, ts);
      }
      complete.clear();
    }
  }

  const BlockGraph& g_;
  const Lifetimes& lt_;
  std::vector<bool> keep_;
  bool training_;
  InputHold hold_;
  bool input_is_share_ = false;
  std::vector<std::vector<int>> groups_;  // BlockGraph::offload_groups
  std::vector<int> group_of_;             // per value: its group, -1: none
  std::vector<int> produced_by_;          // per group: the node producing its last value, -1: an input
  std::vector<size_t> fetch_order_;       // groups by when the backward first reads them
  std::vector<std::vector<T>> copies_;    // per group: its copies to host memory, until the forward's end
  std::vector<uint64_t> tickets_;         // per group: its copy back's
  std::vector<bool> pending_;             // per group: its copy back may still run
  uint64_t last_ticket_ = 0;
  bool on_host_ = false;
  std::vector<T> vals_;
  std::vector<bool> missing_;
  std::vector<int> slot_missing_;
};

}  // namespace remat::graph
