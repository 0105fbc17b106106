#include "remat/planner.h"

#include "remat/memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

namespace remat {
namespace {

// The most a layer holds at once above the layers below it, forward or backward: what
// the program checks against the budget.
int64_t top(const LayerOption& o) { return std::max(o.cost.forward_peak, o.cost.backward_peak); }

// Whether `a` is no worse than `b` in every measure the program weighs.
bool no_worse(const LayerOption& a, const LayerOption& b) {
  return a.cost.kept <= b.cost.kept && top(a) <= top(b) && a.seconds <= b.seconds && a.cost.host <= b.cost.host;
}

// The options no other is better than, in their given order. Taken by ascending measures,
// an option can only be bettered by one taken before it, so each is checked against the
// frontier so far; of equal ones the first given stands for all (the model's op, fewest
// dropped, least offloaded).
std::vector<LayerOption> pareto(const std::vector<LayerOption>& all) {
  std::vector<size_t> order(all.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const auto measures = [&](size_t i) {
    return std::make_tuple(all[i].cost.kept, top(all[i]), all[i].seconds, all[i].cost.host);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return measures(a) < measures(b); });
  std::vector<size_t> taken;
  for (const size_t i : order) {
    if (std::none_of(taken.begin(), taken.end(), [&](size_t j) { return no_worse(all[j], all[i]); })) {
      taken.push_back(i);
    }
  }
  std::sort(taken.begin(), taken.end());
  std::vector<LayerOption> out;
  for (const size_t i : taken) out.push_back(all[i]);
  return out;
}

// Every subset of `block`'s slots that hold bytes, as dropped sets.
std::vector<SlotMask> keep_sets(const graph::BlockGraph& block) {
  std::vector<Slot> slots;
  for (const Slot s : SlotMask::droppable().slots()) {
    if (block.slot_bytes(s) > 0) slots.push_back(s);
  }
  std::vector<SlotMask> out;
  for (uint32_t mask = 0; mask < (1u << slots.size()); ++mask) {
    SlotMask dropped;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (mask & (1u << i)) dropped.add(slots[i]);
    }
    out.push_back(dropped);
  }
  return out;
}

// A partial plan of the layers below a position: bytes they keep, recompute time, and
// how it was reached (the previous position's state and the choice that led here).
struct State {
  int64_t kept = 0;
  double seconds = 0;
  int64_t prev_pos = -1;
  int64_t prev_index = -1;
  int64_t option = -1;   ///< index into the layer frontier, or -1 for a chunk
  int64_t chunk = 0;     ///< chunk length when option == -1
  bool sharded = false;  ///< a chunk's input kept as a share per rank
  int64_t host = 0;      ///< bytes the layers below offload
};

// `v` as runs that each ascend (starting at `starts`, the first at 0), merged pairwise
// into one ascending by kept bytes, then time: a sort's order for a merge's cost.
void merge_runs(std::vector<State>& v, std::vector<size_t> starts) {
  const auto before = [](const State& a, const State& b) {
    return a.kept != b.kept ? a.kept < b.kept : a.seconds < b.seconds;
  };
  starts.push_back(v.size());
  while (starts.size() > 2) {
    const size_t runs = starts.size() - 1;
    std::vector<size_t> next;
    for (size_t i = 0; i + 1 < runs; i += 2) {
      std::inplace_merge(v.begin() + static_cast<std::ptrdiff_t>(starts[i]),
                         v.begin() + static_cast<std::ptrdiff_t>(starts[i + 1]),
                         v.begin() + static_cast<std::ptrdiff_t>(starts[i + 2]), before);
      next.push_back(starts[i]);
    }
    if (runs % 2 == 1) next.push_back(starts[runs - 1]);
    next.push_back(v.size());
    starts = std::move(next);
  }
}

// Pareto filter: ascending kept bytes with strictly falling time; above `max_states`,
// states closer than `width` bytes merge into the faster one. With `host_width` (a host
// budget that binds) the host bytes are a third measure: a state stays unless one with no
// more kept bytes, host bytes and time is taken, and the merge is by both byte counts.
void prune(std::vector<State>& v, const std::vector<size_t>& runs, int64_t max_states, int64_t width,
           int64_t host_width) {
  merge_runs(v, runs);
  std::vector<State> out;
  if (host_width == 0) {
    for (const auto& s : v) {
      if (out.empty() || s.seconds < out.back().seconds) out.push_back(s);
    }
  } else {
    // The states taken so far (no more kept bytes than the next) as a staircase of host
    // bytes against time: the least time at or below a host count is its step's.
    std::map<int64_t, double> stairs;
    for (const auto& s : v) {
      auto it = stairs.upper_bound(s.host);
      if (it != stairs.begin() && std::prev(it)->second <= s.seconds) continue;
      while (it != stairs.end() && it->second >= s.seconds) it = stairs.erase(it);
      stairs[s.host] = s.seconds;
      out.push_back(s);
    }
  }
  if (static_cast<int64_t>(out.size()) > max_states && width > 0) {
    std::vector<State> merged;
    if (host_width == 0) {
      for (const auto& s : out) {
        // Sorted by kept bytes with falling time: the later state of a bucket is the
        // faster one, and it stands for the bucket with its own (larger) kept bytes.
        if (!merged.empty() && s.kept / width == merged.back().kept / width) {
          merged.back() = s;
        } else {
          merged.push_back(s);
        }
      }
    } else {
      std::map<std::pair<int64_t, int64_t>, size_t> bucket;
      for (const auto& s : out) {
        const auto [at, added] = bucket.try_emplace({s.kept / width, s.host / host_width}, merged.size());
        if (added) {
          merged.push_back(s);
        } else if (s.seconds < merged[at->second].seconds) {
          merged[at->second] = s;
        }
      }
      std::sort(merged.begin(), merged.end(), [](const State& a, const State& b) {
        return a.kept != b.kept ? a.kept < b.kept : a.seconds < b.seconds;
      });
    }
    out = std::move(merged);
  }
  v = std::move(out);
}

// The least budget in [lo, hi] that `feasible` admits, feasibility rising with the budget
// (hi admitted).
template <typename Feasible>
int64_t least_budget(int64_t lo, int64_t hi, const Feasible& feasible) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (feasible(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return hi;
}

}  // namespace

Planner::Planner(const ModelConfig& cfg, const cost::StepShape& shape, const cost::NodeTimes& times,
                 PlannerOptions options)
    : cfg_(cfg), shape_(shape), times_(times), options_(std::move(options)), block_(cost::shape_block(cfg, shape)) {
  std::vector<LayerOption> all;
  // Copies priced at no rate would look free: without one nothing is offloaded.
  const bool offload = options_.host_budget > 0 && times_.host_bytes_per_second > 0;
  const auto add = [&](const graph::BlockGraph& block, const cost::LayerPricer& pricer, std::optional<Attention> op,
                       double delta) {
    const auto candidates = options_.candidates.empty() ? keep_sets(block) : options_.candidates;
    for (const bool sharded : input_holds()) {
      for (const auto& d : candidates) {
        for (const SlotMask moved : offload ? offload_sets(block, pricer, d, sharded) : std::vector<SlotMask>{{}}) {
          LayerOption o{d, moved, pricer.price(d, sharded, moved), sharded, op};
          // A set whose every slot shares memory the device keeps moves nothing.
          if (!moved.empty() && o.cost.host == 0) continue;
          o.seconds = o.cost.recompute_seconds + delta + o.cost.copy_added_seconds();
          all.push_back(std::move(o));
        }
      }
    }
  };
  // model.attention = auto per layer: each layer may run the other op instead, and the
  // plan names every layer's op.
  const cost::OtherAttention* other = times_.other_attention.get();
  if (other != nullptr && other->op == cfg.attention) other = nullptr;
  per_layer_op_ = other != nullptr ? std::optional<Attention>(cfg.attention) : std::nullopt;
  const cost::LayerPricer pricer(block_, options_.early_stop, times_);
  add(block_, pricer, per_layer_op_, 0);
  if (other != nullptr) {
    ModelConfig c = cfg;
    c.attention = other->op;
    const graph::BlockGraph block = cost::shape_block(c, shape);
    add(block, cost::LayerPricer(block, options_.early_stop, other->times), other->op, other->pass_delta);
  }
  whole_ = {{}, {}, pricer.price({}), false, std::nullopt};
  frontier_ = pareto(all);
  int64_t most_host = 0;
  for (const auto& o : frontier_) most_host = std::max(most_host, o.cost.host);
  host_binds_ = most_host * cfg_.n_layer > options_.host_budget;
  const cost::StepConstants k = cost::step_constants(cfg_, shape_);
  emb_base_ = k.statics.total() + k.embed_saved;
  head_peak_ = k.head_peak;
  fixed_peak_ =
      std::max({k.statics.total() + k.embed_peak, emb_base_ + k.embed_backward, k.statics.total() + k.optimizer});
  for (const auto& n : block_.nodes) block_seconds_ += times_.node_seconds(n);
  const auto forward = [&](const graph::BlockGraph& g) {
    double t = 0;
    for (const auto& n : g.nodes) t += times_.node_seconds(n);
    return t;
  };
  embed_forward_ = forward(graph::embed_graph(cfg_, shape_.batch, shape_.seq, shape_.dtype, shape_.tp, shape_.sp));
  head_forward_ =
      forward(graph::head_graph(cfg_, shape_.batch, shape_.seq, shape_.dtype, shape_.ce_chunk, shape_.tp, shape_.sp));
  layer_seconds_ = times_.layer_pass_seconds > 0 ? times_.layer_pass_seconds : 3 * block_seconds_;
  embed_seconds_ = 3 * embed_forward_;
  head_seconds_ = 3 * head_forward_;
  // Measured, the ends' pass is shared between them as their forwards are.
  if (times_.ends_pass_seconds > 0 && embed_forward_ + head_forward_ > 0) {
    const double share = embed_forward_ / (embed_forward_ + head_forward_);
    embed_seconds_ = share * times_.ends_pass_seconds;
    head_seconds_ = (1 - share) * times_.ends_pass_seconds;
    embed_forward_ = embed_seconds_ / 3;
    head_forward_ = head_seconds_ / 3;
  }
}

pipeline::StageTimes Planner::stage_times(const cost::StepShape& stage, int64_t n, double recompute) const {
  const bool embedding = stage.has_embedding(), head = stage.has_head(cfg_.n_layer);
  // A layer's forward is its nodes' times (measured ones are a recompute's), never more
  // than its whole measured pass.
  const double forward = static_cast<double>(n) * std::min(block_seconds_, layer_seconds_) +
                         (embedding ? embed_forward_ : 0.0) + (head ? head_forward_ : 0.0);
  const double whole = static_cast<double>(n) * layer_seconds_ + recompute + ends_seconds(stage);
  return {forward, whole - forward};
}

double Planner::ends_seconds(const cost::StepShape& stage) const {
  return (stage.has_embedding() ? embed_seconds_ : 0.0) + (stage.has_head(cfg_.n_layer) ? head_seconds_ : 0.0);
}

void Planner::place(ActivationPlan& plan, int64_t pos, const Choice& c) const {
  if (c.option >= 0) {
    plan.layers[pos].dropped = frontier_[c.option].dropped;
    plan.layers[pos].offloaded = frontier_[c.option].offloaded;
    plan.layers[pos].input_sharded = frontier_[c.option].input_sharded;
    plan.layers[pos].attention = frontier_[c.option].attention;
    return;
  }
  const SlotMask everything = SlotMask::droppable();
  for (int64_t j = pos; j < pos + c.chunk; ++j) {
    plan.layers[j].dropped = everything;
    plan.layers[j].chunk_begin = j == pos ? -1 : pos;
    plan.layers[j].attention = per_layer_op_;
  }
  plan.layers[pos].input_sharded = c.sharded;
}

cost::StepShape Planner::stage_shape(const PipelineShape& pipe, int64_t s, int64_t first, int64_t n) const {
  cost::StepShape shape = shape_;
  shape.first_layer = first;
  shape.layers = n;
  shape.stages = pipe.stages;
  shape.stage = s;
  shape.schedule = pipe.schedule;
  return shape;
}

pipeline::Problem Planner::pipeline_problem(int64_t budget, const PipelineShape& pipe, std::vector<Choice>& choices,
                                            bool offload) const {
  const int64_t L = cfg_.n_layer;
  pipeline::Problem p;
  p.layers = L;
  p.budget = budget;
  p.split = pipe.split;
  for (int64_t s = 0; s < pipe.stages; ++s) {
    p.in_flight.push_back(pipeline::in_flight(pipe.schedule, pipe.stages, s, shape_.grad_accum));
  }
  choices.clear();
  p.host_budget = options_.host_budget;
  for (int64_t i = 0; i < static_cast<int64_t>(frontier_.size()); ++i) {
    const auto& c = frontier_[i].cost;
    if (!offload && c.host > 0) continue;
    p.pieces.push_back({1, c.kept, top(frontier_[i]), layer_seconds_ + frontier_[i].seconds, c.host});
    choices.push_back({i, 0, false});
  }
  for (int64_t n = 2; n <= std::min(options_.max_chunk, L); ++n) {
    for (const bool sharded : input_holds()) {
      const ChunkCost c = chunk_cost(n, sharded);
      p.pieces.push_back({n, c.kept, c.top, static_cast<double>(n) * layer_seconds_ + c.seconds});
      choices.push_back({-1, n, sharded});
    }
  }
  // Which ends a stage holds is all its position changes; a middle stage starts at layer 1.
  p.frame = [this, pipe, L](int64_t s, int64_t n) {
    const int64_t first = s == 0 ? 0 : s == pipe.stages - 1 ? L - n : 1;
    const cost::StepShape shape = stage_shape(pipe, s, first, n);
    const cost::StepConstants k = cost::step_constants(cfg_, shape);
    pipeline::Frame f;
    f.statics = k.statics.total();
    f.under = k.embed_saved;
    f.over = k.head_saved;
    f.head_top = shape.has_head(L) ? k.head_peak : -1;
    f.outside = shape.has_embedding() ? std::max(k.embed_peak, k.embed_saved + k.embed_backward) : 0;
    f.optimizer = k.optimizer;
    f.seconds = ends_seconds(shape);
    return f;
  };
  p.max_states = options_.max_states;
  return p;
}

std::optional<PipelinePlan> Planner::solve_pipeline(int64_t budget, const PipelineShape& pipe) const {
  std::vector<Choice> choices;
  pipeline::Problem problem = pipeline_problem(budget, pipe, choices);
  auto solved = pipeline::solve(problem);
  // Offloading pieces multiply the partial plans past where the program merges them, which
  // may lose the best plan without offload: solved alone, it stands where it is faster.
  if (std::any_of(problem.pieces.begin(), problem.pieces.end(), [](const pipeline::Piece& c) { return c.host > 0; })) {
    std::vector<Choice> device_choices;
    pipeline::Problem device = pipeline_problem(budget, pipe, device_choices, false);
    auto alone = pipeline::solve(device);
    if (alone && (!solved || alone->seconds < solved->seconds)) {
      solved = std::move(alone);
      problem = std::move(device);
      choices = std::move(device_choices);
    }
  }
  if (!solved) return std::nullopt;
  ActivationPlan plan;
  plan.layers.resize(cfg_.n_layer);
  PipelineShape fixed = pipe;
  fixed.split.clear();
  for (const auto& st : solved->stages) {
    int64_t pos = st.first;
    for (const int64_t i : st.pieces) {
      place(plan, pos, choices[i]);
      pos += problem.pieces[i].span;
    }
    fixed.split.push_back(st.layers);
  }
  plan.policy = fmt::format("budget:{}", budget);
  PipelinePlan r = predict_pipeline(plan, fixed);
  for (size_t s = 0; s < r.stages.size(); ++s) {
    TORCH_INTERNAL_ASSERT(r.stages[s].peak <= solved->stages[s].peak, "stage ", s + 1,
                          " of the pipeline plan peaks at ", r.stages[s].peak, " above the ", solved->stages[s].peak,
                          " its solver priced");
    TORCH_INTERNAL_ASSERT(r.stages[s].host_peak == solved->stages[s].host, "stage ", s + 1,
                          " of the pipeline plan offloads ", r.stages[s].host_peak, " bytes, not the ",
                          solved->stages[s].host, " its solver priced");
  }
  // Each stage's prefetches lower its own time only, so the pipeline's split stands.
  if (!times_.host_copies_overlap || !plan.offloads()) return r;
  for (int64_t s = 0, first = 0; s < pipe.stages; first += fixed.split[static_cast<size_t>(s)], ++s) {
    const cost::StepShape stage = stage_shape(pipe, s, first, fixed.split[static_cast<size_t>(s)]);
    prefetch_where_it_pays(plan, stage, budget, r.stages[static_cast<size_t>(s)]);
  }
  return predict_pipeline(plan, fixed);
}

PipelinePlan Planner::predict_pipeline(const ActivationPlan& plan, const PipelineShape& pipe) const {
  PipelinePlan r;
  r.plan = plan;
  r.split = pipe.split.empty() ? pipeline::even_split(cfg_.n_layer, pipe.stages) : pipe.split;
  std::vector<pipeline::StageTimes> times;
  int64_t first = 0;
  for (int64_t s = 0; s < pipe.stages; ++s) {
    const int64_t n = r.split[static_cast<size_t>(s)];
    const cost::StepShape shape = stage_shape(pipe, s, first, n);
    r.stages.push_back(cost::predict_step(cfg_, shape, plan, options_.early_stop, times_));
    const double recompute = r.stages.back().added_seconds() / static_cast<double>(shape_.grad_accum);
    times.push_back(stage_times(shape, n, recompute));
    r.stage_seconds.push_back(times.back().forward + times.back().backward);
    if (r.stage_seconds.back() > r.stage_seconds[static_cast<size_t>(r.bottleneck)]) r.bottleneck = s;
    first += n;
  }
  r.schedule_seconds = static_cast<double>(shape_.grad_accum + pipe.stages - 1) * r.stage_seconds[r.bottleneck];
  r.simulated_seconds = pipeline::simulate(pipe.schedule, times, shape_.grad_accum);
  return r;
}

int64_t Planner::min_pipeline_budget(const PipelineShape& pipe) const {
  std::vector<Choice> choices;
  const auto solves = [&](int64_t budget) {
    return pipeline::solve(pipeline_problem(budget, pipe, choices)).has_value();
  };
  // Whether a budget fits is a matter of bytes alone: with no time to weigh, the program
  // keeps only the partial plans no other betters in kept bytes and peak, far fewer.
  const auto fits = [&](int64_t budget) {
    pipeline::Problem p = pipeline_problem(budget, pipe, choices);
    for (pipeline::Piece& c : p.pieces) c.seconds = 0;
    p.frame = [frame = p.frame](int64_t s, int64_t n) {
      pipeline::Frame f = frame(s, n);
      f.seconds = 0;
      return f;
    };
    return pipeline::solve(p).has_value();
  };
  const int64_t none = predict_pipeline(ActivationPlan::none(cfg_.n_layer), pipe).peak();
  const int64_t by_bytes = least_budget(0, none, fits);
  // Past max_states the timed program merges partial plans and may miss the plan the
  // bytes admit there: then the least budget it plans.
  return solves(by_bytes) ? by_bytes : least_budget(by_bytes + 1, none, solves);
}

int64_t PipelinePlan::peak() const {
  int64_t peak = 0;
  for (const auto& s : stages) peak = std::max(peak, s.peak);
  return peak;
}

std::optional<PlanResult> Planner::solve(int64_t budget) const {
  const int64_t L = cfg_.n_layer;
  if (fixed_peak_ > budget) return std::nullopt;
  const int64_t room = budget - emb_base_;  // for the layers' bytes
  std::vector<std::vector<State>> states(L + 1);
  // Where each run of states reaching a position begins: one run per choice from each
  // earlier position, ascending because the states it extends were pruned.
  std::vector<std::vector<size_t>> runs(L + 1);
  states[0].push_back({});
  const int64_t width = std::max<int64_t>(1, budget / std::max<int64_t>(1, options_.max_states));
  const int64_t host_width =
      host_binds_ ? std::max<int64_t>(1, options_.host_budget / std::max<int64_t>(1, options_.max_states)) : 0;
  std::vector<ChunkCost> chunks;
  std::vector<std::pair<int64_t, bool>> chunk_shapes;
  for (int64_t n = 2; n <= std::min(options_.max_chunk, L); ++n) {
    for (const bool sharded : input_holds()) {
      chunks.push_back(chunk_cost(n, sharded));
      chunk_shapes.emplace_back(n, sharded);
    }
  }
  for (int64_t pos = 0; pos < L; ++pos) {
    prune(states[pos], runs[pos], options_.max_states, width, host_width);
    const std::vector<State>& from = states[pos];
    const auto extend = [&](int64_t to, int64_t top, int64_t kept, int64_t host, double seconds, int64_t option,
                            int64_t n, bool sharded) {
      runs[to].push_back(states[to].size());
      for (int64_t si = 0; si < static_cast<int64_t>(from.size()); ++si) {
        const State& s = from[si];
        if (s.kept + top > room || s.host + host > options_.host_budget) continue;
        states[to].push_back({s.kept + kept, s.seconds + seconds, pos, si, option, n, sharded, s.host + host});
      }
    };
    for (int64_t oi = 0; oi < static_cast<int64_t>(frontier_.size()); ++oi) {
      const LayerOption& o = frontier_[oi];
      extend(pos + 1, top(o), o.cost.kept, o.cost.host, o.seconds, oi, 0, false);
    }
    for (size_t c = 0; c < chunks.size(); ++c) {
      const auto [n, sharded] = chunk_shapes[c];
      if (n <= L - pos) extend(pos + n, chunks[c].top, chunks[c].kept, 0, chunks[c].seconds, -1, n, sharded);
    }
  }
  prune(states[L], runs[L], options_.max_states, width, host_width);
  int64_t best = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(states[L].size()); ++i) {
    const State& s = states[L][i];
    if (s.kept + head_peak_ > room) continue;
    if (best < 0 || s.seconds < states[L][best].seconds) best = i;
  }
  if (best < 0) return std::nullopt;

  ActivationPlan plan;
  plan.layers.resize(L);
  for (int64_t pos = L, i = best; pos > 0;) {
    const State& s = states[pos][i];
    place(plan, s.prev_pos, {s.option, s.chunk, s.sharded});
    i = s.prev_index;
    pos = s.prev_pos;
  }
  plan.policy = fmt::format("budget:{}", budget);
  PlanResult r{plan, predict(plan)};
  prefetch_where_it_pays(r.plan, shape_, budget, r.prediction);
  TORCH_INTERNAL_ASSERT(r.prediction.peak <= budget, "the planner's plan peaks at ", r.prediction.peak,
                        " over the budget ", budget);
  TORCH_INTERNAL_ASSERT(r.prediction.host_peak <= options_.host_budget, "the planner's plan offloads ",
                        r.prediction.host_peak, " bytes, over the host budget ", options_.host_budget);
  return r;
}

int64_t Planner::min_feasible_budget() const {
  const int64_t L = cfg_.n_layer;
  // Feasibility depends only on the bytes kept below each layer, and with a binding host
  // budget on the bytes offloaded there: the partial plans no other keeps and offloads
  // less than at each position decide it (one, the least-kept, when the host cannot bind).
  using Reach = std::pair<int64_t, int64_t>;  // kept, host
  const auto host_of = [&](int64_t host) { return host_binds_ ? host : 0; };
  const int64_t width = std::max<int64_t>(1, none_peak() / std::max<int64_t>(1, options_.max_states));
  auto feasible = [&](int64_t budget) {
    if (fixed_peak_ > budget) return false;
    const int64_t room = budget - emb_base_;
    std::vector<std::vector<Reach>> reach(L + 1);
    reach[0].push_back({0, 0});
    for (int64_t pos = 0; pos <= L; ++pos) {
      // By kept bytes, with strictly falling host bytes; above max_states, those closer than
      // `width` kept bytes merge into the one offloading least.
      std::vector<Reach>& here = reach[pos];
      std::sort(here.begin(), here.end());
      std::vector<Reach> front;
      for (const Reach& r : here) {
        if (front.empty() || r.second < front.back().second) front.push_back(r);
      }
      if (static_cast<int64_t>(front.size()) > options_.max_states) {
        std::vector<Reach> merged;
        for (const Reach& r : front) {
          if (!merged.empty() && merged.back().first / width == r.first / width) {
            merged.back() = r;
          } else {
            merged.push_back(r);
          }
        }
        front = std::move(merged);
      }
      here = std::move(front);
      if (pos == L) break;
      for (const auto& [k, h] : here) {
        for (const auto& o : frontier_) {
          if (k + top(o) <= room && h + host_of(o.cost.host) <= options_.host_budget) {
            reach[pos + 1].push_back({k + o.cost.kept, h + host_of(o.cost.host)});
          }
        }
        for (int64_t n = 2; n <= std::min(options_.max_chunk, L - pos); ++n) {
          for (const bool sharded : input_holds()) {
            const ChunkCost c = chunk_cost(n, sharded);
            if (k + c.top <= room) reach[pos + n].push_back({k + c.kept, h});
          }
        }
      }
    }
    return !reach[L].empty() && reach[L].front().first + head_peak_ <= room;
  };
  return least_budget(0, none_peak(), feasible);
}

Planner::ChunkCost Planner::chunk_cost(int64_t n, bool sharded) const {
  const int64_t fwd = whole_.cost.forward_peak, input = block_.slot_bytes(Slot::input), full = whole_.cost.kept;
  ChunkCost c;
  c.kept = sharded ? input / block_.tp : input;
  c.top =
      std::max({input + fwd, block_.output_bytes() + (n - 1) * full + fwd, (n - 1) * full + whole_.cost.backward_peak});
  c.seconds = static_cast<double>(n) * block_seconds_;
  if (sharded) {
    // Gloo's all-gather holds the parts and its receive buffer beside the share and the
    // output gradient (graph::all_gather_events).
    c.top = std::max(c.top, block_.output_bytes() + c.kept + 2 * input);
    c.seconds += times_.input_gather_seconds(block_);
  }
  return c;
}

std::vector<bool> Planner::input_holds() const {
  if (block_.input_shardable()) return {false, true};
  return {false};
}

int64_t Planner::none_peak() const { return predict(ActivationPlan::none(cfg_.n_layer)).peak; }

void Planner::prefetch_where_it_pays(ActivationPlan& plan, const cost::StepShape& shape, int64_t budget,
                                     cost::StepPrediction& predicted) const {
  // Where copies take the compute's cores (the CPU's) they are priced whole wherever they run.
  if (!times_.host_copies_overlap) return;
  const int64_t end = shape.first_layer + shape.stage_layers(cfg_.n_layer);
  for (int64_t l = shape.first_layer; l + 1 < end; ++l) {
    if (!plan.may_prefetch(l, end)) continue;
    plan.layers[static_cast<size_t>(l)].prefetch = true;
    cost::StepPrediction p = cost::predict_step(cfg_, shape, plan, options_.early_stop, times_);
    if (p.peak <= budget && p.added_seconds() < predicted.added_seconds()) {
      predicted = std::move(p);
    } else {
      plan.layers[static_cast<size_t>(l)].prefetch = false;
    }
  }
}

cost::StepPrediction Planner::predict(const ActivationPlan& plan) const {
  return cost::predict_step(cfg_, shape_, plan, options_.early_stop, times_);
}

std::string Planner::infeasible(int64_t budget, const std::string& given) const {
  using memory::format_bytes;
  const int64_t least = min_feasible_budget();
  const auto r = solve(least);
  TORCH_INTERNAL_ASSERT(r.has_value(), "no plan fits the minimum feasible budget");
  const auto& p = r->prediction;
  std::string text = fmt::format(
      "The memory budget {} ({}) is below the minimum feasible {} for {} at batch {} x {} tokens in {}: the "
      "least-memory plan peaks in the {} with parameters {}, gradients {}, optimizer state {}, kept activations {} "
      "and a working set of {}; give a budget of at least {}, or lower train.batch or train.seq.",
      format_bytes(budget), given, format_bytes(least), cfg_.preset, shape_.batch, shape_.seq,
      shape_.dtype == at::kBFloat16 ? "bfloat16"
      : shape_.dtype == at::kDouble ? "float64"
                                    : "float32",
      p.peak_at, format_bytes(p.statics.params), format_bytes(p.statics.grads), format_bytes(p.statics.optimizer),
      format_bytes(p.peak - p.statics.total() - p.working_set), format_bytes(p.working_set), format_bytes(least));
  // The fused head keeps the output weight's gradient; the recomputing one may fit lower.
  if (cfg_.loss_head == LossHead::fused) {
    ModelConfig other = cfg_;
    other.loss_head = LossHead::recompute;
    const int64_t other_least = Planner(other, shape_, times_, options_).min_feasible_budget();
    if (other_least < least) {
      text += fmt::format(
          " With model.loss_head=recompute (the loss head keeps the hidden states instead of the output weight's "
          "gradient and recomputes the logits in the backward) the minimum is {}{}.",
          format_bytes(other_least), other_least <= budget ? ", within this budget" : "");
    }
  }
  return text;
}

std::vector<SlotMask> offload_sets(const graph::BlockGraph& block, const cost::LayerPricer& pricer, SlotMask dropped,
                                   bool input_sharded) {
  std::vector<Slot> kept;
  if (!input_sharded && block.slot_bytes(Slot::input) > 0) kept.push_back(Slot::input);
  for (const Slot s : SlotMask::droppable().slots()) {
    if (!dropped.has(s) && block.slot_bytes(s) > 0) kept.push_back(s);
  }
  std::map<Slot, double> added_per_byte;
  for (const Slot s : kept) {
    const cost::LayerCost c = pricer.price(dropped, input_sharded, SlotMask{s});
    added_per_byte[s] = c.host > 0 ? c.copy_added_seconds() / static_cast<double>(c.host) : 0.0;
  }
  std::stable_sort(kept.begin(), kept.end(), [&](Slot a, Slot b) {
    if (added_per_byte[a] != added_per_byte[b]) return added_per_byte[a] < added_per_byte[b];
    return block.slot_bytes(a) > block.slot_bytes(b);
  });
  std::vector<SlotMask> out{SlotMask{}};
  SlotMask moved;
  for (const Slot s : kept) {
    moved.add(s);
    out.push_back(moved);
  }
  return out;
}

std::vector<int> sweep_order(int points) {
  std::vector<int> order;
  if (points <= 0) return order;
  std::vector<bool> taken(static_cast<size_t>(points), false);
  const auto take = [&](int i) {
    if (!taken[static_cast<size_t>(i)]) order.push_back(i);
    taken[static_cast<size_t>(i)] = true;
  };
  take(0);
  take(points - 1);
  // Halve the gaps between taken indices until none is left.
  for (int step = points - 1; step > 1; step = (step + 1) / 2) {
    for (int lo = 0; lo + 1 < points; lo += step) take(std::min(points - 1, lo + step / 2));
  }
  for (int i = 0; i < points; ++i) take(i);
  return order;
}

Frontier Planner::frontier(int points, double seconds) const {
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  const int64_t lo = min_feasible_budget(), hi = none_peak();
  Frontier f;
  f.asked = points;
  std::vector<FrontierPoint> all;
  for (const int i : sweep_order(points)) {
    if (seconds > 0 && f.solved >= 2 && elapsed() > seconds) break;
    const int64_t budget = points == 1 ? hi : lo + (hi - lo) * i / (points - 1);
    ++f.solved;
    if (auto r = solve(budget)) {
      all.push_back({r->prediction.peak, r->prediction.added_seconds(), "budget"});
    }
  }
  std::sort(all.begin(), all.end(), [](const FrontierPoint& a, const FrontierPoint& b) {
    return a.peak != b.peak ? a.peak < b.peak : a.recompute_seconds < b.recompute_seconds;
  });
  for (const auto& p : all) {
    if (f.points.empty() || p.recompute_seconds < f.points.back().recompute_seconds) f.points.push_back(p);
  }
  f.seconds = elapsed();
  return f;
}

}  // namespace remat
