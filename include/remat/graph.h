// The block graph: a transformer block declared once, as data, from which the engine's
// forward, recompute and backward and the cost model's simulation are all derived.
//
// A graph holds values (tensors described by shape and dtype, each produced by one node
// or given as the block input), nodes (one op each: inputs, outputs, parameters,
// attributes) in forward order, and the slot table: which values each slot of
// remat/plan.h holds for the backward. An architecture writes its block with a Builder,
// one line per op, in the order of its forward (see src/model/gpt2.cpp).
//
// Each node runs one op, an OpDef (remat/ops/op.h).
#pragma once

#include "remat/config.h"
#include "remat/layout.h"
#include "remat/ops/op.h"
#include "remat/plan.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace remat::graph {

/// The time profile's name for the all-gather of a block input kept as a share per rank
/// (LayerPlan::input_sharded): timed as recompute work, beside the nodes.
inline constexpr const char* kInputGather = "input.all_gather";

struct Value {
  std::string name;
  TensorInfo info;
  int producer = -1;  ///< node index; -1: an input
  int alias = -1;     ///< the value whose memory this one shares (a view), or -1
  /// Given and held by the caller (token ids, targets): the graph never owns its memory.
  bool external = false;
};

/// How the tensor-parallel transform split a parameter over the ranks: along `dim` (-1:
/// every rank holds it whole), as consecutive blocks of the whole dimension (`blocks`,
/// their sizes; empty: one block), each split evenly, rank r holding the r-th part of
/// every block (a fused q/k/v projection: its share of each of the three).
struct Shard {
  int dim = -1;
  std::vector<int64_t> blocks;
  bool split() const { return dim >= 0; }
};

/// Rank `rank`'s part of `full` (a parameter of its whole shape) under `shard`, of `tp` ranks.
at::Tensor take_part(const at::Tensor& full, const Shard& shard, int64_t tp, int64_t rank);
/// The whole parameter from every rank's part concatenated along the shard's dimension in
/// rank order (what an all-gather returns): the inverse of take_part.
at::Tensor join_parts(const at::Tensor& gathered, const Shard& shard, int64_t tp);

struct Param {
  std::string name;            ///< relative to the layer ("ln_1.weight")
  std::vector<int64_t> sizes;  ///< this rank's (its share, when split)
  Shard shard;
  /// Sequence parallelism: a parameter every rank holds whole but applies to its own
  /// positions only (norms, biases after a reduce-scatter), so each rank's gradient is a
  /// part of the gradient, summed over the tensor-parallel group after the backward.
  bool partial = false;
};

struct Node {
  std::string name;  ///< unique in the block: the trace's and the time profile's name
  const OpDef* op = nullptr;
  std::vector<int> inputs, outputs, params;
  Attrs attrs;
  double flops = 0;
  /// The collectives of the tensor-parallel transform's nodes (tp_copy, tp_reduce,
  /// sp_gather, sp_scatter) and of the vocabulary-parallel loss (its rows' statistics) as
  /// remat runs them over Gloo: what the forward and the backward send, as the op
  /// declares it (OpDef::forward_link). None for every other op.
  LinkTraffic forward_link, backward_link;
};

/// One block at fixed shapes: everything the executor and the simulator walk. The same
/// structure holds the parts outside the blocks (the embedding, the loss head), whose
/// graphs have no slots: no plan applies to them and their forward keeps every value a
/// backward reads.
struct BlockGraph {
  std::vector<Value> values;
  std::vector<Node> nodes;
  std::vector<Param> params;
  at::ScalarType dtype = at::kFloat;    ///< the compute dtype: parameters and activations
  at::DeviceType device = at::kCPU;     ///< whose kernels its nodes' events follow (Events::device)
  int input = -1;                       ///< the block input [B, T, C] (the embedding's: token ids)
  std::vector<int> side_inputs;         ///< further inputs from the caller (the loss head's targets)
  int output = -1;                      ///< the block output (the loss head's: the loss)
  std::vector<std::vector<int>> slots;  ///< per Slot: its values
  /// Per value: the slot holding it, or -1 (values no backward reads).
  std::vector<int> slot_of;
  /// Per value: whether some node's backward reads it.
  std::vector<bool> saved;
  /// Per value: the value gathered from it over the tensor-parallel group (sequence
  /// parallelism), or -1. Such a shard is kept, though no backward reads it, when its
  /// slot is kept and the gathered value's slot is dropped: the recompute gathers again.
  std::vector<int> gathered;
  /// The tensor-parallel ranks the graph runs on (tensor_parallel's `tp`), and whether
  /// with sequence parallelism.
  int64_t tp = 1;
  bool sp = false;

  const std::vector<int>& slot(Slot s) const { return slots[static_cast<size_t>(s)]; }
  int64_t output_bytes() const { return values[static_cast<size_t>(output)].info.bytes(); }
  /// Bytes of the distinct memory a slot's values hold (views counted once).
  int64_t slot_bytes(Slot s) const;
  /// Whether the forward keeps value v when `keep` (per Slot) says which slots it keeps:
  /// a saved value of a kept slot, or a shard kept to gather again (`gathered`).
  bool kept(int v, const std::vector<bool>& keep) const;
  /// Bytes of the distinct memory of the values kept under `keep` (views counted once);
  /// `input_sharded`: the kept input counts as one rank's share (LayerPlan::input_sharded).
  int64_t kept_bytes(const std::vector<bool>& keep, bool input_sharded = false) const;
  /// What a forward keeping by `keep` moves to host memory for the slots `offloaded`
  /// (LayerPlan::offloaded): the kept values grouped by the memory they share (a value and
  /// its views, by root), each group whose kept values are all in offloaded slots; a group
  /// with a value of another kept slot stays on the device. `input_sharded`: the input is
  /// held as a share and stays. In value order.
  std::vector<std::vector<int>> offload_groups(const std::vector<bool>& keep, SlotMask offloaded,
                                               bool input_sharded = false) const;
  /// Bytes of the memory offload_groups moves (each group's root's).
  int64_t offload_bytes(const std::vector<bool>& keep, SlotMask offloaded, bool input_sharded = false) const;
  /// Whether the block input can be kept as a share per tensor-parallel rank: tensor
  /// parallelism without sequence parallelism, and the input's elements divide evenly.
  bool input_shardable() const;
  /// The all-gather that makes the block input whole again from its shares (kept
  /// LayerPlan::input_sharded): its elements' bytes, gathered over the tp ranks.
  LinkTraffic input_gather() const;
  /// Bytes of the distinct memory of every value a backward reads, the caller's inputs
  /// included (what a graph without slots keeps from its forward to its backward).
  int64_t saved_bytes() const;
  /// Whether some node runs `op`.
  bool uses(const OpDef& op) const;
  /// The value owning `v`'s memory (itself unless it is a view).
  int root(int v) const;
  /// FLOPs of one forward, from the nodes.
  double forward_flops() const;
  std::vector<TensorInfo> infos(const std::vector<int>& ids) const;
};

/// Writes a block: one call per op, in forward order.
class Builder {
 public:
  /// `dtype`: the compute dtype (parameters'); `external`: the caller holds the input.
  Builder(TensorInfo input, at::ScalarType dtype, bool external = false);
  int input() const { return 0; }
  /// A further input the caller gives and holds (the loss head's targets).
  int side_input(const std::string& name, TensorInfo info);
  int param(const std::string& name, std::vector<int64_t> sizes, Shard shard = {});
  /// Adds a node; returns its outputs' value ids (named "<node>", or "<node>.<output name>"
  /// when it has several).
  std::vector<int> add(const std::string& name, const OpDef& op, std::vector<int> inputs, std::vector<int> params = {},
                       Attrs attrs = {});
  /// The same, for a node of one output.
  int add1(const std::string& name, const OpDef& op, std::vector<int> inputs, std::vector<int> params = {},
           Attrs attrs = {});
  /// Dropout of `x` at site `site` with probability p: a key-only mask node and an apply
  /// node; p == 0 adds nothing and returns x. Returns {output, mask or -1}.
  std::pair<int, int> dropout(const std::string& name, int x, double p, ops::DropoutSite site);
  /// The mean cross-entropy of the logits hidden [..., C] x weight^T against the targets
  /// (a side input, one int64 per row of hidden), `chunk` rows of logits at a time, by the
  /// `head` variant's op. Returns the loss.
  int loss(int hidden, int weight, int64_t chunk, LossHead head);
  /// A view of x (contiguous) as `sizes`.
  int view(const std::string& name, int x, std::vector<int64_t> sizes);
  /// Assigns values to a slot (once per slot).
  void slot(Slot s, std::vector<int> values);
  /// Records that `whole` is `shard` gathered over the tensor-parallel group.
  void gathered(int shard, int whole);
  /// Marks parameter `param` Param::partial.
  void partial(int param);
  const TensorInfo& info(int v) const { return g_.values.at(static_cast<size_t>(v)).info; }
  /// Checks the table (every saved value in exactly one slot, the input alone in
  /// Slot::input) and returns the graph.
  BlockGraph finish(int output);
  /// The graph of a part no plan applies to (no slots: the forward keeps what the
  /// backward reads).
  BlockGraph finish_kept(int output);

 private:
  // Sets the output and marks the values some backward reads.
  void mark_saved(int output);

  BlockGraph g_;
  std::vector<bool> assigned_;
  std::vector<std::pair<int, int>> gathers_;  // shard, gathered value
};

/// Which nodes of an architecture's graphs tensor parallelism splits, by name (as
/// torchtitan's plan names modules): a per-architecture table beside its declaration.
struct TensorParallelPlan {
  /// Linears whose output features (weight rows, bias) are split: each rank computes its
  /// share of the heads or hidden features, up to a row-parallel linear.
  std::vector<std::string> column;
  /// Linears whose input features (weight columns) are split: each rank's product is a
  /// partial sum, summed over the ranks (the bias added once, after the sum).
  std::vector<std::string> row;
  /// Embeddings and losses whose vocabulary rows are split.
  std::vector<std::string> vocab;
};

/// `g` as one of `tp` ranks runs it (Megatron's tensor parallelism): the split nodes'
/// parameters hold a rank's share (Param::shard); a tp_copy node enters each
/// column-parallel region (and feeds a vocabulary-parallel loss), a tp_reduce node ends
/// each row-parallel one (and follows a vocabulary-parallel embedding); the ops between
/// them work on a rank's heads as each declares (OpDef::tensor_parallel, its attributes
/// from OpDef::on_share: attention marked `sharded`), and the slots hold the same roles
/// at the smaller shapes. Refuses, naming the node and the size, a split that does not
/// divide evenly or an op between the regions that declares no such share. `tp` == 1
/// returns `g`.
///
/// With `sp` (Megatron's sequence parallelism) the values outside the regions hold a
/// rank's share of the sequence (dimension 1): an sp_gather enters each region in place
/// of the tp_copy (its gathered value in the slot attn.gathered or mlp.gathered, paired
/// with the shard's), an sp_scatter ends it in place of the tp_reduce; the position-wise
/// ops between the regions (norms, dropout, residuals, position embeddings) run on the
/// rank's positions (their parameters Param::partial).
BlockGraph tensor_parallel(const BlockGraph& g, const TensorParallelPlan& plan, int64_t tp, bool sp = false);

/// The block of `cfg`'s architecture at [batch, seq] in `dtype` (src/model/{gpt2,llama}.cpp),
/// as a rank of `layout` runs it (tensor_parallel with the architecture's plan over
/// layout.tp ranks; with layout.sp, the block's input and output a rank's positions).
BlockGraph block_graph(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype,
                       const Layout& layout = {});
/// What runs before the first block: token ids [batch, seq] (the caller's) to its input.
BlockGraph embed_graph(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype,
                       const Layout& layout = {});
/// What runs after the last block: the final norm and, for `chunk` > 0, the mean loss over
/// the targets (a side input, [batch * seq] int64) with logits `chunk` tokens at a time;
/// for `chunk` == 0 the output is the final hidden states (generation reads them).
BlockGraph head_graph(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype, int64_t chunk,
                      const Layout& layout = {});

/// Renders the derived table of a block (value, shape, dtype, bytes, slot, producer).
std::string explain(const BlockGraph& g);

}  // namespace remat::graph
