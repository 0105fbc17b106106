// The op interface: what the block graph (remat/graph.h) knows of an op. Each op is an
// OpDef (src/ops/X.cpp, next to its typed X_forward/X_backward): it runs its kernels,
// infers its output shapes, counts its FLOPs, says which of its inputs and outputs its
// backward reads, and declares the allocations its forward and backward make on a backend
// (the simulator replays those instead of running kernels).
#pragma once

#include "remat/config.h"
#include "remat/ops/common.h"
#include "remat/ops/dropout.h"
#include "remat/ops/rope.h"
#include "remat/ops/tiled_attention.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace remat::dist {
class Group;
}

namespace remat::graph {

/// A tensor known by its description only: what shape inference, the simulator and the
/// allocation events work with.
struct TensorInfo {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  /// Element strides of a strided view (a slice of a fused projection); empty when
  /// contiguous. Ops whose kernels copy such an input declare that copy.
  std::vector<int64_t> strides;
  bool contiguous() const { return strides.empty(); }
  int64_t numel() const;
  int64_t bytes() const;
  /// The same description at other sizes (contiguous).
  TensorInfo with_sizes(std::vector<int64_t> s) const { return {std::move(s), dtype, {}}; }
  /// Whether reshape(to) of this tensor is a view (else it copies), as ATen decides.
  bool reshape_is_view(const std::vector<int64_t>& to) const;
};

/// Attributes of a node; each op reads the fields it needs.
struct Attrs {
  double eps = 0.0;                                     ///< norms
  double p = 0.0;                                       ///< dropout probability (dropout mask, attention)
  ops::AttentionTiles tiles;                            ///< tiled attention: query and key positions per tile
  ops::DropoutSite site = ops::DropoutSite::embedding;  ///< which dropout key
  std::vector<int64_t> sizes;                           ///< view, dropout mask: the output's sizes
  std::vector<int64_t> from;                            ///< view: the input's sizes
  std::vector<int64_t> split_heads;                     ///< split: the heads of each part (views [B, T, heads, D])
  int64_t head_dim = 0;                                 ///< split
  int64_t chunk = 0;                                    ///< cross_entropy: tokens per chunk of logits
  /// Set by the tensor-parallel transform: the op holds this rank's share of a dimension
  /// its RunContext's `tp` group splits (attention: heads; embedding, loss: vocabulary
  /// rows; under sequence parallelism, dropout masks and position embeddings: sequence
  /// positions, dimension 1), rank r the r-th equal part.
  bool sharded = false;
};

/// What a forward or backward allocates, in order, as the simulator replays it.
/// `out(i)` is the op's i-th result (forward: output i; backward: input gradient i) taking
/// new memory; `temp(bytes)` a temporary that lives until `release(handle)`.
class Events {
 public:
  /// Events of the kernels of `device`: an op whose CUDA kernels allocate otherwise than its
  /// CPU ones (sdpa) declares each.
  explicit Events(at::DeviceType device = at::kCPU) : device_(device) {}
  at::DeviceType device() const { return device_; }
  struct Event {
    enum class Kind { out, temp, release } kind;
    int64_t handle = 0;  ///< temp, release: the temporary
    int64_t index = 0;   ///< out: the result
    int64_t bytes = 0;   ///< temp
  };
  void out(int64_t index) { ev_.push_back({Event::Kind::out, -1, index, 0}); }
  int64_t temp(int64_t bytes) {
    ev_.push_back({Event::Kind::temp, next_, 0, bytes});
    return next_++;
  }
  void release(int64_t handle) { ev_.push_back({Event::Kind::release, handle, 0, 0}); }
  const std::vector<Event>& list() const { return ev_; }

 private:
  at::DeviceType device_;
  std::vector<Event> ev_;
  int64_t next_ = 0;
};

/// The allocations of a gather over the tensor-parallel group (ops::gather_positions,
/// ops::gather_elements) into result `index` of `whole` bytes: the ranks' parts (one
/// buffer each, as many bytes as the result together), Gloo's flat receive buffer while
/// the collective runs, then their concatenation.
void all_gather_events(Events& e, int64_t whole, int64_t index);

/// What a collective sends between the tensor-parallel ranks, per rank, as a ring runs it
/// (an all-gather or reduce-scatter of a whole tensor of B bytes over t ranks: t - 1
/// messages of B/t each; an all-reduce is a reduce-scatter then an all-gather, twice
/// that). The cost model prices it at a link rate where no measured time is at hand.
struct LinkTraffic {
  double bytes = 0;      ///< sent by each rank
  int64_t messages = 0;  ///< ring steps, each paying the link's latency once
  /// An all-gather (or reduce-scatter) of a tensor of `whole` bytes over `ranks`.
  static LinkTraffic gather(int64_t whole, int64_t ranks);
  /// An all-reduce of a tensor of `whole` bytes over `ranks`.
  static LinkTraffic all_reduce(int64_t whole, int64_t ranks);
  bool none() const { return messages == 0; }
};

/// Everything a node's kernels need besides tensors.
struct RunContext {
  ops::DropoutKey key(ops::DropoutSite site) const;
  uint64_t seed = 0, step = 0, microbatch = 0;
  int64_t first_row = 0;  ///< StepContext::first_row
  int64_t layer = 0;
  bool train = true;  ///< false: dropout off
  at::Device device = at::kCPU;
  const ops::RopeTables* rope = nullptr;  ///< rotation tables covering the sequence (rope)
  /// The tensor-parallel group sharded ops and collectives run over; null: one rank.
  dist::Group* tp = nullptr;
  /// How a backward's ops put their parameters' gradients: written by the step's first
  /// microbatch (OpDef::writes_grads), added by the others.
  ops::GradInto grads = ops::GradInto::add;
  int tp_rank() const;
  int tp_size() const;
};

/// What an op means to the tensor-parallel transform (tensor_parallel): which share of a
/// value a rank may hand it between the regions the plan's linears open and close.
enum class TensorParallel {
  /// Reads whole values only: a share reaching it is refused. Linears and embeddings are
  /// split by the plan's names instead; the collectives are the transform's own.
  whole,
  /// Works per head or per feature (activations, rotations, attention, splits): reads a
  /// rank's share of the heads or features between a column- and a row-parallel linear.
  share_wise,
  /// Works per position (norms, dropout, additions, position embeddings): reads a rank's
  /// share of the sequence positions (sequence parallelism) between the regions.
  position_wise,
  /// Moves no data (a view): views a share of heads or features as a share, but merges
  /// positions into rows only once they are gathered (the loss head's rows).
  view,
  /// A loss over the vocabulary: split by the plan's vocab names, it reads whole rows
  /// through a copy as a column-parallel linear does, and its result is whole.
  vocab_loss,
};

/// One op as the graph sees it. Implementations live beside the op's typed functions.
class OpDef {
 public:
  virtual ~OpDef() = default;
  /// The op kind the store counts and the trace shows ("linear"); empty for views, which
  /// move no data and are not counted as ops.
  virtual const char* kind() const = 0;
  /// Output descriptions from the inputs' (params: the parameters'). Refuses bad shapes.
  virtual std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& params,
                                        const Attrs& a) const = 0;
  /// Forward FLOPs.
  virtual double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& params,
                       const Attrs& a) const = 0;
  /// Which inputs, and which outputs, the backward reads (the values a node saves).
  virtual std::vector<bool> saves_inputs(const Attrs& a, size_t n) const { return std::vector<bool>(n, false); }
  virtual std::vector<bool> saves_outputs(const Attrs& a, size_t n) const { return std::vector<bool>(n, false); }
  /// Output i shares the memory of input view_of(i) (views), or -1.
  virtual int view_of(size_t output) const { return -1; }
  /// Backward: input gradient i is output gradient grad_alias(i) itself, or -1 (new memory).
  virtual int grad_alias(size_t input) const { return -1; }
  /// The name of output i in tables ("mean"); null: its index.
  virtual const char* output_name(size_t output) const { return nullptr; }
  /// Whether output i is named after parameter i (its module: "q_proj" for
  /// "self_attn.q_proj.weight") rather than after the node: one output per weight.
  virtual bool outputs_named_by_params() const { return false; }
  /// Whether input i receives a gradient (ids and masks do not).
  virtual bool differentiable(size_t input) const { return true; }
  /// Whether the backward writes its parameters' whole gradients when RunContext::grads says
  /// so; one that adds into some rows only (an embedding's) needs them zeroed before a step.
  virtual bool writes_grads() const { return true; }

  virtual std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& params,
                                          const Attrs& a, const RunContext& ctx) const = 0;
  /// `saved_in`/`saved_out`: the inputs and outputs, defined where saves_* says so.
  /// Accumulates parameter gradients into `grads` (same order as params); returns one
  /// gradient per input (undefined for non-differentiable ones).
  virtual std::vector<at::Tensor> backward(const std::vector<at::Tensor>& grad_out,
                                           const std::vector<at::Tensor>& saved_in,
                                           const std::vector<at::Tensor>& saved_out,
                                           const std::vector<at::Tensor>& params, std::vector<at::Tensor*>& grads,
                                           const Attrs& a, const RunContext& ctx) const = 0;
  /// Allocations of the forward (outputs that are not views, temporaries) on the CPU.
  virtual void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& params,
                              const std::vector<TensorInfo>& out, const Attrs& a) const = 0;
  /// Allocations of the backward (input gradients not aliased, temporaries) on the CPU.
  virtual void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& params,
                               const std::vector<TensorInfo>& out, const Attrs& a) const = 0;

  /// What the op means to the tensor-parallel transform; each op declares it.
  virtual TensorParallel tensor_parallel() const = 0;
  /// The attributes of a node that reads a rank's share (share_wise, position_wise, view):
  /// `in` its inputs as the rank holds them, of `tp` ranks; `node` names it in a refusal.
  virtual Attrs on_share(const Attrs& a, const std::vector<TensorInfo>& in, int64_t tp, const std::string& node) const {
    return a;
  }
  /// What the collectives of the forward and of the backward send (Node::forward_link)
  /// over `tp` ranks; none for an op that runs none.
  virtual LinkTraffic forward_link(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& out,
                                   const Attrs& a, int64_t tp) const {
    return {};
  }
  virtual LinkTraffic backward_link(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& out,
                                    const Attrs& a, int64_t tp) const {
    return {};
  }
};

/// The op definitions (src/ops/*.cpp); each a singleton. A new op is its file and a line
/// in op::all (src/ops/registry.cpp).
namespace op {
const OpDef& layernorm();
const OpDef& rmsnorm();
const OpDef& linear();
/// One input through several weights without biases (q/k/v, gate/up), one output each.
const OpDef& linears();
const OpDef& attention();
const OpDef& tiled_attention();
const OpDef& sdpa_attention();
/// The attention op a configuration asks for (model.attention); throws on `auto`, which
/// names none until resolved.
const OpDef& attention(Attention kind);
const OpDef& dropout_mask();
const OpDef& dropout();
const OpDef& residual();
const OpDef& gelu();
const OpDef& swiglu();
const OpDef& rope();
const OpDef& view();
const OpDef& split();
const OpDef& embedding();
const OpDef& position_embedding();
const OpDef& cross_entropy();
const OpDef& fused_cross_entropy();
const OpDef& tp_copy();
const OpDef& tp_reduce();
const OpDef& sp_gather();
const OpDef& sp_scatter();
/// The loss op a configuration asks for (model.loss_head).
const OpDef& loss(LossHead head);
/// Every op definition (src/ops/registry.cpp), for tests that must cover each one.
std::vector<const OpDef*> all();
}  // namespace op

}  // namespace remat::graph
