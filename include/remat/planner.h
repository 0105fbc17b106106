// The planner: a memory budget in bytes becomes the fastest activation plan that fits.
//
// Per layer it prices every keep-set of the block's slots with the cost model (bytes
// kept, the peak of that layer's backward with its recompute, recompute time), with both
// attention ops where the times price the other one (model.attention = auto), under
// tensor parallelism without sequence parallelism each also with the block input kept as
// a share per rank (Megatron's distribute_saved_activations, priced by the measured
// all-gather), and keeps the Pareto frontier. Across layers a dynamic program over (bytes kept by the layers
// below, time) picks one frontier point per layer, or a uniform chunk of several layers,
// so that predicted time is least and every point of the step (each layer's forward and
// backward, the loss head, the optimizer) stays within the budget. The layers below a
// layer are what it stacks on, so the program walks them in order and the constraint of
// each layer is exact. It allocates nothing: an 8B model at 8k tokens plans on a laptop.
//
// With a host budget (PlannerOptions::host_budget) a kept slot may also wait in host
// memory between its layer's forward and backward (LayerPlan::offloaded), its copies
// priced at the times' host rate: the program then also carries the host bytes below each
// layer, so that the plan's offloaded bytes stay within the host budget. Where copies run
// beside the compute, the solved plan then prefetches each offloading layer's copies back
// during the backward of the layer above where the whole step's prediction is faster and
// still within the budget (LayerPlan::prefetch), layer by layer from the bottom.
#pragma once

#include "remat/budget.h"
#include "remat/cost.h"
#include "remat/pipeline.h"

#include <optional>
#include <string>
#include <vector>

namespace remat {

struct PlannerOptions {
  bool early_stop = true;  ///< as the store runs recomputes
  int64_t max_chunk = 4;   ///< largest uniform chunk considered (1: none)
  /// Keep-set candidates per layer: every subset of the block's non-empty slots when
  /// empty, else exactly these (each a set of dropped slots; for tests and experiments).
  std::vector<SlotMask> candidates;
  /// Above this many partial plans per layer the program merges those whose kept bytes
  /// differ by less than budget / max_states (keeping the faster, which keeps more), so
  /// the plan still fits; exact below it.
  int64_t max_states = 4096;
  /// Bytes the offloaded slots may hold in host memory at once; 0, or a time source
  /// without a host copy rate (NodeTimes::host_bytes_per_second): nothing is offloaded.
  int64_t host_budget = 0;
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
  /// What the option adds to the step: its recompute, its host copies, and with the other
  /// attention op the difference of its pass (cost::OtherAttention::pass_delta).
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

struct PlanResult {
  ActivationPlan plan;
  cost::StepPrediction prediction;  ///< of `plan`, by the step simulator
};

/// A pipeline of `stages` ranks (remat/pipeline.h), one microbatch per train.grad_accum.
struct PipelineShape {
  int64_t stages = 1;
  pipeline::Schedule schedule = pipeline::Schedule::one_f_one_b;
  std::vector<int64_t> split;  ///< layers per stage (ac.num_layers_per_stage); empty: the planner's
};

/// A plan of every stage of a pipeline, predicted.
struct PipelinePlan {
  ActivationPlan plan;                       ///< every layer of the model
  std::vector<int64_t> split;                ///< layers per stage
  std::vector<cost::StepPrediction> stages;  ///< each stage's step, by the step simulator
  std::vector<double> stage_seconds;         ///< each stage's forward and backward of one microbatch
  int64_t bottleneck = 0;                    ///< the slowest stage (the first of equals)
  /// The schedule's time, (microbatches + stages - 1) x the bottleneck's (the optimizer
  /// step, which the stages run at once, is not in it): what the solver minimises.
  double schedule_seconds = 0;
  /// The step's microbatches through the stages, simulated (pipeline::simulate) with each
  /// stage's forward and backward; transfers and the optimizer are not in it.
  double simulated_seconds = 0;
  int64_t peak() const;  ///< the highest stage peak
};

class Planner {
 public:
  /// Prices the block of `cfg` at `shape` once; `times` prices recompute (a measured
  /// profile, or FLOPs at a rate).
  Planner(const ModelConfig& cfg, const cost::StepShape& shape, const cost::NodeTimes& times,
          PlannerOptions options = {});

  /// The fastest plan whose predicted peak is at most `budget` bytes, or nullopt.
  std::optional<PlanResult> solve(int64_t budget) const;
  /// The smallest budget any plan fits (to the byte).
  int64_t min_feasible_budget() const;
  /// Predicted peak with no recompute.
  int64_t none_peak() const;
  /// The per-layer frontier (Pareto over kept bytes, the layer's highest point forward or
  /// backward, LayerOption::seconds and the bytes offloaded).
  const std::vector<LayerOption>& layer_frontier() const { return frontier_; }
  /// Solved plans from the minimum feasible budget to the no-recompute peak, `points`
  /// budgets apart, Pareto-filtered. The budgets are solved coarse to fine (both ends,
  /// then the middle of each gap), and none is started once `seconds` have passed (0: no
  /// limit), so a long model's sweep is coarser rather than minutes long.
  Frontier frontier(int points = 24, double seconds = 0) const;
  /// The sentence for a budget no plan fits: the minimum feasible budget and what fills
  /// the least-memory plan's peak. `given` is the budget as the user wrote it.
  std::string infeasible(int64_t budget, const std::string& given) const;
  /// Predicts the step of any plan (for the manual policies on the frontier).
  cost::StepPrediction predict(const ActivationPlan& plan) const;

  /// The block of the model's attention op.
  const graph::BlockGraph& block() const { return block_; }

  /// The fastest pipeline plan whose every stage's predicted peak is at most `budget`
  /// bytes: the layers of each stage (unless `pipe.split` fixes them) and every layer's
  /// keep-set, offload set or uniform chunk, solved together (pipeline::solve), each
  /// stage's offloaded bytes, times its microbatches in flight, within the host budget
  /// (a stage's rank's); nullopt when none fits.
  /// The shape's own stage fields are ignored: each stage gets its own.
  std::optional<PipelinePlan> solve_pipeline(int64_t budget, const PipelineShape& pipe) const;
  /// Predicts each stage of `plan` on `pipe.split` (the even split when empty).
  PipelinePlan predict_pipeline(const ActivationPlan& plan, const PipelineShape& pipe) const;
  /// The smallest budget the pipeline planner finds a plan for (to the byte): the least
  /// its stages' bytes admit, searched with every time zero, where it plans there.
  int64_t min_pipeline_budget(const PipelineShape& pipe) const;
  /// Stage `s` of `pipe` holding `n` layers from `first`, as the step simulator sees it
  /// (one stage: pipe = {}, first = 0, n = every layer).
  cost::StepShape stage_shape(const PipelineShape& pipe, int64_t s, int64_t first, int64_t n) const;

 private:
  // A uniform chunk of n layers, its input kept whole or as a share per tensor-parallel
  // rank: the bytes it keeps, the most it holds at once above the layers below it (its
  // first forward, the gather of its input, its recompute, its backward), and its time.
  struct ChunkCost {
    int64_t kept = 0;
    int64_t top = 0;
    double seconds = 0;
  };
  ChunkCost chunk_cost(int64_t n, bool sharded) const;
  // Sets LayerPlan::prefetch in the layers `shape` holds, from the bottom, where the step
  // `predicted` (that shape's, kept current) then adds less and still peaks within
  // `budget`: a layer's prefetch holds its offloaded bytes through the backward of the
  // layer above, which the programs do not weigh.
  void prefetch_where_it_pays(ActivationPlan& plan, const cost::StepShape& shape, int64_t budget,
                              cost::StepPrediction& predicted) const;
  // How a layer may hold its kept input: whole, and as a share when the block allows it.
  std::vector<bool> input_holds() const;
  // One way to plan the layers from a position: frontier option `option`, or (-1) a
  // uniform chunk of `chunk` layers with its input whole or as a share.
  struct Choice {
    int64_t option = -1;
    int64_t chunk = 0;
    bool sharded = false;
  };
  // Writes `c` into the plan's layers from `pos`.
  void place(ActivationPlan& plan, int64_t pos, const Choice& c) const;
  // The forward and backward seconds of a stage's embedding and loss head, those it holds.
  double ends_seconds(const cost::StepShape& stage) const;
  // The pipeline problem of `pipe` within `budget`, with the choice behind each piece;
  // without `offload`, only the pieces that keep everything on the device.
  pipeline::Problem pipeline_problem(int64_t budget, const PipelineShape& pipe, std::vector<Choice>& choices,
                                     bool offload = true) const;

  ModelConfig cfg_;
  cost::StepShape shape_;
  cost::NodeTimes times_;
  PlannerOptions options_;
  graph::BlockGraph block_;
  std::vector<LayerOption> frontier_;
  /// Whether the host budget can bind: every layer's most offloading option together
  /// exceed it. Else the program ignores the host bytes, which then cannot decide a plan.
  bool host_binds_ = false;
  LayerOption whole_;  ///< nothing dropped (what a chunk rebuilds per layer)
  /// With the other attention op priced (NodeTimes::other_attention): the model's op, which
  /// the plan names in the layers that run it; else unset.
  std::optional<Attention> per_layer_op_;
  int64_t emb_base_ = 0;      ///< statics + embedding, under every layer
  int64_t head_peak_ = 0;     ///< the loss head's live bytes above the kept layers
  int64_t fixed_peak_ = 0;    ///< peaks that do not depend on the plan (embedding, optimizer)
  double block_seconds_ = 0;  ///< one whole block forward
  // A forward and backward of one microbatch: of a block without recompute, of the
  // embedding, of the loss head; measured where the times have them, else three times the
  // forward (a backward costs about twice its forward, as its FLOPs do).
  double layer_seconds_ = 0, embed_seconds_ = 0, head_seconds_ = 0;
  // The embedding's and the loss head's forwards alone.
  double embed_forward_ = 0, head_forward_ = 0;
  // A stage's forward and backward (recompute in it) of one microbatch: its `n` layers,
  // their recompute and its ends.
  pipeline::StageTimes stage_times(const cost::StepShape& stage, int64_t n, double recompute) const;
};

}  // namespace remat
