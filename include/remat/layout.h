// How a run's ranks share the work: one value that everything below the run takes (the
// model, the graphs, the cost model, the planner), resolved once from parallel.* and the
// launch (src/run). Sizes and the device are not in it: a StepShape says those.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace remat {

namespace pipeline {

/// The order in which a pipeline stage runs its microbatches' forwards and backwards.
enum class Schedule { one_f_one_b, gpipe };
/// "1f1b" / "gpipe", as configs spell it.
const char* schedule_name(Schedule s);
/// The schedule a name denotes; throws std::invalid_argument naming the valid ones.
Schedule schedule_of_name(const std::string& name);

/// Microbatches whose activations stage `stage` (from 0) of `stages` holds at once: under
/// 1F1B the stages after it plus itself (at most all), under GPipe all of them. One stage
/// runs each microbatch's forward, then its backward, under either: it holds one.
inline int64_t in_flight(Schedule schedule, int64_t stages, int64_t stage, int64_t microbatches) {
  return schedule == Schedule::gpipe && stages > 1 ? microbatches : std::min(stages - stage, microbatches);
}

/// `layers` split over `stages` as evenly as they go, the first stages taking one more.
std::vector<int64_t> even_split(int64_t layers, int64_t stages);

}  // namespace pipeline

/// The parallel layout of one rank: its data-, tensor- and pipeline-parallel groups, its
/// pipeline stage and the layers each stage holds.
struct Layout {
  int64_t dp = 1;     ///< data-parallel ranks (each a share of train.batch)
  int64_t tp = 1;     ///< tensor-parallel ranks sharing every layer: graphs and bytes are one rank's share
  bool sp = false;    ///< sequence parallelism over the tensor-parallel ranks
  int64_t pp = 1;     ///< pipeline stages
  int64_t stage = 0;  ///< this rank's stage (from 0)
  /// ZeRO stage: 1 shards AdamW's moments over the dp ranks (zero_ranks), 2 the gradients
  /// too (grads_sharded), 3 the master weights too (values_sharded); 0 keeps all whole.
  int64_t zero = 0;
  pipeline::Schedule schedule = pipeline::Schedule::one_f_one_b;
  /// Layers per stage, pp entries; empty: not fixed (the planner's choice where it plans,
  /// else pipeline::even_split).
  std::vector<int64_t> split;
  /// The data-parallel rank whose share of a sharded optimizer (zero_ranks() > 1) the cost
  /// model holds; none: the rank that peaks highest, what a budget must hold.
  std::optional<int64_t> dp_rank;

  /// The data-parallel ranks AdamW's moments are sharded over (1: every rank holds them all).
  int64_t zero_ranks() const { return zero >= 1 && dp > 1 ? dp : 1; }
  /// Whether each dp rank keeps only the gradients of the parameters whose moments it holds
  /// (ZeRO stage 2 over more than one rank).
  bool grads_sharded() const { return zero >= 2 && dp > 1; }
  /// Whether each dp rank keeps only the master weights of those parameters too, each
  /// part's gathered in the compute dtype for its forward and again for its backward (ZeRO
  /// stage 3 over more than one rank).
  bool values_sharded() const { return zero >= 3 && dp > 1; }
  /// Layers per stage for a model of `n_layer`: `split`, or the even split.
  std::vector<int64_t> stage_split(int64_t n_layer) const {
    return split.empty() ? pipeline::even_split(n_layer, pp) : split;
  }
  /// The first layer of this rank's stage, and how many it holds.
  int64_t first_layer(int64_t n_layer) const {
    const std::vector<int64_t> s = stage_split(n_layer);
    int64_t first = 0;
    for (int64_t i = 0; i < stage; ++i) first += s.at(static_cast<size_t>(i));
    return first;
  }
  int64_t stage_layers(int64_t n_layer) const { return stage_split(n_layer).at(static_cast<size_t>(stage)); }
  bool has_embedding() const { return stage == 0; }
  bool has_head() const { return stage == pp - 1; }
  /// The microbatches whose activations the stage holds at once, of `microbatches`.
  int64_t in_flight(int64_t microbatches) const { return pipeline::in_flight(schedule, pp, stage, microbatches); }
  /// Stage `s` of a pipeline whose stages hold `split` layers each.
  static Layout pipeline_stage(std::vector<int64_t> split, int64_t s) {
    Layout l;
    l.pp = static_cast<int64_t>(split.size());
    l.stage = s;
    l.split = std::move(split);
    return l;
  }
  /// The same layout seen from stage `s`.
  Layout at_stage(int64_t s) const {
    Layout l = *this;
    l.stage = s;
    return l;
  }
};

}  // namespace remat
