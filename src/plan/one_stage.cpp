// The one-stage program: a dynamic program over the layers, from the bottom, of the
// partial plans (bytes the layers below keep, time, host bytes) that fit the budget.
#include "plan/planner_detail.h"

#include <fmt/format.h>

#include <map>

namespace remat {
namespace {

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
// more kept bytes, host bytes and time is taken, and the merge is by both byte counts, in
// cells that widen until at most `max_states` are left (offloading spreads the states
// over up to `max_states` cells on each axis).
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
  if (static_cast<int64_t>(out.size()) > max_states && width > 0 && host_width == 0) {
    std::vector<State> merged;
    for (const auto& s : out) {
      // Sorted by kept bytes with falling time: the later state of a bucket is the
      // faster one, and it stands for the bucket with its own (larger) kept bytes.
      if (!merged.empty() && s.kept / width == merged.back().kept / width) {
        merged.back() = s;
      } else {
        merged.push_back(s);
      }
    }
    out = std::move(merged);
  }
  for (int64_t w = width, hw = host_width; static_cast<int64_t>(out.size()) > max_states && w > 0 && hw > 0;
       w *= 2, hw *= 2) {
    std::vector<State> merged;
    std::map<std::pair<int64_t, int64_t>, size_t> bucket;
    for (const auto& s : out) {
      const auto [at, added] = bucket.try_emplace({s.kept / w, s.host / hw}, merged.size());
      if (added) {
        merged.push_back(s);
      } else if (s.seconds < merged[at->second].seconds) {
        merged[at->second] = s;
      }
    }
    std::sort(merged.begin(), merged.end(), [](const State& a, const State& b) {
      return a.kept != b.kept ? a.kept < b.kept : a.seconds < b.seconds;
    });
    out = std::move(merged);
  }
  v = std::move(out);
}

// What reaches a position of the feasibility program: bytes kept below it, and offloaded.
using Reach = std::pair<int64_t, int64_t>;

// `here` by kept bytes, with strictly falling host bytes; above `max_states`, those closer
// than `width` kept bytes merge into the one offloading least.
void reach_front(std::vector<Reach>& here, int64_t max_states, int64_t width) {
  std::sort(here.begin(), here.end());
  std::vector<Reach> front;
  for (const Reach& r : here) {
    if (front.empty() || r.second < front.back().second) front.push_back(r);
  }
  if (static_cast<int64_t>(front.size()) > max_states) {
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
}

}  // namespace

std::optional<PlanResult> Planner::solve_one(int64_t budget, const Options& o) const {
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
      o.host_binds ? std::max<int64_t>(1, o.host / std::max<int64_t>(1, options_.max_states)) : 0;
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
        if (s.kept + top > room || s.host + host > o.host) continue;
        states[to].push_back({s.kept + kept, s.seconds + seconds, pos, si, option, n, sharded, s.host + host});
      }
    };
    for (int64_t oi = 0; oi < static_cast<int64_t>(o.frontier->size()); ++oi) {
      const LayerOption& opt = (*o.frontier)[oi];
      extend(pos + 1, detail::top(opt), opt.cost.kept, opt.cost.host, opt.seconds, oi, 0, false);
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
    place(plan, s.prev_pos, {s.option, s.chunk, s.sharded}, o);
    i = s.prev_index;
    pos = s.prev_pos;
  }
  return predicted_within(std::move(plan), budget, o);
}

std::optional<PlanResult> Planner::predicted_within(ActivationPlan plan, int64_t budget, const Options& o) const {
  plan.policy = fmt::format("budget:{}", budget);
  cost::StepPrediction predicted = cost::predict_step(cfg_, shape_, layout_, plan, options_.early_stop, times_);
  prefetch_where_it_pays(plan, layout_, budget, predicted);
  TORCH_INTERNAL_ASSERT(predicted.peak <= budget, "the planner's plan peaks at ", predicted.peak, " over the budget ",
                        budget);
  TORCH_INTERNAL_ASSERT(predicted.host_peak <= o.host, "the planner's plan offloads ", predicted.host_peak,
                        " bytes, over the host budget ", o.host);
  return assemble(std::move(plan), {cfg_.n_layer}, {std::move(predicted)});
}

bool Planner::fits_one(int64_t budget, const Options& o) const {
  // Feasibility depends only on the bytes kept below each layer, and with a binding host
  // budget on the bytes offloaded there: the partial plans no other keeps and offloads
  // less than at each position decide it (one, the least-kept, when the host cannot bind).
  if (fixed_peak_ > budget) return false;
  const int64_t L = cfg_.n_layer;
  const auto host_of = [&](int64_t host) { return o.host_binds ? host : 0; };
  const int64_t width = std::max<int64_t>(1, none_peak() / std::max<int64_t>(1, options_.max_states));
  const int64_t room = budget - emb_base_;
  std::vector<std::vector<Reach>> reach(L + 1);
  reach[0].push_back({0, 0});
  for (int64_t pos = 0; pos <= L; ++pos) {
    reach_front(reach[pos], options_.max_states, width);
    if (pos == L) break;
    for (const auto& [k, h] : reach[pos]) {
      for (const auto& opt : *o.frontier) {
        if (k + detail::top(opt) <= room && h + host_of(opt.cost.host) <= o.host) {
          reach[pos + 1].push_back({k + opt.cost.kept, h + host_of(opt.cost.host)});
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
}

}  // namespace remat
