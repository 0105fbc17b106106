// The planner: memory budgets in bytes become the fastest activation plan that fits, for
// any number of pipeline stages (one stage is a pipeline of one). It is the one door to
// planning: a plan within budgets, the prediction of any plan, the least budget, the
// memory/time frontier, and the sentence for budgets no plan fits.
//
// Per layer it prices every keep-set of the block's slots with the cost model (bytes
// kept, the peak of that layer's backward with its recompute, recompute time), with both
// attention ops where the times price the other one (model.attention = auto), under
// tensor parallelism without sequence parallelism each also with the block input kept as
// a share per rank (Megatron's distribute_saved_activations, priced by the measured
// all-gather), under ZeRO-3 each also with the layer's gathered weights kept to its
// backward or gathered again (priced at the data-parallel links), and keeps the Pareto
// frontier. Across layers a dynamic program over (bytes
// kept by the layers below, time) picks one frontier point per layer, or a uniform chunk
// of several layers, so that predicted time is least and every point of the step (each
// layer's forward and backward, the loss head, the optimizer) stays within the budget.
// The layers below a layer are what it stacks on, so the program walks them in order and
// the constraint of each layer is exact. With several stages the layers of each stage and
// every layer's choice are solved together (remat/pipeline.h) to minimise the slowest
// stage. It allocates nothing: an 8B model at 8k tokens plans on a laptop.
//
// With a host budget a kept slot may also wait in host memory between its layer's forward
// and backward (LayerPlan::offloaded), its copies priced at the times' host rate: the
// program then also carries the host bytes below each layer, so that the plan's offloaded
// bytes stay within the host budget. Where copies run beside the compute, the solved plan
// then prefetches each offloading layer's copies back during the backward of the layer
// above where the whole step's prediction is faster and still within the budget
// (LayerPlan::prefetch), layer by layer from the bottom.
//
// On a CUDA device (StepShape::device) a device budget holds the caching allocator's
// reserved bytes (remat/caching_allocator.h), which move in segments, not with the cost
// model's bytes: the plan is solved for a lower cost-model budget until it reserves few
// enough.
#pragma once

#include "remat/caching_allocator.h"
#include "remat/cost.h"
#include "remat/layout.h"
#include "remat/pipeline.h"

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace remat {

/// What a plan may hold, per rank, in bytes.
struct Budgets {
  int64_t device = 0;  ///< the device's bytes (on CUDA the caching allocator's reserved bytes)
  int64_t host = 0;    ///< host memory the offloaded slots may hold at once; 0: nothing offloaded
};

/// Thrown where budgets fit no plan: the sentence, and the least device budget that fits.
struct BudgetTooSmall : std::invalid_argument {
  BudgetTooSmall(const std::string& sentence, int64_t least) : std::invalid_argument(sentence), min_budget(least) {}
  int64_t min_budget;  ///< bytes: the minimum feasible budget (of every stage, pipelined)
};

struct PlannerOptions {
  bool early_stop = true;  ///< as the store runs recomputes
  int64_t max_chunk = 4;   ///< largest uniform chunk considered (1: none)
  /// Keep-set candidates per layer: every subset of the block's non-empty slots when
  /// empty, else exactly these (each a set of dropped slots; for tests and experiments).
  std::vector<SlotMask> candidates;
  /// Above this many partial plans per layer the program merges those whose kept bytes
  /// differ by less than budget / max_states (keeping the faster, which keeps more), so
  /// the plan still fits; exact below it. A pipeline's program merges alike
  /// (pipeline::Problem::max_states).
  int64_t max_states = 4096;
  /// The caching allocator's settings (run.expandable_segments), for a CUDA device.
  memory::AllocatorRules allocator;
  /// With sharded values, which layers may keep their gathered weights to their backward:
  /// each as the budget is best spent (automatic), none (always) or every one (never).
  Reshard reshard = Reshard::automatic;
};

/// The offload sets a layer's keep-set `dropped` is priced with under a host budget:
/// none, then its kept slots (the block input too, unless held as shares) one more at a
/// time, those whose copies add least to the step per byte (LayerCost::copy_added_seconds)
/// moved first (each offloaded alone, priced by `pricer`, a pricer of `block`), the largest
/// first among equals. A slot's copies hide behind the compute between its production and the
/// forward's end and between the backward's start and its first reader, so the block
/// input, written first and read last, usually leads.
std::vector<SlotMask> offload_sets(const graph::BlockGraph& block, const cost::LayerPricer& pricer, SlotMask dropped,
                                   bool input_sharded);

/// One priced keep-set of a layer.
struct LayerOption {
  SlotMask dropped;
  SlotMask offloaded;  ///< LayerPlan::offloaded
  cost::LayerCost cost;
  bool input_sharded = false;          ///< LayerPlan::input_sharded
  std::optional<Attention> attention;  ///< LayerPlan::attention: the other attention op, or unset
  bool weights_kept = false;           ///< LayerPlan::weights_kept (its weights in cost.kept)
  /// What the option adds to the step: its recompute, its host copies, with the other
  /// attention op the difference of its pass (cost::OtherAttention::pass_delta), and with
  /// sharded values not kept the gather again before its backward.
  double seconds = 0;
};

/// A point of the memory/time frontier.
struct FrontierPoint {
  int64_t peak = 0;
  double recompute_seconds = 0;  ///< with, per layer, the other attention op's pass difference (auto)
  std::string label;             ///< the policy, or "budget" for solved plans
};

/// A sweep of budgets (Planner::frontier).
struct Frontier {
  std::vector<FrontierPoint> points;  ///< Pareto-filtered, by peak
  int asked = 0;                      ///< budgets the sweep was to solve
  int solved = 0;                     ///< budgets solved before the time limit
  double seconds = 0;                 ///< the sweep's time
};

/// The order a sweep of `points` evenly spaced budgets is solved in, coarse to fine: the
/// two ends, then each gap's middle, level by level; every index once.
std::vector<int> sweep_order(int points);

/// A plan of every stage, predicted (one stage: the whole model).
struct PlanResult {
  ActivationPlan plan;                       ///< every layer of the model
  std::vector<int64_t> split;                ///< layers per stage
  std::vector<cost::StepPrediction> stages;  ///< each stage's step, by the step walk
  std::vector<double> stage_seconds;         ///< each stage's forward and backward of one microbatch
  int64_t bottleneck = 0;                    ///< the slowest stage (the first of equals)
  /// The schedule's time, (microbatches + stages - 1) x the bottleneck's (the optimizer
  /// step, which the stages run at once, is not in it): what the pipeline solver minimises.
  double schedule_seconds = 0;
  /// The step's microbatches through the stages, simulated (pipeline::simulate) with each
  /// stage's forward and backward; transfers and the optimizer are not in it.
  double simulated_seconds = 0;
  /// On a CUDA device, what its caching allocator holds at its highest on each stage (the
  /// allocator ledger replayed by its model); empty on the CPU and where a prediction asked
  /// for peaks alone (Ledgers::peak).
  std::vector<cost::DeviceMemory> device;
  int64_t peak() const;  ///< the highest stage peak
  /// The highest allocated and reserved peaks of `device` over the stages (zeros on the CPU).
  cost::DeviceMemory device_peak() const;
};

/// What a prediction replays: the peak ledger alone (the cost model's bytes and times), or
/// also the allocator ledger through the model of CUDA's caching allocator (PlanResult::device).
enum class Ledgers { peak, peak_and_allocator };

class Planner {
 public:
  /// Prices the block of `cfg` at `shape` on `layout` once; `times` (Prices::times, in
  /// seconds) price recompute and copies: measured nodes, or FLOPs at a rate, which the
  /// planner then weighs in FLOPs, so that one plan is chosen at any rate (a rate scales
  /// every time alike, but would round ties apart). Every time it answers is in seconds.
  /// `layout.split` fixes the layers per stage; empty, the planner chooses them for a
  /// budget and predicts the even split otherwise.
  Planner(const ModelConfig& cfg, const cost::StepShape& shape, const Layout& layout, const cost::NodeTimes& times,
          PlannerOptions options = {});

  /// The fastest plan whose every stage's predicted peak is within `budgets`, or nullopt;
  /// on `split` where given (layers per stage), else on the layout's. On CUDA the device
  /// budget holds the allocator ledger's reserved bytes, unless `ledgers` says peak (the
  /// cost model's bytes alone, as a comparison that needs no allocator may ask).
  std::optional<PlanResult> plan(const Budgets& budgets, const std::vector<int64_t>& split = {},
                                 Ledgers ledgers = Ledgers::peak_and_allocator) const;
  /// Predicts every stage of `plan`, on `split` (layout's split, or the even one, when empty):
  /// its peak ledger, and on CUDA its allocator ledger too unless `ledgers` says peak.
  PlanResult predict(const ActivationPlan& plan, const std::vector<int64_t>& split = {},
                     Ledgers ledgers = Ledgers::peak_and_allocator) const;
  /// With AdamW's state sharded over data-parallel ranks (Layout::zero_ranks() > 1), each
  /// data-parallel rank's predicted peak on every stage of `plan` on `split`, [rank][stage]:
  /// the ranks own different parameters, and predict() holds the busiest's. Ranks that own
  /// parameters of the same sizes on every stage are walked once. Empty without sharding.
  std::vector<std::vector<int64_t>> rank_peaks(const ActivationPlan& plan,
                                               const std::vector<int64_t>& split = {}) const;
  /// The smallest device budget any plan fits with `host` bytes of host budget (to the
  /// byte, as the cost model counts bytes).
  int64_t least_budget(int64_t host = 0) const;
  /// Solved plans from the least budget to the no-recompute peak, `points` budgets apart,
  /// Pareto-filtered. The budgets are solved coarse to fine (both ends, then the middle of
  /// each gap), and none is started once `seconds` have passed (0: no limit), so a long
  /// model's sweep is coarser rather than minutes long.
  Frontier frontier(int64_t host = 0, int points = 24, double seconds = 0) const;
  /// The sentence for budgets no plan fits (`given`: the device budget as the user wrote
  /// it): the least budget and what fills the least-memory plan's peak, or, on CUDA where
  /// the cost model's bytes fit, the caching allocator's reserved bytes of the closest plan.
  std::string explain_infeasible(const Budgets& budgets, const std::string& given) const;

  /// Predicted peak (the highest stage's, on the even or given split) with no recompute.
  int64_t none_peak() const;
  /// The block of the model's attention op.
  const graph::BlockGraph& block() const { return block_; }
  /// The per-layer frontier with `host` bytes of host budget (Pareto over kept bytes, the
  /// layer's highest point forward or backward, LayerOption::seconds and the bytes offloaded).
  std::vector<LayerOption> layer_frontier(int64_t host = 0) const;
  const Layout& layout() const { return layout_; }

 private:
  // The layer options a host budget admits: every option priced keeping all on the device,
  // with `host` > 0 (and a host copy rate) the offloading ones too; whether that budget can
  // bind (every layer's most offloading option together exceed it; else the programs
  // ignore the host bytes, which then cannot decide a plan).
  struct Options {
    const std::vector<LayerOption>* frontier = nullptr;
    bool host_binds = false;
    int64_t host = 0;
    std::vector<int64_t> split;  ///< layers per stage; empty: the program's choice
  };
  Options options(int64_t host) const;
  const std::vector<LayerOption>& offload_frontier() const;
  std::vector<LayerOption> price_options(bool offload) const;

  // A uniform chunk of n layers, its input kept whole or as a share per tensor-parallel
  // rank: the bytes it keeps, the most it holds at once above the layers below it (its
  // first forward, the gather of its input, its recompute, its backward), and its time.
  struct ChunkCost {
    int64_t kept = 0;
    int64_t top = 0;
    double seconds = 0;
  };
  ChunkCost chunk_cost(int64_t n, bool sharded) const;
  // How a layer may hold its kept input: whole, and as a share when the block allows it.
  std::vector<bool> input_holds() const;
  // Whether a layer may keep its gathered weights to its backward, as options_.reshard
  // allows where values are sharded: not, and where allowed so.
  std::vector<bool> weight_holds() const;
  // One way to plan the layers from a position: frontier option `option`, or (-1) a
  // uniform chunk of `chunk` layers with its input whole or as a share.
  struct Choice {
    int64_t option = -1;
    int64_t chunk = 0;
    bool sharded = false;
  };
  // Writes `c` into the plan's layers from `pos`.
  void place(ActivationPlan& plan, int64_t pos, const Choice& c, const Options& o) const;

  // One stage (src/plan/one_stage.cpp): the fastest plan within `budget` bytes as the cost
  // model counts them, and whether a budget admits any plan.
  std::optional<PlanResult> solve_one(int64_t budget, const Options& o) const;
  bool fits_one(int64_t budget, const Options& o) const;
  // A one-stage plan solved for `budget`, prefetching where it pays, predicted.
  std::optional<PlanResult> predicted_within(ActivationPlan plan, int64_t budget, const Options& o) const;
  // Several stages (src/plan/stages.cpp), likewise.
  std::optional<PlanResult> solve_stages(int64_t budget, const Options& o) const;
  bool fits_stages(int64_t budget, const Options& o) const;
  // The pipeline problem within `budget`, with the choice behind each piece; without
  // `offload`, only the pieces that keep everything on the device.
  pipeline::Problem pipeline_problem(int64_t budget, const Options& o, std::vector<Choice>& choices,
                                     bool offload = true) const;
  // The plan within `budget` bytes as the cost model counts them, of any stage count.
  std::optional<PlanResult> solve(int64_t budget, const Options& o) const;
  int64_t least_model_budget(const Options& o) const;
  // Sets LayerPlan::prefetch in stage `s`'s layers, from the bottom, where its step
  // `predicted` (kept current) then adds less and still peaks within `budget`: a layer's
  // prefetch holds its offloaded bytes through the backward of the layer above, which the
  // programs do not weigh.
  void prefetch_where_it_pays(ActivationPlan& plan, const Layout& stage, int64_t budget,
                              cost::StepPrediction& predicted) const;
  // Every stage of `plan` on `split` (layout's, or the even one, when empty), in the
  // planner's unit of time.
  PlanResult predict_units(const ActivationPlan& plan, const std::vector<int64_t>& split = {}) const;
  // On CUDA, each stage's allocator ledger replayed into r.device.
  void replay_allocator(PlanResult& r) const;
  // `r`, its times in seconds.
  PlanResult in_seconds(PlanResult r) const;
  // Stage `s` of `split` as the step walk sees it.
  Layout stage_layout(const std::vector<int64_t>& split, int64_t s) const;
  // The forward and backward seconds of a stage's embedding and loss head, those it holds.
  double ends_seconds(const Layout& stage) const;
  // A stage's forward and backward (recompute in it) of one microbatch: its `n` layers,
  // their recompute and its ends.
  pipeline::StageTimes stage_times(const Layout& stage, int64_t n, double recompute) const;
  // `plan` on `split` with each stage's prediction: the stages' times and, on CUDA, the
  // caching allocator's peaks.
  PlanResult assemble(ActivationPlan plan, std::vector<int64_t> split, std::vector<cost::StepPrediction> stages) const;
  // The plan within `budgets` on CUDA: solved for less and less cost-model bytes until it
  // reserves few enough; `reserved`: the last plan's reserved bytes.
  std::optional<PlanResult> solve_reserved(const Budgets& budgets, const Options& o, int64_t& reserved) const;
  bool on_cuda() const { return shape_.device == at::kCUDA; }
  // The step's bytes outside the layers on layout_ (its statics, the embedding's and the
  // head's), which the programs add to the layers'.
  void take_step_constants();

  ModelConfig cfg_;
  cost::StepShape shape_;
  Layout layout_;
  /// Units of the planner's time a second holds: 1 with measured nodes, else the FLOP rate
  /// (its unit a FLOP). times_ are in those units.
  double per_second_ = 1;
  cost::NodeTimes times_;
  PlannerOptions options_;
  graph::BlockGraph block_;
  std::vector<LayerOption> device_frontier_;
  mutable std::shared_ptr<const std::vector<LayerOption>> offload_frontier_;  // priced at the first ask
  LayerOption whole_;  ///< nothing dropped (what a chunk rebuilds per layer)
  /// With the other attention op priced (NodeTimes::other_attention): the model's op, which
  /// the plan names in the layers that run it; else unset.
  std::optional<Attention> per_layer_op_;
  int64_t emb_base_ = 0;      ///< statics + embedding, under every layer (one stage)
  int64_t head_peak_ = 0;     ///< the loss head's live bytes above the kept layers
  int64_t fixed_peak_ = 0;    ///< peaks that do not depend on the plan (embedding, optimizer)
  double block_seconds_ = 0;  ///< one whole block forward
  /// Sharded gradients: the buffers every layer's backward holds beside its own bytes (its
  /// own gradients', and the embedding's and head's), in each option's backward_peak.
  int64_t grad_buffers_ = 0;
  /// Sharded values: a layer's weights, gathered for its forward and, unless it keeps them,
  /// again for its backward, in each option's forward_peak and backward_peak; one gather's
  /// time at the data-parallel links.
  int64_t gathered_ = 0;
  double regather_ = 0;
  // A forward and backward of one microbatch: of a block without recompute, of the
  // embedding, of the loss head; measured where the times have them, else three times the
  // forward (a backward costs about twice its forward, as its FLOPs do).
  double layer_seconds_ = 0, embed_seconds_ = 0, head_seconds_ = 0;
  // The embedding's and the loss head's forwards alone.
  double embed_forward_ = 0, head_forward_ = 0;
  mutable std::optional<int64_t> none_peak_;
};

}  // namespace remat
