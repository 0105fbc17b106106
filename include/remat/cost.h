// The cost model: what a training step holds and does under an activation plan, computed
// from shapes alone, without allocating.
//
// A block is described once per architecture as allocation programs that follow the
// engine's code line by line: which tensors its forward allocates and frees, which slots
// its backward asks for, in which order it frees them, and, for each group of forward ops
// a recompute can re-execute (a "node"), what that group allocates. The simulator walks
// these programs with a plan and returns the peak of live bytes at every point of the
// step, the bytes every layer keeps, and the recompute work (ops, FLOPs, time). Every
// size comes from the ops' own byte reports and shapes; nothing is sampled.
#pragma once

#include "remat/config.h"
#include "remat/plan.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace remat::cost {

/// One step of an allocation program.
struct Event {
  enum class Kind {
    alloc,  ///< tensor `name` of `bytes` becomes live
    free,   ///< tensor `name` dies; a slot name frees every tensor of that slot
    need,   ///< backward asks for slot `name` (a recompute when it was dropped)
  };
  Kind kind;
  std::string name;
  int64_t bytes = 0;
};

/// A group of forward ops a recompute re-executes together, producing slots.
struct Node {
  std::string name;
  std::vector<std::string> inputs;   ///< slots read (asked for first, recursively)
  std::vector<std::string> outputs;  ///< slots produced; those still kept are transient
  /// When set, the node produces its outputs only while this slot is missing; otherwise
  /// the next node listing the same output is used (GPT-2's mid-block residual).
  std::string only_if_missing;
  std::vector<std::string> kinds;    ///< op kinds, as the store counts them
  double flops = 0;
  std::vector<Event> events;         ///< allocations; tensors of no produced slot die at the end
  /// A cheaper way to produce slots another node also produces; not part of one plain
  /// block forward (the nodes without this flag are, exactly once each).
  bool alternate = false;
};

/// One transformer block at fixed shapes.
struct BlockProgram {
  /// Tensors of each slot of remat/plan.h plus "input" (the block input): (name, bytes).
  std::map<std::string, std::vector<std::pair<std::string, int64_t>>> slots;
  std::vector<Event> forward;    ///< from the kept input to the output "out" (slots stay live)
  std::vector<Event> backward;   ///< "dy" live on entry; ends with the input gradient "dx" live
  std::vector<Node> nodes;       ///< what a recompute can re-execute, in forward order
  std::vector<std::string> forward_kinds;  ///< every op kind of one block forward
  double forward_flops = 0;      ///< one block forward
  double backward_flops = 0;     ///< one block backward (about twice the matmul FLOPs)
  int64_t out_bytes = 0;         ///< the block output / input gradient
  int64_t slot_bytes(const std::string& slot) const;
};

/// The fixed costs of a step around the blocks.
struct StepShape {
  int64_t batch = 1;
  int64_t seq = 1;
  int64_t grad_accum = 1;
  int64_t ce_chunk = 1024;
  at::ScalarType dtype = at::kFloat;  ///< activations (compute dtype)
  int64_t resident = 0;               ///< bytes the caller holds besides the model (StaticBytes::resident)
};

/// Bytes held outside the blocks' activations.
struct StaticBytes {
  int64_t params = 0;          ///< float32 masters
  int64_t grads = 0;           ///< float32 accumulators
  int64_t optimizer = 0;       ///< AdamW's two moments
  int64_t compute_copies = 0;  ///< parameters cast to the compute dtype (bfloat16 runs)
  int64_t batch = 0;           ///< token ids and targets of one microbatch
  int64_t resident = 0;        ///< held by the caller throughout (a trainer's token corpus)
  /// Scalars and small reductions (losses, counts, min/max checks) the programs do not
  /// list one by one: a few KiB measured; this bound keeps a budget plan under its budget.
  int64_t small = 16 * 1024;
  int64_t total() const { return params + grads + optimizer + compute_copies + batch + resident + small; }
};

/// The parts of a step outside the blocks.
struct StepConstants {
  StaticBytes statics;
  int64_t embed_peak = 0;      ///< embedding forward: live bytes above the statics
  int64_t embed_saved = 0;     ///< kept by the embedding for its backward
  int64_t head_peak = 0;       ///< loss head: live above statics, embedding and kept layers
  int64_t head_saved = 0;      ///< kept by the final norm and loss between forward and backward
  int64_t embed_backward = 0;  ///< embedding backward: live above statics and embedding
  int64_t optimizer = 0;       ///< optimizer step: live above the statics
};

/// Times of the nodes, seconds per execution at the step's shapes (a measured profile),
/// or empty to price them by FLOPs.
struct NodeTimes {
  std::map<std::string, double> seconds;  ///< by node name
  double flops_per_second = 0;           ///< fallback rate for nodes without a time
  double node_seconds(const Node& n) const;
};

/// A layer's plan priced: what it keeps and what its backward recomputes and peaks at.
struct LayerCost {
  int64_t kept = 0;            ///< bytes kept from its forward to its backward
  int64_t forward_peak = 0;    ///< highest live bytes of its forward, its kept input included
  int64_t backward_peak = 0;   ///< highest live bytes of its backward, "dy" and kept slots included
  int64_t recomputed_bytes = 0;
  double recompute_flops = 0;
  double recompute_seconds = 0;
  std::map<std::string, int64_t> ops;  ///< re-executed op kinds
};

/// The whole step under one plan.
struct StepPrediction {
  StaticBytes statics;
  int64_t embedding = 0;        ///< saved by the embedding
  int64_t head = 0;             ///< saved by the final norm and loss head
  std::vector<LayerCost> layers;
  int64_t kept_activations = 0; ///< embedding + blocks + head at the end of the forward
  int64_t peak = 0;             ///< highest live bytes of the step
  std::string peak_at;          ///< where: "forward of layer 3", "backward of layer 1", ...
  int64_t working_set = 0;      ///< peak - statics - activations kept at that moment
  double recompute_flops = 0;   ///< per step (all microbatches)
  double recompute_seconds = 0; ///< per step
  std::map<std::string, int64_t> ops;  ///< per step
  int64_t recomputed_bytes = 0; ///< per microbatch
};

/// The block program of `cfg`'s architecture at [batch, seq] in `dtype`.
BlockProgram block_program(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype);

/// Prices one layer's slot choice. `dropped`: slots recomputed; `early_stop` as the store's.
LayerCost price_layer(const BlockProgram& block, const std::set<std::string>& dropped, bool early_stop,
                      const NodeTimes& times);

/// Bytes of parameters, gradients, optimizer state and batch for `cfg` (vocab_size set).
StaticBytes static_bytes(const ModelConfig& cfg, const StepShape& shape);

/// The embedding, loss head and optimizer of `cfg` at `shape`.
StepConstants step_constants(const ModelConfig& cfg, const StepShape& shape);

/// Simulates a whole training step (every microbatch, then the optimizer) under `plan`.
StepPrediction predict_step(const ModelConfig& cfg, const StepShape& shape, const ActivationPlan& plan,
                            bool early_stop, const NodeTimes& times);

}  // namespace remat::cost
