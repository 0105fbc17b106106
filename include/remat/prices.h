// What a step's work costs on a machine, in seconds: the one price list the planner is
// given (remat/planner.h), from one of two sources, declared rates (`remat plan`'s
// parallel.compute_rate, link_rate and ac.offload_rate) or a measured time profile
// (src/profile). A run records the prices it planned with in its directory (prices.json),
// so that `remat plan --prices` makes its plan again anywhere.
#pragma once

#include "remat/config.h"
#include "remat/cost.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace remat {

struct PlanResult;  // remat/planner.h

struct Prices {
  /// The ops' and collectives' prices, in seconds: each node's measured forward (none
  /// where declared) and the FLOP rate of the rest, the tensor-parallel links, the host
  /// copies of offloaded slots, a layer's and the ends' measured passes, and the other
  /// attention op's (model.attention = auto per layer).
  cost::NodeTimes times;
  double base_seconds = 0;  ///< one microbatch's forward and backward, nothing recomputed (measured)
  /// The step's work besides the passes (measured): zeroing the gradients the first
  /// backward does not write (Model::zero_grad), clipping them all, the AdamW update and
  /// the compute-dtype copies of the updated weights.
  double optimizer_seconds = 0;
  int64_t optimizer_bytes = 0;  ///< the parameter bytes that update was of
  /// The CPUs other processes used while it was measured (rank 0's machine); unknown where
  /// /proc/stat could not be read.
  std::optional<double> other_cpus;
  std::string path;  ///< where a measured profile is cached; empty where declared

  /// Whether the nodes' times are measured (seconds of this machine) rather than FLOPs at
  /// a rate: then a plan's time is compared in seconds, else in FLOPs (Planner).
  bool measured() const { return !times.seconds.empty(); }
  /// Predicted wall time of a step of `grad_accum` microbatches whose plan adds
  /// `added_seconds` (recompute, copies) to them.
  double step_seconds(int64_t grad_accum, double added_seconds) const {
    return static_cast<double>(grad_accum) * base_seconds + added_seconds + optimizer_seconds;
  }

  /// `remat plan`'s prices for `cfg`: FLOPs at parallel.compute_rate, collectives over
  /// parallel.link_rate and link_latency, host copies at ac.offload_rate, beside the
  /// compute on a CUDA device (slowing it by ac.offload_slowdown), in its place on the CPU.
  static Prices declared(const Config& cfg);
};

/// The predicted wall time of a step of stage `stage` of `r` (the planner's) under
/// `prices`: with a stage's pass measured (pipeline probes) the schedule's simulation and
/// the slowest stage's update, with the whole model's pass measured its `grad_accum`
/// microbatches, the plan's additions and the update; either way plus the data-parallel
/// collectives (StepPrediction::data_parallel_seconds, the slowest stage's); 0 where time
/// is FLOPs.
double predicted_step_seconds(const Prices& prices, const PlanResult& r, int64_t stage, int64_t grad_accum);

/// The slowest stage's data-parallel collectives in `r` (StepPrediction::data_parallel_seconds),
/// which no compute overlaps.
double data_parallel_seconds(const PlanResult& r);

/// The wall time of a step of `r` priced at declared rates (Prices::declared): every
/// stage's microbatches simulated with their passes' and recomputes' FLOPs at the compute
/// rate and their tensor-parallel collectives at the link's, then the slowest stage's
/// data-parallel collectives; the update and the pipeline's transfers are not priced.
double declared_step_seconds(const PlanResult& r);

/// `p` as JSON (a cache entry, a run's record) and back; from_json refuses, with a
/// sentence naming what, a damaged or negative price.
nlohmann::json to_json(const Prices& p);
Prices prices_from_json(const nlohmann::json& j);

}  // namespace remat
