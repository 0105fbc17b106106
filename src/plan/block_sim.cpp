#include "plan/block_sim.h"

#include <algorithm>
#include <utility>

namespace remat::cost {
namespace {

std::vector<graph::TensorInfo> param_infos(const graph::BlockGraph& g, const graph::Node& n) {
  std::vector<graph::TensorInfo> out;
  for (int k : n.params) out.push_back({g.params[k].sizes, g.values[g.input].info.dtype, {}});
  return out;
}

}  // namespace

graph::Events forward_events(const graph::BlockGraph& g, int i, std::vector<int64_t>& bytes) {
  const graph::Node& n = g.nodes[i];
  const auto outs = g.infos(n.outputs);
  for (const auto& o : outs) bytes.push_back(o.bytes());
  graph::Events e(g.device);
  n.op->forward_events(e, g.infos(n.inputs), param_infos(g, n), outs, n.attrs);
  return e;
}

graph::Events backward_events(const graph::BlockGraph& g, int i, std::vector<int64_t>& bytes) {
  const graph::Node& n = g.nodes[i];
  const auto ins = g.infos(n.inputs);
  for (const auto& in : ins) bytes.push_back(in.with_sizes(in.sizes).bytes());
  graph::Events e(g.device);
  n.op->backward_events(e, ins, param_infos(g, n), g.infos(n.outputs), n.attrs);
  return e;
}

namespace {

// `e` folded: its rise above the bytes it starts from, and its results.
Folded fold(const graph::Events& e, const std::vector<int64_t>& bytes) {
  Folded f;
  std::vector<int64_t> temps;  // by handle
  int64_t now = 0;
  for (const auto& ev : e.list()) {
    using K = graph::Events::Event::Kind;
    if (ev.kind == K::out) {
      now += bytes.at(ev.index);
      f.results.emplace_back(ev.index, bytes.at(ev.index));
    }
    if (ev.kind == K::temp) {
      temps.resize(std::max(temps.size(), static_cast<size_t>(ev.handle) + 1));
      temps[ev.handle] = ev.bytes;
      now += ev.bytes;
    }
    if (ev.kind == K::release) now -= temps.at(ev.handle);
    f.rise = std::max(f.rise, now);
  }
  int64_t left = 0;
  for (const auto& r : f.results) left += r.second;
  TORCH_INTERNAL_ASSERT(now == left, "an op's events leave a temporary live");
  return f;
}

}  // namespace

Folds::Folds(const graph::BlockGraph& g, const graph::Lifetimes& lt) {
  for (int i = 0; i < static_cast<int>(g.nodes.size()); ++i) {
    std::vector<int64_t> out_bytes, grad_bytes;
    const graph::Events f = forward_events(g, i, out_bytes);
    forward.push_back(fold(f, out_bytes));
    if (!lt.runs_backward[i]) {
      backward.emplace_back();
      continue;
    }
    const graph::Events b = backward_events(g, i, grad_bytes);
    backward.push_back(fold(b, grad_bytes));
  }
}

uint64_t CopyClock::start(double seconds) {
  copies += seconds;
  if (overlap) {
    const double from = std::max(free, now - ahead);
    runs.emplace_back(from, from + seconds);
    free = from + seconds;
    if (from < now) slowed += slowdown * (std::min(now, free) - from);
  } else {
    waited += seconds;
    now += seconds;
    runs.emplace_back(now - seconds, now);
  }
  return runs.size();
}

void CopyClock::compute(double seconds) {
  while (seconds > 0) {
    while (running < runs.size() && runs[running].second <= now) ++running;
    if (running == runs.size() || slowdown <= 0) {
      now += seconds;
      return;
    }
    const auto [from, to] = runs[running];
    if (from > now) {  // no copy before `from`
      const double alone = std::min(seconds, from - now);
      now += alone;
      seconds -= alone;
      continue;
    }
    const double beside = (to - now) * (1 - slowdown);  // compute done while this copy runs
    if (seconds <= beside) {
      const double wall = seconds / (1 - slowdown);
      slowed += wall - seconds;
      now += wall;
      return;
    }
    slowed += (to - now) - beside;
    now = to;
    seconds -= beside;
  }
}

void CopyClock::await(uint64_t ticket) {
  const double end = runs.at(ticket - 1).second;
  if (end > now) waited += end - std::exchange(now, end);
}

std::vector<double> backward_seconds(const graph::BlockGraph& g, const graph::Lifetimes& lt, const NodeTimes& times) {
  double forward = 0, differentiated = 0;
  std::vector<double> out(g.nodes.size(), 0.0);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    out[i] = times.node_seconds(g.nodes[i]);
    forward += out[i];
    if (lt.runs_backward[i]) differentiated += out[i];
  }
  const double backward = times.layer_pass_seconds > forward ? times.layer_pass_seconds - forward : 2 * forward;
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = lt.runs_backward[i] && differentiated > 0 ? out[i] * backward / differentiated : 0.0;
  }
  return out;
}

void Simulator::replay(const Folded& f, std::vector<SimTensor>& results) {
  live.rise(f.rise);
  for (const auto& [index, bytes] : f.results) results.at(index) = make(bytes);
}

void Simulator::replay(const graph::Events& e, std::vector<SimTensor>& results, const std::vector<int64_t>& bytes) {
  std::map<int64_t, SimTensor> temps;
  for (const auto& ev : e.list()) {
    using K = graph::Events::Event::Kind;
    if (ev.kind == K::out) results.at(ev.index) = make(bytes.at(ev.index));
    if (ev.kind == K::temp) temps[ev.handle] = make(ev.bytes);
    if (ev.kind == K::release) temps.erase(ev.handle);
  }
  TORCH_INTERNAL_ASSERT(temps.empty(), "an op's events leave a temporary live");
}

std::vector<SimTensor> Simulator::forward(int i, const std::vector<SimTensor>& in, bool recompute) {
  const graph::Node& n = g.nodes[i];
  std::vector<SimTensor> res(n.outputs.size());
  for (size_t j = 0; j < res.size(); ++j) {
    if (n.op->view_of(j) >= 0) res[j] = in[n.op->view_of(j)];
  }
  if (folds != nullptr) {
    replay(folds->forward[i], res);
  } else {
    std::vector<int64_t> bytes;
    const graph::Events e = forward_events(g, i, bytes);
    replay(e, res, bytes);
  }
  if (clock != nullptr) clock->compute(times.node_seconds(n));
  if (recompute) {
    if (n.op->kind()[0] != '\0') ++cost.ops[n.op->kind()];
    cost.recompute_flops += n.flops;
    cost.recompute_seconds += times.node_seconds(n);
    cost.recompute_link_seconds += times.node_link_seconds(n);
  }
  return res;
}

std::vector<SimTensor> Simulator::backward(int i, const std::vector<SimTensor>& dy, const std::vector<SimTensor>&,
                                           const std::vector<SimTensor>&) {
  const graph::Node& n = g.nodes[i];
  std::vector<SimTensor> res(n.inputs.size());
  for (size_t j = 0; j < res.size(); ++j) {
    if (n.op->differentiable(j) && n.op->grad_alias(j) >= 0) res[j] = dy[n.op->grad_alias(j)];
  }
  if (folds != nullptr) {
    replay(folds->backward[i], res);
  } else {
    std::vector<int64_t> bytes;
    const graph::Events e = backward_events(g, i, bytes);
    replay(e, res, bytes);
  }
  if (clock != nullptr) clock->compute(backward_times->at(static_cast<size_t>(i)));
  return res;
}

SimTensor Simulator::gather(const SimTensor&) {
  graph::Events e;
  const int64_t whole = g.values[g.input].info.bytes();
  graph::all_gather_events(e, whole, 0);
  std::vector<SimTensor> res(1);
  replay(e, res, {whole});
  const double gather = times.input_gather_seconds(g);
  cost.recompute_seconds += gather;
  cost.recompute_link_seconds += gather;
  if (clock != nullptr) clock->compute(gather);
  return res[0];
}

Simulator::Moved Simulator::relocate(const std::vector<SimTensor>& group, Live& to, int64_t* storages) {
  std::map<const Buffer*, SimTensor> copies;
  Moved m;
  int64_t bytes = 0;
  for (const SimTensor& t : group) {
    SimTensor& c = copies[t.get()];
    if (!c) {
      c = std::make_shared<Buffer>(&to, t->bytes);
      bytes += t->bytes;
    }
    m.tensors.push_back(c);
  }
  const auto n = static_cast<int64_t>(copies.size());
  if (storages != nullptr) *storages += n;
  if (clock != nullptr) m.ticket = clock->start(times.host_copy_seconds(bytes, n));
  return m;
}

LayerCost simulate(const graph::BlockGraph& g, const graph::Lifetimes& lt, const Folds* folds,
                   const std::vector<bool>& keep, bool early_stop, const NodeTimes& times,
                   const std::vector<double>& backward_times, bool backward, graph::InputHold hold, SlotMask offloaded,
                   double fetch_ahead) {
  LayerCost lc;
  Live live, host;
  CopyClock clock;
  clock.overlap = times.host_copies_overlap;
  clock.slowdown = times.host_copy_slowdown;
  Simulator sim{g, live, times, early_stop, lc, folds, &host, &clock, &backward_times};
  const auto input = [&](int v) { return sim.make(g.values[v].external ? 0 : g.values[v].info.bytes()); };
  std::vector<SimTensor> side;
  for (int v : g.side_inputs) side.push_back(input(v));
  graph::BlockRun<Simulator> run(g, lt, keep, true, hold, offloaded);
  run.forward(sim, input(g.input), false, std::move(side)).reset();
  lc.forward_peak = live.peak();
  lc.kept = live.current();
  lc.host = host.current();
  if (!backward) {
    // Copied back as a chunk's recompute does: awaited at once.
    lc.copy_seconds = 2 * clock.copies;
    lc.copy_wait_seconds = clock.waited + clock.copies;
    lc.copy_slowdown_seconds = clock.slowed;
    return lc;
  }
  live.reset_peak();
  const double start = clock.now;
  clock.fetch_ahead(fetch_ahead);
  run.backward(sim, sim.make(g.output_bytes())).reset();
  lc.backward_peak = live.peak();
  lc.backward_clock_seconds = clock.now - start;
  if (!clock.runs.empty()) lc.fetched_by_seconds = std::max(0.0, clock.runs.back().second - start);
  lc.copy_seconds = clock.copies;
  lc.copy_wait_seconds = clock.waited;
  lc.copy_slowdown_seconds = clock.slowed;
  return lc;
}

std::vector<bool> keep_flags(SlotMask dropped) {
  std::vector<bool> keep(kSlotCount, true);
  for (const Slot s : dropped.slots()) keep[static_cast<size_t>(s)] = false;
  return keep;
}

}  // namespace remat::cost
