// The cost model: what a training step holds and does under an activation plan, computed
// from shapes alone, without allocating.
//
// A block is its graph (remat/graph.h), the one the engine runs. The simulator walks that
// graph with the engine's own walk (src/graph/walk.h) on byte counters, each op replaying
// the allocations it declares beside its kernels; the step walk below runs the step's
// actions so, and returns the peak of live bytes at every point of the step, the bytes
// every layer keeps, and the recompute work (ops, FLOPs, time). Every size comes from the
// ops' shape inference; nothing is sampled.
#pragma once

#include "remat/config.h"
#include "remat/graph.h"
#include "remat/layout.h"
#include "remat/plan.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace remat::memory {
struct AllocatorEvent;  // remat/caching_allocator.h
struct AllocatorRules;
}  // namespace remat::memory

namespace remat::cost {

/// The sizes of one rank's step: its microbatches, their tokens and dtype, the device whose
/// kernels run them. How the ranks share the work is a Layout (remat/layout.h), passed
/// beside it.
struct StepShape {
  int64_t batch = 1;
  int64_t seq = 1;
  int64_t grad_accum = 1;
  int64_t ce_chunk = 1024;
  at::ScalarType dtype = at::kFloat;  ///< activations (compute dtype)
  at::DeviceType device = at::kCPU;   ///< where the kernels run: the ops' events are theirs (graph::Events)
};

/// The block of `cfg` as a rank of `layout` runs it at `shape` (graph::block_graph at its
/// sizes, dtype and tensor-parallel share), its events those of `shape.device`'s kernels.
graph::BlockGraph shape_block(const ModelConfig& cfg, const StepShape& shape, const Layout& layout);

/// ZeRO-1's partition of the optimizer over `ranks` data-parallel ranks: for each
/// parameter, given its elements in model order, the rank that keeps its AdamW moments and
/// updates it. Whole parameters, largest first, each to the rank with the fewest elements
/// so far (the lowest such rank on a tie): every rank computes the same partition, and the
/// ranks' loads depend on the multiset of sizes only, so the cost model gets them from the
/// graphs' parameters in any order. The busiest rank holds at most the mean plus the
/// largest parameter.
std::vector<int> zero_owners(const std::vector<int64_t>& numels, int64_t ranks);

/// Bytes held outside the blocks' activations.
struct StaticBytes {
  int64_t params = 0;          ///< float32 masters
  int64_t grads = 0;           ///< float32 accumulators
  int64_t optimizer = 0;       ///< AdamW's two moments (the busiest rank's share under ZeRO-1)
  int64_t compute_copies = 0;  ///< parameters cast to the compute dtype (bfloat16 runs)
  int64_t batch = 0;           ///< token ids (embedding) and targets (head) of the microbatches in flight
  /// ZeRO-3: the largest part's weights gathered in the compute dtype, live while that part
  /// runs only, so in the working set and not in total().
  int64_t gathered = 0;
  /// Scalars and small reductions (losses, counts, min/max checks) the simulation does not
  /// list one by one: none were live at the measured peaks (one process, data, tensor and
  /// pipeline parallel); this bound keeps a budget plan under its budget if some are.
  int64_t small = 4 * 1024;
  int64_t total() const { return params + grads + optimizer + compute_copies + batch + small; }
};

/// The parts of a step outside the blocks.
struct StepConstants {
  StaticBytes statics;
  int64_t embed_peak = 0;      ///< embedding forward: live bytes above the statics
  int64_t embed_saved = 0;     ///< kept by the embedding for its backward
  int64_t head_peak = 0;       ///< loss head: live above statics, embedding and kept layers
  int64_t head_saved = 0;      ///< kept by the final norm and loss between forward and backward
  int64_t embed_backward = 0;  ///< embedding backward: live above statics and embedding
  int64_t optimizer = 0;       ///< optimizer step: live above the statics (the largest
                               ///< parameter's update temporaries; the ZeRO-1 exchange of
                               ///< the updated parameters is in place and adds none)
};

struct OtherAttention;

/// Times of the nodes, seconds per execution at the step's shapes (a measured profile),
/// or empty to price them by FLOPs and their collectives by the bytes they send.
struct NodeTimes {
  std::map<std::string, double> seconds;  ///< by node name
  double flops_per_second = 0;            ///< fallback rate for nodes without a time
  /// The tensor-parallel links, for collectives without a measured time: bytes a rank
  /// sends per second and seconds per ring step (graph::LinkTraffic); a rate of 0 prices
  /// them at 0. In the unit of `flops_per_second`'s seconds (`remat plan`'s FLOPs).
  double link_bytes_per_second = 0, link_latency_seconds = 0;
  /// The data-parallel group's links, alike (DataParallelTraffic), in the same unit.
  double data_link_bytes_per_second = 0, data_link_latency_seconds = 0;
  /// Offloaded slots (LayerPlan::offloaded): bytes a second copied between the device and
  /// host memory, each way, and seconds each copied storage takes besides (measured:
  /// train/profile.h's measure_host_copy); a rate of 0 prices the copies at 0. In the unit
  /// of `flops_per_second`'s seconds.
  double host_bytes_per_second = 0, host_copy_latency_seconds = 0;
  /// Whether those copies run beside the compute, on copy engines of their own (CUDA's), or
  /// take the cores the compute runs on (the CPU's), which then waits for each whole.
  bool host_copies_overlap = true;
  /// Where they overlap: of each second a copy runs beside the compute, the share the
  /// compute loses, from 0 to below 1 (measured: train/profile.h's measure_host_copy).
  double host_copy_slowdown = 0;
  /// `bytes` in `storages` copied to host memory, or back.
  double host_copy_seconds(int64_t bytes, int64_t storages) const {
    if (host_bytes_per_second <= 0) return 0.0;
    return static_cast<double>(storages) * host_copy_latency_seconds +
           static_cast<double>(bytes) / host_bytes_per_second;
  }
  /// One microbatch's forward and backward, measured, of one layer and of the embedding
  /// and loss head together (a pipeline stage's parts: train/profile.h's probe); 0 when
  /// not measured, and then three times the forward nodes' times.
  double layer_pass_seconds = 0, ends_pass_seconds = 0;
  /// A forward of `n`: measured, else its FLOPs at flops_per_second plus its collective
  /// (Node::forward_link) at the link's rate.
  double node_seconds(const graph::Node& n) const;
  /// The part of node_seconds(n) spent in a collective, for the block nodes a recompute
  /// runs again: for the transform's collective nodes their measured time (a bias added
  /// after a sum included) or their link time; 0 for the others.
  double node_link_seconds(const graph::Node& n) const;
  /// The all-gather of `block`'s input kept as shares (graph::kInputGather): measured,
  /// else BlockGraph::input_gather() at the link's rate.
  double input_gather_seconds(const graph::BlockGraph& block) const;
  /// `traffic` at the link's rate: latency x messages + bytes / rate (0 without a rate).
  double link_seconds(const graph::LinkTraffic& traffic) const;
  /// `traffic` at the data-parallel links' rate, alike.
  double data_link_seconds(const graph::LinkTraffic& traffic) const;
  /// The attention op a plan may run in some layers instead of the model's
  /// (LayerPlan::attention), with its own times; null: every layer runs the model's op.
  std::shared_ptr<const OtherAttention> other_attention;
};

/// The other attention op of a per-layer choice (model.attention = auto), priced from its
/// own time profile: a layer running it takes `pass_delta` seconds more (less, when
/// negative) for its forward and backward than with the model's op, and its recomputes
/// take `times`.
struct OtherAttention {
  Attention op = Attention::tiled;
  NodeTimes times;
  double pass_delta = 0;
};

/// A layer's plan priced: what it keeps and what its backward recomputes and peaks at.
struct LayerCost {
  int64_t kept = 0;           ///< bytes kept on the device from its forward to its backward
  int64_t host = 0;           ///< bytes it keeps in host memory meanwhile (LayerPlan::offloaded)
  int64_t host_storages = 0;  ///< the distinct storages those bytes are, each copied apart
  int64_t forward_peak = 0;   ///< highest live bytes of its forward, its kept input included
  int64_t backward_peak = 0;  ///< highest live bytes of its backward, "dy" and kept slots included
  int64_t recomputed_bytes = 0;
  double recompute_flops = 0;
  double recompute_seconds = 0;
  double recompute_link_seconds = 0;   ///< of recompute_seconds: the collectives it re-runs
  std::map<std::string, int64_t> ops;  ///< re-executed op kinds
  /// Its copies to host memory and back (NodeTimes::host_copy_seconds), one after another
  /// beside its compute, the time its compute waits for them, and the time it runs longer
  /// beside them (NodeTimes::host_copy_slowdown): the clock of the walk (graph::BlockRun)
  /// over its nodes' forward and backward times.
  double copy_seconds = 0, copy_wait_seconds = 0, copy_slowdown_seconds = 0;
  /// On that clock: how long its backward runs (its nodes, its recompute, its waits and
  /// slowdown), and when its last copy back ends, from its backward's start (0: before it).
  /// The layer below it, when it prefetches, starts its copies back after that end and has
  /// the rest of this backward to hide them behind.
  double backward_clock_seconds = 0, fetched_by_seconds = 0;
  /// What its copies add to its step: the waits and the slowdown.
  double copy_added_seconds() const { return copy_wait_seconds + copy_slowdown_seconds; }
};

/// Bytes of the flat gradient buffer each all-reduce of stages 0 and 1 sums (the last
/// bucket, from the buffer's start, may be less): few collectives for their latency not to
/// matter, small enough that the first starts early in an overlapped backward.
constexpr int64_t kGradientBucketBytes = int64_t{4} << 20;

/// What one rank of a stage sends over its data-parallel group in a step, by what the
/// trainer sums or gathers there (Layout::zero), each collective an all-reduce as it runs
/// them (Gloo's): none with one data-parallel rank. Nothing else runs meanwhile: stage 3's
/// gathers precede each part's pass, stage 2's sums follow it, the others follow the
/// backward (parallel.overlap_grad_reduce hides some behind the last microbatch's).
struct DataParallelTraffic {
  /// The gradients' sums and the loss's: after the step's backward, in buckets (stages 0
  /// and 1), or each part's after each of its backwards and a pipeline stage's tied table
  /// once (2 and 3).
  graph::LinkTraffic gradients;
  graph::LinkTraffic exchange;  ///< the updated parameters from their owners (stages 1 and 2)
  /// Each part's weights, in the compute dtype, before its forward, the embedding's before
  /// its backward, and the head's before a backward that does not follow its forward at
  /// once (schedule::Action::weights_kept) (stage 3).
  graph::LinkTraffic gathers;
  /// The gathers the plan adds, as it adds recompute: a layer's before its backward where
  /// it did not keep its weights from its forward (LayerPlan::weights_kept), and a uniform
  /// chunk's layers' before its recompute (stage 3).
  graph::LinkTraffic regathers;
  /// Every collective but the regathers, which the step's added time holds.
  graph::LinkTraffic fixed() const;
  graph::LinkTraffic total() const;
};
DataParallelTraffic data_parallel_traffic(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                                          const ActivationPlan& plan);

/// The whole step under one plan (of one pipeline stage: its layers, its ends).
struct StepPrediction {
  StaticBytes statics;
  int64_t first_layer = 0;        ///< the model's layer layers[0] is (StepShape::first_layer)
  int64_t embedding = 0;          ///< saved by the embedding
  int64_t head = 0;               ///< saved by the final norm and loss head
  std::vector<LayerCost> layers;  ///< the stage's, from first_layer
  int64_t kept_activations = 0;   ///< embedding + blocks + head at the end of one microbatch's forward
  int64_t peak = 0;               ///< highest live bytes of the step
  std::string peak_at;            ///< where: "forward of layer 3", "backward of layer 1", ...
  int64_t working_set = 0;        ///< peak - statics - activations kept at that moment
  /// ZeRO-3, at the peak: the gathered weights layers keep to their backward (counted in the
  /// activations kept), and those of the part running (counted in the working set).
  int64_t peak_kept_weights = 0, peak_running_weights = 0;
  double recompute_flops = 0;          ///< per step (all microbatches)
  double recompute_seconds = 0;        ///< per step
  double recompute_link_seconds = 0;   ///< per step: of recompute_seconds, the collectives re-run
  std::map<std::string, int64_t> ops;  ///< per step
  int64_t recomputed_bytes = 0;        ///< per microbatch
  int64_t host_peak = 0;               ///< the most bytes offloaded to host memory at once
  int64_t offloaded_bytes = 0;         ///< per step: bytes copied to host memory, and as many back
  double copy_seconds = 0;             ///< per step: those copies (LayerCost::copy_seconds)
  double copy_wait_seconds = 0;        ///< per step: the time the compute waits for them
  double copy_slowdown_seconds = 0;    ///< per step: the time it runs longer beside them
  /// Per step: what the copies add to it, the waits and the slowdown.
  double copy_added_seconds() const { return copy_wait_seconds + copy_slowdown_seconds; }
  /// Per step: the forward and backward time the layers running the other attention op
  /// (LayerPlan::attention) take beyond the model's op in them (OtherAttention::pass_delta).
  double attention_seconds = 0;
  DataParallelTraffic data_parallel;  ///< per step
  /// Per step, at the data-parallel links' rate: that traffic's fixed() part, and its regathers.
  double data_parallel_seconds = 0, regather_seconds = 0;
  /// Per step: what the plan adds to a step that recomputes nothing, runs the model's
  /// attention op, offloads nothing and keeps every layer's gathered weights.
  double added_seconds() const {
    return recompute_seconds + attention_seconds + copy_added_seconds() + regather_seconds;
  }
};

/// Prices one layer's slot choice. `dropped`: slots recomputed; `early_stop` as the store's;
/// `input_sharded`: LayerPlan::input_sharded (the block must be input_shardable);
/// `offloaded`: LayerPlan::offloaded. Replays every allocation each op declares, one by
/// one: the reference LayerPricer is held to.
LayerCost price_layer(const graph::BlockGraph& block, SlotMask dropped, bool early_stop, const NodeTimes& times,
                      bool input_sharded = false, SlotMask offloaded = {});

/// price_layer for many slot choices of one block: each node's declared allocations are
/// folded once (how far they rise above the live bytes, what they leave), so a price walks
/// the block's nodes rather than their events, which grow with the sequence (the math
/// attention declares some per block of query rows). Equal to price_layer. Holds `block`
/// by reference: it must outlive the pricer.
class LayerPricer {
 public:
  LayerPricer(const graph::BlockGraph& block, bool early_stop, NodeTimes times);
  /// `fetch_ahead`: seconds before its backward from which its copies back may run (a
  /// prefetch, ActivationPlan::prefetches); 0: they start with it.
  LayerCost price(SlotMask dropped, bool input_sharded = false, SlotMask offloaded = {}, double fetch_ahead = 0) const;
  /// The forward alone (forward_peak, kept and host; no backward_peak), its copies back
  /// priced as a chunk's recompute awaits them: at once.
  LayerCost forward(SlotMask dropped, bool input_sharded = false, SlotMask offloaded = {}) const;

 private:
  struct Prepared;
  std::shared_ptr<const Prepared> p_;
};

/// Bytes of parameters, gradients, optimizer state and batch of the stage `layout` places
/// this rank on, for `cfg` (vocab_size set; its attention op and loss head may still be
/// `auto`: the parameters do not depend on them).
StaticBytes static_bytes(const ModelConfig& cfg, const StepShape& shape, const Layout& layout);

/// The embedding, loss head and optimizer of `cfg` at `shape` on `layout`'s stage, each
/// run alone on the step walk's simulator: what the planner composes layer costs with.
StepConstants step_constants(const ModelConfig& cfg, const StepShape& shape, const Layout& layout);

// The step walk. One simulation of schedule::step for `layout`'s stage: each action runs
// the graph it concerns through the engine's block walk (graph::BlockRun) on the
// simulator, each microbatch's kept activations held from its forward to its backward,
// what the step holds throughout allocated tensor by tensor as the model and the trainer
// allocate it, and the update as AdamW runs it. Its bytes go to one of two ledgers:
// - the peak ledger (predict_step) counts bytes and prices time; a layer outside a uniform
//   chunk is priced once per distinct plan (LayerPricer) and held as its priced bytes, the
//   rest replays each node's folded events;
// - the allocator ledger (step_allocations) lists every allocation and free, each
//   declared event replayed, for the model of the caching allocator.
// Both see the same bytes: the allocator ledger's live bytes peak at the peak ledger's
// less what it counts outside the device's requests (StaticBytes::small),
// plus the BLAS workspace.

/// The peak ledger of a step under `plan` (one LayerPlan per layer of the model; a
/// pipeline stage reads its own, and none of its uniform chunks may begin below it), AdamW's
/// moments made (a step after the first). A layer whose plan names another attention op is
/// its graph with that op, priced by times.other_attention (required then).
StepPrediction predict_step(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                            const ActivationPlan& plan, bool early_stop, const NodeTimes& times);

/// The slots layer l's first forward drops: its plan's, or in a uniform chunk every
/// droppable slot and, but for the chunk's first layer, the input.
SlotMask first_forward_drops(const ActivationPlan& plan, int64_t l);

/// The allocator ledger of `steps` training steps of the stage, from a device holding
/// nothing: first what the step holds throughout (each parameter, the rotary tables, the
/// gradients' flat buffer, the token ids and targets in flight, a BLAS workspace of
/// `workspace` bytes), then per step the compute dtype's parameter copies, the actions,
/// the gradient norm's squares, and AdamW's moments (made at the first update) and its
/// denominators.
std::vector<memory::AllocatorEvent> step_allocations(const ModelConfig& cfg, const StepShape& shape,
                                                     const Layout& layout, const ActivationPlan& plan, bool early_stop,
                                                     int64_t steps, int64_t workspace);

/// What the CUDA caching allocator holds at its highest over a stage's first two steps
/// (the second has AdamW's moments from its start; later ones repeat it).
struct DeviceMemory {
  int64_t allocated_peak = 0;  ///< bytes of blocks handed out (requests rounded up)
  int64_t reserved_peak = 0;   ///< bytes of segments the allocator took from the device: what runs out
};

/// The highest allocated and reserved peaks over `stages` (zeros when empty).
DeviceMemory highest(const std::vector<DeviceMemory>& stages);

/// step_allocations of two steps replayed by the model of the caching allocator.
DeviceMemory predict_device_memory(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                                   const ActivationPlan& plan, bool early_stop, const memory::AllocatorRules& rules,
                                   int64_t workspace);

}  // namespace remat::cost
