// Pipeline parallelism's plan: how many layers each stage holds and what each of its layers
// keeps, solved together so that the slowest stage is as fast as it can be while every
// stage's peak stays within a per-rank budget.
//
// Under 1F1B (PipeDream-flush, Megatron-LM's default) stage s of p, counted from 0, runs
// p - s forwards before its first backward and then alternates, so it holds the
// activations of min(p - s, m) of the m microbatches at once; GPipe runs every forward
// first and holds all m. A stage's peak is therefore its parameters, gradients and
// optimizer state, plus (in flight - 1) microbatches' kept activations, plus the highest
// point of one microbatch's own forward and backward through the stage (the layers below
// the one running hold what they keep, the one running its working set): the other
// microbatches in flight hold all they keep while one of them runs. The optimizer step
// comes after the last backward, with no activations held.
//
// Both schedules take (m + p - 1) times the slowest stage's forward and backward of one
// microbatch (the pipeline's fill and drain are p - 1 slots), so the step time the solver
// minimises is that slowest stage's time; transfers between stages are not priced.
//
// A layer may also offload slots to host memory: its stage's rank holds them once per
// microbatch in flight, within that rank's host budget.
//
// The solver is exact over the model it is given (a dynamic program over stages and
// layers, equal to brute force on small instances); the planner (remat/planner.h) gives it
// the measured or FLOP-priced layer options of the real block, and a test gives it the
// numbers of ColossalAI's issue #5509.
#pragma once

#include "remat/layout.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace remat::pipeline {

/// One thing a stage does: the forward or the backward of a microbatch.
struct Action {
  bool backward = false;
  int64_t microbatch = 0;
  bool operator==(const Action& o) const { return backward == o.backward && microbatch == o.microbatch; }
};

/// The order stage `stage` (from 0) of `stages` runs `microbatches` forwards and backwards
/// in, the oldest microbatch's backward first. 1F1B: stages - stage - 1 forwards (at most
/// all), then one forward and one backward alternately, then the remaining backwards; it
/// holds at most in_flight() microbatches. GPipe: every forward, then every backward (one
/// stage: alternately, as 1F1B).
std::vector<Action> actions(Schedule schedule, int64_t stages, int64_t stage, int64_t microbatches);

/// Whether `order[i]` is a forward the stage follows at once with the same microbatch's
/// backward (every one of a single stage's, the last stage's under 1F1B), so that nothing
/// runs between the loss head's forward and its backward.
bool backward_follows(const std::vector<Action>& order, size_t i);

/// One stage's seconds for one microbatch: its forward, and its backward with the
/// recompute in it.
struct StageTimes {
  double forward = 0;
  double backward = 0;
};

/// The wall time of `microbatches` microbatches through `stages` (one StageTimes each) in
/// `schedule`'s order: every stage runs its actions() one after another, a forward once
/// the previous stage has finished that microbatch's forward, a backward once the next
/// stage has finished its backward (the last stage's after its own forward), each handed
/// over `transfer` seconds later. The time from the first forward to the last backward.
double simulate(Schedule schedule, const std::vector<StageTimes>& stages, int64_t microbatches, double transfer = 0);

/// One way to plan consecutive layers of a stage: one layer's keep-set (span 1), or a
/// uniform chunk of `span` layers recomputed from its first layer's input.
struct Piece {
  int64_t span = 1;
  int64_t kept = 0;    ///< bytes kept on the device from the forward to the backward, per microbatch
  int64_t top = 0;     ///< most bytes live at once above the layers below, while it runs
  double seconds = 0;  ///< its forward, backward, recompute and waits for copies, per microbatch
  int64_t host = 0;    ///< bytes it offloads to host memory meanwhile, per microbatch
};

/// What a stage holds and does besides its layers' pieces, for a given layer count: only
/// `statics`, `optimizer` and `seconds` may depend on the count, the others on which ends
/// (embedding, head) the stage holds.
struct Frame {
  int64_t statics = 0;    ///< held throughout: parameters, gradients, optimizer state, batch
  int64_t under = 0;      ///< kept per microbatch below the layers (the embedding's saved)
  int64_t over = 0;       ///< kept per microbatch above the layers (the head's saved)
  int64_t head_top = -1;  ///< the head's peak above everything the layers keep; -1: no head
  int64_t outside = 0;    ///< the embedding's peaks above the statics (one microbatch); 0: none
  int64_t optimizer = 0;  ///< the optimizer step's peak above the statics (no activations)
  double seconds = 0;     ///< the embedding's and head's forward and backward, per microbatch
};

/// A pipeline to plan.
struct Problem {
  int64_t layers = 0;
  int64_t budget = 0;              ///< bytes per rank
  std::vector<int64_t> in_flight;  ///< per stage (in_flight()); its size is the stage count
  std::vector<Piece> pieces;       ///< the choices for any layer (span 1) or chunk
  /// The frame of `stage` holding `n` layers (called once per stage and count).
  std::function<Frame(int64_t stage, int64_t n)> frame;
  /// Layers per stage, fixed (ac.num_layers_per_stage); empty: the solver chooses.
  std::vector<int64_t> split;
  /// Bytes per rank its pieces may offload at once: every microbatch in flight holds its
  /// stage's pieces' host bytes at the last forward before the first backward.
  int64_t host_budget = 0;
  /// Above this many partial plans per stage and layer count, those in one cell of
  /// budget / max_states bytes on both kept bytes and working peak merge into the fastest,
  /// the cells doubling until at most this many are left; exact below it.
  int64_t max_states = 2048;
};

/// One stage of a solution.
struct StagePlan {
  int64_t first = 0;  ///< its first layer (of the model)
  int64_t layers = 0;
  std::vector<int64_t> pieces;  ///< indices into Problem::pieces, bottom to top
  int64_t kept = 0;             ///< per microbatch: under + the pieces' + over
  int64_t peak = 0;             ///< predicted, with its microbatches in flight
  int64_t host = 0;             ///< in host memory at once: in flight x the pieces' host bytes
  double seconds = 0;           ///< forward and backward of one microbatch
};

struct Solution {
  std::vector<StagePlan> stages;
  int64_t bottleneck = 0;  ///< the slowest stage (the first of equals)
  double seconds = 0;      ///< its time: the step takes (m + p - 1) times it
};

/// The peak of a stage holding `in_flight` microbatches whose layers run `pieces`
/// (indices, bottom to top) under `frame` (the formula above).
int64_t stage_peak(const Problem& p, const Frame& frame, int64_t in_flight, const std::vector<int64_t>& pieces);

/// The plan whose slowest stage is fastest (then the least total time) with every stage's
/// peak within the budget; nullopt when none fits.
std::optional<Solution> solve(const Problem& p);

}  // namespace remat::pipeline
