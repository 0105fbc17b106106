#include "remat/pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>

namespace remat::pipeline {

std::vector<Action> actions(Schedule schedule, int64_t stages, int64_t stage, int64_t microbatches) {
  std::vector<Action> out;
  const int64_t warmup = in_flight(schedule, stages, stage, microbatches) - 1;
  int64_t forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) out.push_back({false, forwards});
  for (; forwards < microbatches; ++forwards, ++backwards) {
    out.push_back({false, forwards});
    out.push_back({true, backwards});
  }
  for (; backwards < microbatches; ++backwards) out.push_back({true, backwards});
  return out;
}

bool backward_follows(const std::vector<Action>& order, size_t i) {
  return !order[i].backward && i + 1 < order.size() && order[i + 1].backward &&
         order[i + 1].microbatch == order[i].microbatch;
}

double simulate(Schedule schedule, const std::vector<StageTimes>& stages, int64_t microbatches, double transfer) {
  const auto P = static_cast<int64_t>(stages.size());
  const auto M = static_cast<size_t>(microbatches);
  // When each stage finished each microbatch's forward and backward; -1: not yet.
  std::vector<std::vector<double>> fwd(stages.size(), std::vector<double>(M, -1)), bwd = fwd;
  std::vector<std::vector<Action>> order;
  for (int64_t s = 0; s < P; ++s) order.push_back(actions(schedule, P, s, microbatches));
  std::vector<size_t> next(stages.size(), 0);
  std::vector<double> free_at(stages.size(), 0);
  // Each round runs every action whose input is ready; every schedule makes progress, since
  // the oldest unfinished action of the whole pipeline always has its input.
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int64_t s = 0; s < P; ++s) {
      const auto i = static_cast<size_t>(s);
      while (next[i] < order[i].size()) {
        const Action& a = order[i][next[i]];
        const auto j = static_cast<size_t>(a.microbatch);
        double ready = 0;
        if (!a.backward && s > 0) ready = fwd[i - 1][j] < 0 ? -1 : fwd[i - 1][j] + transfer;
        if (a.backward) ready = s + 1 < P ? (bwd[i + 1][j] < 0 ? -1 : bwd[i + 1][j] + transfer) : fwd[i][j];
        if (ready < 0) break;
        const double start = std::max(ready, free_at[i]);
        free_at[i] = start + (a.backward ? stages[i].backward : stages[i].forward);
        (a.backward ? bwd : fwd)[i][j] = free_at[i];
        ++next[i];
        progressed = true;
      }
    }
  }
  return *std::max_element(free_at.begin(), free_at.end());
}

namespace {

// The single microbatch's walk through a stage's layers: what is kept below the next
// piece (the embedding's saved included) and the highest point so far above the statics.
struct Walk {
  int64_t below = 0;
  int64_t high = 0;
  int64_t host = 0;  // offloaded by the pieces so far
  void add(const Piece& c) {
    high = std::max(high, below + c.top);
    below += c.kept;
    host += c.host;
  }
};

// The stage's peak once its layers are walked: (in flight - 1) microbatches holding all
// they keep, beside one microbatch's highest point (the head's on the last stage), or the
// optimizer step.
int64_t finish(const Frame& f, int64_t in_flight, const Walk& w) {
  const int64_t high = f.head_top >= 0 ? std::max(w.high, w.below + f.head_top) : w.high;
  return std::max(f.statics + (in_flight - 1) * (w.below + f.over) + high, f.statics + f.optimizer);
}

// A partial plan of a stage's first layers and how it was reached.
struct State {
  Walk walk;
  double seconds = 0;
  int64_t prev = -1;  ///< index in the states of position pos - span
  int64_t piece = -1;
};

// Keeps the states no other beats in all of kept bytes, highest point and time (sorted by
// kept bytes, a staircase of the others' points); where `host_width` (a host budget that
// binds), only among states whose host bytes are in one cell of `host_width` bytes. Above
// `max_states`, those in one cell of `width` bytes on the device axes (and `host_width` on
// the host one) merge into two: the fastest, and the one holding least (kept bytes plus
// highest point), which may fit where the fastest will not.
void prune(std::vector<State>& v, int64_t max_states, int64_t width, int64_t host_width) {
  const auto host_cell = [&](const State& s) { return host_width > 0 ? s.walk.host / host_width : 0; };
  std::sort(v.begin(), v.end(), [&](const State& a, const State& b) {
    return std::tuple{host_cell(a), a.walk.below, a.walk.high, a.seconds} <
           std::tuple{host_cell(b), b.walk.below, b.walk.high, b.seconds};
  });
  std::map<int64_t, double> stairs;  // highest point -> least time of the states seen, falling
  std::vector<State> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const State& s = v[i];
    if (i > 0 && host_cell(s) != host_cell(v[i - 1])) stairs.clear();
    auto it = stairs.upper_bound(s.walk.high);
    if (it != stairs.begin() && std::prev(it)->second <= s.seconds) continue;  // beaten
    out.push_back(s);
    // Points at or above this height that are no faster are beaten by it from now on.
    while (it != stairs.end() && it->second >= s.seconds) it = stairs.erase(it);
    stairs[s.walk.high] = s.seconds;
  }
  // The cells widen until at most `max_states` are left: every piece multiplies the
  // states, and offloading pieces spread them over many more cells than the budget's.
  for (int64_t w = width, hw = host_width; static_cast<int64_t>(out.size()) > max_states && w > 0; w *= 2, hw *= 2) {
    std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<State, State>> cells;
    for (const State& s : out) {
      const int64_t host = hw > 0 ? s.walk.host / hw : 0;
      auto [it, fresh] = cells.emplace(std::tuple{s.walk.below / w, s.walk.high / w, host}, std::pair{s, s});
      if (fresh) continue;
      if (s.seconds < it->second.first.seconds) it->second.first = s;
      const State& l = it->second.second;
      if (std::pair{s.walk.below + s.walk.high, s.seconds} < std::pair{l.walk.below + l.walk.high, l.seconds}) {
        it->second.second = s;
      }
    }
    out.clear();
    for (auto& [cell, s] : cells) {
      out.push_back(s.first);
      if (s.second.prev != s.first.prev || s.second.piece != s.first.piece) out.push_back(s.second);
    }
  }
  v = std::move(out);
}

// The best plan of one stage for every layer count it may hold.
struct StageBest {
  bool feasible = false;
  double seconds = 0;
  int64_t peak = 0;
  int64_t kept = 0;
  int64_t host = 0;
  std::vector<int64_t> pieces;
};

std::vector<StageBest> solve_stage(const Problem& p, int64_t stage, int64_t min_n, int64_t max_n) {
  const int64_t k = p.in_flight[static_cast<size_t>(stage)];
  std::vector<Frame> frames(static_cast<size_t>(max_n + 1));
  for (int64_t n = min_n; n <= max_n; ++n) frames[n] = p.frame(stage, n);
  // A partial plan over the budget with the least statics of any count stays over it.
  const Frame& least = frames[static_cast<size_t>(min_n)];
  int64_t floor = least.statics;
  for (int64_t n = min_n; n <= max_n; ++n) floor = std::min(floor, frames[static_cast<size_t>(n)].statics);
  const int64_t width = std::max<int64_t>(1, p.budget / std::max<int64_t>(1, p.max_states));
  // Where the most offloading pieces of every layer together fit the host budget, host
  // bytes cannot decide a plan and the states are pruned without them.
  int64_t most_host = 0;
  for (const Piece& c : p.pieces) most_host = std::max(most_host, c.host / c.span);
  const int64_t host_width = k * most_host * max_n > p.host_budget
                                 ? std::max<int64_t>(1, p.host_budget / std::max<int64_t>(1, p.max_states))
                                 : 0;
  std::vector<std::vector<State>> states(static_cast<size_t>(max_n + 1));
  State start;
  start.walk.below = least.under;
  start.walk.high = least.outside;
  states[0].push_back(start);
  std::vector<StageBest> best(static_cast<size_t>(max_n + 1));
  for (int64_t pos = 0; pos <= max_n; ++pos) {
    auto& here = states[static_cast<size_t>(pos)];
    prune(here, p.max_states, width, host_width);
    if (pos >= min_n) {
      const Frame& f = frames[static_cast<size_t>(pos)];
      for (const State& s : here) {
        const int64_t peak = finish(f, k, s.walk);
        const double t = s.seconds + f.seconds;
        StageBest& b = best[static_cast<size_t>(pos)];
        if (peak <= p.budget && (!b.feasible || t < b.seconds)) {
          b.feasible = true;
          b.seconds = t;
          b.peak = peak;
          b.kept = s.walk.below + f.over;
          b.host = k * s.walk.host;
          b.pieces.clear();
          for (int64_t at = pos, i = &s - here.data(); at > 0;) {
            const State& x = states[static_cast<size_t>(at)][static_cast<size_t>(i)];
            b.pieces.push_back(x.piece);
            at -= p.pieces[static_cast<size_t>(x.piece)].span;
            i = x.prev;
          }
          std::reverse(b.pieces.begin(), b.pieces.end());
        }
      }
    }
    if (pos == max_n) break;
    for (int64_t si = 0; si < static_cast<int64_t>(here.size()); ++si) {
      const State& s = here[static_cast<size_t>(si)];
      for (int64_t pi = 0; pi < static_cast<int64_t>(p.pieces.size()); ++pi) {
        const Piece& c = p.pieces[static_cast<size_t>(pi)];
        if (pos + c.span > max_n) continue;
        State next{s.walk, s.seconds + c.seconds, si, pi};
        next.walk.add(c);
        // Everything below only grows: over the budget now, over it with any more layers.
        if (floor + (k - 1) * (next.walk.below + least.over) + next.walk.high > p.budget) continue;
        if (k * next.walk.host > p.host_budget) continue;
        states[static_cast<size_t>(pos + c.span)].push_back(next);
      }
    }
  }
  return best;
}

}  // namespace

int64_t stage_peak(const Problem& p, const Frame& frame, int64_t in_flight, const std::vector<int64_t>& pieces) {
  Walk w;
  w.below = frame.under;
  w.high = frame.outside;
  for (const int64_t i : pieces) w.add(p.pieces.at(static_cast<size_t>(i)));
  return finish(frame, in_flight, w);
}

std::optional<Solution> solve(const Problem& p) {
  const auto P = static_cast<int64_t>(p.in_flight.size());
  const int64_t L = p.layers;
  if (P < 1 || L < P) {
    throw std::invalid_argument(
        fmt::format("A pipeline of {} stages cannot split {} layers: every stage needs at "
                    "least one layer.",
                    P, L));
  }
  if (!p.split.empty() && static_cast<int64_t>(p.split.size()) != P) {
    throw std::invalid_argument(
        fmt::format("The layer split lists {} stages but the pipeline has {}.", p.split.size(), P));
  }
  std::vector<std::vector<StageBest>> best;
  for (int64_t s = 0; s < P; ++s) {
    const int64_t lo = p.split.empty() ? 1 : p.split[static_cast<size_t>(s)];
    const int64_t hi = p.split.empty() ? L - (P - 1) : lo;
    best.push_back(solve_stage(p, s, lo, hi));
  }
  // The stages from s up, given the layers the stages below hold: the least slowest-stage
  // time, then the least sum of times (a tie's fairer split), and the count stage s takes.
  struct Rest {
    bool feasible = false;
    double slowest = 0;
    double total = 0;
    int64_t n = 0;
  };
  std::vector<std::vector<Rest>> rest(static_cast<size_t>(P + 1), std::vector<Rest>(static_cast<size_t>(L + 1)));
  rest[static_cast<size_t>(P)][static_cast<size_t>(L)] = {true, 0.0, 0.0, 0};
  for (int64_t s = P - 1; s >= 0; --s) {
    for (int64_t used = s; used <= L - (P - s); ++used) {
      Rest& r = rest[static_cast<size_t>(s)][static_cast<size_t>(used)];
      const auto& options = best[static_cast<size_t>(s)];
      for (int64_t n = 1; n < static_cast<int64_t>(options.size()) && used + n <= L; ++n) {
        const StageBest& b = options[static_cast<size_t>(n)];
        const Rest& above = rest[static_cast<size_t>(s + 1)][static_cast<size_t>(used + n)];
        if (!b.feasible || !above.feasible) continue;
        const double slowest = std::max(b.seconds, above.slowest), total = b.seconds + above.total;
        if (!r.feasible || slowest < r.slowest || (slowest == r.slowest && total < r.total)) {
          r = {true, slowest, total, n};
        }
      }
    }
  }
  if (!rest[0][0].feasible) return std::nullopt;
  Solution sol;
  sol.seconds = rest[0][0].slowest;
  for (int64_t s = 0, used = 0; s < P; ++s) {
    const int64_t n = rest[static_cast<size_t>(s)][static_cast<size_t>(used)].n;
    const StageBest& b = best[static_cast<size_t>(s)][static_cast<size_t>(n)];
    sol.stages.push_back({used, n, b.pieces, b.kept, b.peak, b.host, b.seconds});
    if (b.seconds > sol.stages[static_cast<size_t>(sol.bottleneck)].seconds) sol.bottleneck = s;
    used += n;
  }
  return sol;
}

}  // namespace remat::pipeline
