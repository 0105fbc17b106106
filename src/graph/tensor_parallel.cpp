// The tensor-parallel transform: one pass over a graph, re-adding each node at a rank's
// shapes, so shape inference, FLOPs and the allocation events of the split graph come
// from the ops themselves, as for any declared graph.
#include "remat/graph.h"
#include "remat/ops/common.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace remat::graph {
namespace {

bool listed(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

int64_t product(const std::vector<int64_t>& s, size_t n) {
  return std::accumulate(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n), int64_t{1}, std::multiplies<>());
}

// `size` split over tp ranks, refused with the node's name when it does not divide.
int64_t share(int64_t size, int64_t tp, const std::string& node, const char* what) {
  TORCH_CHECK(size % tp == 0, "Tensor parallelism over ", tp, " ranks splits the ", what, " of ", node, " (", size,
              ") into equal shares, but ", size, " is not a multiple of ", tp, "; choose parallel.tp dividing it.");
  return size / tp;
}

// The sizes of a view whose input `from` lost a factor tp in one dimension (`split_from`
// its sizes now): the view's dimension that starts where that one starts (the last such,
// when dimensions of size 1 make several start there). Heads are the outer factor of the
// features they merge into, so a rank's heads are a block of them.
std::vector<int64_t> view_share(const std::vector<int64_t>& from, const std::vector<int64_t>& split_from,
                                std::vector<int64_t> to, int64_t tp, const std::string& node) {
  size_t k = 0;
  while (k < from.size() && from[k] == split_from[k]) ++k;
  TORCH_INTERNAL_ASSERT(k < from.size(), "[tensor_parallel] ", node, " reads a split value of unchanged shape");
  const int64_t before = product(from, k);
  for (size_t m = to.size(); m-- > 0;) {
    if (product(to, m) == before) {
      to[m] = share(to[m], tp, node, "viewed dimension");
      return to;
    }
  }
  TORCH_CHECK(false, "[tensor_parallel] the view ", node, " mixes the split dimension with the ones before it");
}

// Ops that may read a rank's share of heads or features between the regions: they work
// per head or per element, so a share needs no other rank's part.
bool share_wise(const OpDef& o) {
  return &o == &op::view() || &o == &op::split() || &o == &op::rope() || &o == &op::attention() ||
         &o == &op::tiled_attention() || &o == &op::sdpa_attention() || &o == &op::gelu() || &o == &op::swiglu();
}

// Ops that may read a rank's share of the sequence positions between the regions: they
// work per position (norms, dropout, additions) or know which positions they hold.
bool position_wise(const OpDef& o) {
  return &o == &op::layernorm() || &o == &op::rmsnorm() || &o == &op::dropout() || &o == &op::residual() ||
         &o == &op::position_embedding();
}

// The vocabulary-parallel loss's forward (ops::cross_entropy_forward and the fused one's
// chunk_loss): per chunk of rows, three all-reduces of one statistic per row in the
// statistics' dtype, each its own collective (dist::Group::all_reduce): the row max, then
// the sums of exp and the target logits. Its backward runs none (the saved log-sum-exp is
// the whole vocabulary's already).
LinkTraffic loss_link(const TensorInfo& x, int64_t chunk, int64_t tp) {
  const int64_t rows = x.sizes.at(0);
  const int64_t row_bytes = static_cast<int64_t>(at::elementSize(ops::stats_dtype(x.dtype)));
  constexpr int64_t kStatistics = 3;
  LinkTraffic t;
  for (int64_t start = 0; start < rows; start += chunk) {
    const LinkTraffic one = LinkTraffic::all_reduce(std::min(chunk, rows - start) * row_bytes, tp);
    t.bytes += kStatistics * one.bytes;
    t.messages += kStatistics * one.messages;
  }
  return t;
}

// What each collective node sends, as src/ops/tensor_parallel.cpp runs them over Gloo:
// sums in float32 (a narrower tensor is reduced in a float32 copy), a reduce-scatter as an
// all-reduce of the whole tensor (Gloo in 1.13 has none), gathers in the tensor's own
// bytes; and the vocabulary-parallel loss's statistics.
void set_links(BlockGraph& g) {
  const auto summed = [&](int v) {
    const TensorInfo& t = g.values[static_cast<size_t>(v)].info;
    return t.numel() * static_cast<int64_t>(at::elementSize(t.dtype == at::kDouble ? at::kDouble : at::kFloat));
  };
  const auto bytes = [&](int v) { return g.values[static_cast<size_t>(v)].info.bytes(); };
  for (Node& n : g.nodes) {
    if (n.op == &op::tp_copy()) {
      n.backward_link = LinkTraffic::all_reduce(summed(n.outputs[0]), g.tp);
    } else if (n.op == &op::tp_reduce()) {
      n.forward_link = LinkTraffic::all_reduce(summed(n.inputs[0]), g.tp);
    } else if (n.op == &op::sp_gather()) {
      n.forward_link = LinkTraffic::gather(bytes(n.outputs[0]), g.tp);
      n.backward_link = LinkTraffic::all_reduce(summed(n.outputs[0]), g.tp);
    } else if (n.op == &op::sp_scatter()) {
      n.forward_link = LinkTraffic::all_reduce(summed(n.inputs[0]), g.tp);
      n.backward_link = LinkTraffic::gather(bytes(n.inputs[0]), g.tp);
    } else if ((n.op == &op::cross_entropy() || n.op == &op::fused_cross_entropy()) && n.attrs.sharded) {
      n.forward_link = loss_link(g.values[static_cast<size_t>(n.inputs[0])].info, n.attrs.chunk, g.tp);
    }
  }
}

}  // namespace

BlockGraph tensor_parallel(const BlockGraph& g, const TensorParallelPlan& plan, int64_t tp, bool sp) {
  if (tp == 1) return g;
  const bool has_slots = !g.slot(Slot::input).empty();
  // What a value holds on a rank: all of it, a share of its heads or features, (sequence
  // parallelism) its share of the positions, dimension 1, or all of it gathered from
  // those shares, a region's entry already (the gather's backward sums the ranks' parts).
  enum class Held { all, features, positions, gathered };
  std::vector<Held> held(g.values.size(), Held::all);
  const Value& input = g.values[static_cast<size_t>(g.input)];
  TensorInfo input_info = input.info;
  if (sp && !input.external) {  // the hidden states a block or the head starts from
    auto& T = input_info.sizes.at(1);
    T = share(T, tp, "the sequence", "positions");
    held[static_cast<size_t>(g.input)] = Held::positions;
  }
  Builder b(input_info, g.dtype, input.external);
  std::vector<int> vmap(g.values.size(), -1);
  vmap[static_cast<size_t>(g.input)] = b.input();
  for (int v : g.side_inputs) vmap[static_cast<size_t>(v)] = b.side_input(g.values[v].name, g.values[v].info);

  // Each split parameter's shard, from the node reading it.
  std::vector<Shard> shards(g.params.size());
  std::vector<bool> bias_moves(g.params.size(), false);  // a row linear's bias: added by its tp_reduce
  for (const Node& n : g.nodes) {
    if (listed(plan.column, n.name)) {
      // A fused projection is cut by the split that reads it: each part is split evenly.
      std::vector<int64_t> blocks;
      for (const Node& reader : g.nodes) {
        if (reader.op == &op::split() && reader.inputs[0] == n.outputs[0]) {
          for (int64_t h : reader.attrs.split_heads) blocks.push_back(h * reader.attrs.head_dim);
        }
      }
      for (int p : n.params) shards[static_cast<size_t>(p)] = {0, blocks};
    } else if (listed(plan.row, n.name)) {
      shards[static_cast<size_t>(n.params.at(0))] = {1, {}};
      if (n.params.size() == 2) bias_moves[static_cast<size_t>(n.params[1])] = true;
    } else if (listed(plan.vocab, n.name)) {
      shards[static_cast<size_t>(n.params.at(0))] = {0, {}};
    }
  }
  std::vector<int> pmap(g.params.size());
  for (size_t p = 0; p < g.params.size(); ++p) {
    std::vector<int64_t> sizes = g.params[p].sizes;
    if (shards[p].split()) {
      auto& d = sizes[static_cast<size_t>(shards[p].dim)];
      d = share(d, tp, g.params[p].name, "parameter");
      for (int64_t blk : shards[p].blocks) share(blk, tp, g.params[p].name, "fused parts");
    }
    pmap[p] = b.param(g.params[p].name, sizes, shards[p]);
  }
  const auto params_of = [&](const Node& n, bool with_moved_bias) {
    std::vector<int> out;
    for (int p : n.params) {
      if (with_moved_bias || !bias_moves[static_cast<size_t>(p)]) out.push_back(pmap[static_cast<size_t>(p)]);
    }
    return out;
  };
  // A rank applies a whole parameter to its positions only: its gradient is a part.
  const auto partial = [&](const std::vector<int>& ps) {
    for (int p : ps) {
      if (!shards[static_cast<size_t>(p)].split()) b.partial(pmap[static_cast<size_t>(p)]);
    }
  };
  // The sizes of the split graph's value v with dimension 1 multiplied (gathered) or
  // divided (scattered) by tp; `node` names the reader in a refusal.
  const auto positions = [&](int v, bool gather, const std::string& node) {
    Attrs a;
    a.sizes = b.info(v).sizes;
    a.sizes.at(1) = gather ? a.sizes[1] * tp : share(a.sizes[1], tp, node, "positions");
    return a;
  };

  // The copy (tp_copy) or gathered value (sp_gather) through which a value enters the
  // column-parallel regions, once per value.
  std::map<int, int> entries;
  const auto enter = [&](int v, const std::string& reader) {
    auto [it, fresh] = entries.emplace(v, -1);
    if (!fresh) return it->second;
    const int from = vmap[static_cast<size_t>(v)];
    if (held[static_cast<size_t>(v)] == Held::positions) {
      it->second = b.add1(reader + "_sp_gather", op::sp_gather(), {from}, {}, positions(from, true, reader));
    } else {
      it->second = b.add1(reader + "_tp_copy", op::tp_copy(), {from});
    }
    return it->second;
  };
  for (const Node& n : g.nodes) {
    std::vector<int> in;
    bool reads_split = false, reads_positions = false;
    for (int v : n.inputs) {
      in.push_back(vmap[static_cast<size_t>(v)]);
      reads_split = reads_split || held[static_cast<size_t>(v)] == Held::features;
      reads_positions = reads_positions || held[static_cast<size_t>(v)] == Held::positions;
    }
    Attrs a = n.attrs;
    std::vector<int> out;
    Held out_held = Held::all;
    const bool loss = n.op == &op::cross_entropy() || n.op == &op::fused_cross_entropy();
    if (listed(plan.column, n.name) || (loss && listed(plan.vocab, n.name))) {
      // A column-parallel linear, or a vocabulary-parallel loss (hidden rows, targets): the
      // input enters through a tp_copy, or is gathered from the ranks' positions.
      TORCH_CHECK(held[static_cast<size_t>(n.inputs[0])] != Held::features, "[tensor_parallel] ", n.name,
                  " reads a split value");
      if (held[static_cast<size_t>(n.inputs[0])] != Held::gathered) in[0] = enter(n.inputs[0], n.name);
      a.sharded = loss;
      out = b.add(n.name, *n.op, in, params_of(n, true), a);
      out_held = loss ? Held::all : Held::features;
    } else if (listed(plan.row, n.name) || listed(plan.vocab, n.name)) {
      // A row-parallel linear, or a vocabulary-parallel embedding (each rank looks up its
      // rows): a partial sum over the ranks, summed (at this rank's positions, with sp).
      const bool row = listed(plan.row, n.name);
      TORCH_CHECK(!row || reads_split, "[tensor_parallel] the row-parallel ", n.name, " reads no split value");
      a.sharded = !row;
      const int part = b.add1(n.name, *n.op, in, params_of(n, !row), a);
      std::vector<int> bias;
      if (row && n.params.size() == 2) bias.push_back(pmap[static_cast<size_t>(n.params[1])]);
      if (sp) {
        out = {b.add1(n.name + "_sp_scatter", op::sp_scatter(), {part}, bias, positions(part, false, n.name))};
        out_held = Held::positions;
        if (row && n.params.size() == 2) partial({n.params[1]});
      } else {
        out = {b.add1(n.name + "_tp_reduce", op::tp_reduce(), {part}, bias)};
      }
    } else if (reads_split) {
      TORCH_CHECK(share_wise(*n.op), "[tensor_parallel] ", n.name, " (", n.op->kind(), ") reads a rank's share of ",
                  "heads or features, but has no rule for it; only views, splits, rotations, attention and "
                  "elementwise activations may sit between a column- and a row-parallel linear.");
      if (n.op == &op::view()) {
        a.from = b.info(in[0]).sizes;
        a.sizes = view_share(n.attrs.from, a.from, n.attrs.sizes, tp, n.name);
      } else if (n.op == &op::split()) {
        for (auto& h : a.split_heads) h = share(h, tp, n.name, "heads");
      } else if (n.op == &op::attention() || n.op == &op::tiled_attention()) {
        a.sharded = true;
      }
      out = b.add(n.name, *n.op, in, params_of(n, true), a);
      out_held = Held::features;
    } else if (reads_positions && n.op == &op::view()) {
      // A view that merges the positions into rows (the loss head's): it views them all.
      in[0] = enter(n.inputs[0], n.name);
      out = b.add(n.name, *n.op, in, {}, a);
      out_held = Held::gathered;
    } else if (reads_positions) {
      TORCH_CHECK(position_wise(*n.op), "[tensor_parallel] ", n.name, " (", n.op->kind(), ") reads a rank's share of ",
                  "the sequence positions (parallel.sp), but has no rule for it; only norms, dropout, residual "
                  "additions and position embeddings may sit between the tensor-parallel regions.");
      a.sharded = n.op == &op::position_embedding();
      out = b.add(n.name, *n.op, in, params_of(n, true), a);
      out_held = Held::positions;
      partial(n.params);
    } else {
      if (n.op == &op::dropout_mask()) {
        // A mask takes the shape of the value its dropout applies to: this rank's positions.
        for (const Node& reader : g.nodes) {
          if (reader.op != &op::dropout() || reader.inputs.at(1) != n.outputs[0]) continue;
          const int x = reader.inputs[0];
          a.sharded = held[static_cast<size_t>(x)] == Held::positions;
          if (a.sharded) a.sizes = b.info(vmap[static_cast<size_t>(x)]).sizes;
        }
      }
      out = b.add(n.name, *n.op, in, params_of(n, true), a);
    }
    TORCH_INTERNAL_ASSERT(out.size() == n.outputs.size(), "[tensor_parallel] ", n.name, " changed its outputs");
    for (size_t i = 0; i < out.size(); ++i) {
      vmap[static_cast<size_t>(n.outputs[i])] = out[i];
      held[static_cast<size_t>(n.outputs[i])] = out_held;
    }
  }

  const int output = vmap[static_cast<size_t>(g.output)];
  const auto on_ranks = [&](BlockGraph out) {
    out.tp = tp;
    out.sp = sp;
    set_links(out);
    return out;
  };
  if (!has_slots) return on_ranks(b.finish_kept(output));
  std::vector<std::vector<int>> slots(kSlotCount);
  for (int s = 0; s < kSlotCount; ++s) {
    for (int v : g.slots[static_cast<size_t>(s)]) {
      slots[static_cast<size_t>(s)].push_back(vmap[static_cast<size_t>(v)]);
      const auto it = entries.find(v);
      if (it == entries.end()) continue;
      if (held[static_cast<size_t>(v)] != Held::positions) {
        // A tp_copy of a slot's value is that memory, read by the column linears' backward.
        slots[static_cast<size_t>(s)].push_back(it->second);
        continue;
      }
      // A gathered value has its own slot, so that a plan may keep the shard and gather again.
      const Slot pair = static_cast<Slot>(s) == Slot::attn_qkv_in ? Slot::attn_gathered
                        : static_cast<Slot>(s) == Slot::mlp_fc_in ? Slot::mlp_gathered
                                                                  : Slot::input;
      TORCH_INTERNAL_ASSERT(pair != Slot::input, "[tensor_parallel] no slot pairs with ",
                            slot_name(static_cast<Slot>(s)), " for the gathered ", g.values[v].name);
      slots[static_cast<size_t>(pair)].push_back(it->second);
      b.gathered(vmap[static_cast<size_t>(v)], it->second);
    }
  }
  for (int s = 0; s < kSlotCount; ++s) b.slot(static_cast<Slot>(s), slots[static_cast<size_t>(s)]);
  return on_ranks(b.finish(output));
}

// A shard's blocks (the whole dimension when it names none).
std::vector<int64_t> blocks_of(const Shard& shard, int64_t whole) {
  return shard.blocks.empty() ? std::vector<int64_t>{whole} : shard.blocks;
}

at::Tensor take_part(const at::Tensor& full, const Shard& shard, int64_t tp, int64_t rank) {
  if (!shard.split() || tp == 1) return full;
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t blk : blocks_of(shard, full.size(shard.dim))) {
    parts.push_back(full.narrow(shard.dim, start + rank * (blk / tp), blk / tp));
    start += blk;
  }
  return at::cat(parts, shard.dim);
}

at::Tensor join_parts(const at::Tensor& gathered, const Shard& shard, int64_t tp) {
  if (!shard.split() || tp == 1) return gathered;
  const int64_t per_rank = gathered.size(shard.dim) / tp;
  std::vector<at::Tensor> pieces;
  int64_t within = 0;  // where a block's part starts inside each rank's part
  for (int64_t blk : blocks_of(shard, gathered.size(shard.dim))) {
    for (int64_t r = 0; r < tp; ++r) pieces.push_back(gathered.narrow(shard.dim, r * per_rank + within, blk / tp));
    within += blk / tp;
  }
  return at::cat(pieces, shard.dim);
}

}  // namespace remat::graph
