#include "remat/cost.h"

#include "remat/caching_allocator.h"

#include "remat/ops.h"

#include "remat/schedule.h"

#include "graph/walk.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <tuple>

namespace remat::cost {
namespace {

using ops::nbytes;

// Live bytes of a simulated timeline and the highest total they reached; given a list,
// also each allocation and free of a nonzero size, in order (the caching allocator's view).
class Live {
 public:
  explicit Live(std::vector<memory::AllocatorEvent>* events = nullptr) : events_(events) {}
  // Returns the allocation's id in the event list (-1 when not listed).
  int64_t alloc(int64_t bytes) {
    current_ += bytes;
    peak_ = std::max(peak_, current_);
    if (events_ == nullptr || bytes == 0) return -1;
    events_->push_back({memory::AllocatorEvent::Kind::malloc, next_id_, bytes, 0});
    return next_id_++;
  }
  void free(int64_t id, int64_t bytes) {
    current_ -= bytes;
    if (id >= 0) events_->push_back({memory::AllocatorEvent::Kind::free, id, 0, 0});
  }
  // A rise of `bytes` above the live bytes and back, counted but not listed (a folded node).
  void rise(int64_t bytes) {
    TORCH_INTERNAL_ASSERT(events_ == nullptr, "a timeline that lists its allocations replays every one");
    peak_ = std::max(peak_, current_ + bytes);
  }
  void reset_peak() { peak_ = current_; }
  int64_t current() const { return current_; }
  int64_t peak() const { return peak_; }

 private:
  std::vector<memory::AllocatorEvent>* events_;
  int64_t next_id_ = 0;
  int64_t current_ = 0;
  int64_t peak_ = 0;
};

// A simulated tensor: its bytes count as live from construction to destruction, so the
// walk's handles free simulated memory exactly where the engine's tensors die.
struct Buffer {
  Live* live;
  int64_t bytes;
  int64_t id;
  Buffer(Live* l, int64_t b) : live(l), bytes(b), id(l->alloc(b)) {}
  ~Buffer() { live->free(id, bytes); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};
using SimTensor = std::shared_ptr<Buffer>;

std::vector<graph::TensorInfo> param_infos(const graph::BlockGraph& g, const graph::Node& n) {
  std::vector<graph::TensorInfo> out;
  for (int k : n.params) out.push_back({g.params[k].sizes, g.values[g.input].info.dtype, {}});
  return out;
}

// Node i's forward allocations as its op declares them; `bytes`: each output's.
graph::Events forward_events(const graph::BlockGraph& g, int i, std::vector<int64_t>& bytes) {
  const graph::Node& n = g.nodes[i];
  const auto outs = g.infos(n.outputs);
  for (const auto& o : outs) bytes.push_back(o.bytes());
  graph::Events e(g.device);
  n.op->forward_events(e, g.infos(n.inputs), param_infos(g, n), outs, n.attrs);
  return e;
}

// Node i's backward allocations; `bytes`: each input gradient's.
graph::Events backward_events(const graph::BlockGraph& g, int i, std::vector<int64_t>& bytes) {
  const graph::Node& n = g.nodes[i];
  const auto ins = g.infos(n.inputs);
  for (const auto& in : ins) bytes.push_back(in.with_sizes(in.sizes).bytes());
  graph::Events e(g.device);
  n.op->backward_events(e, ins, param_infos(g, n), g.infos(n.outputs), n.attrs);
  return e;
}

// A node's declared allocations as a timeline that only counts bytes sees them: how far
// they rise above the live bytes they start from, and the results they leave, in order.
struct Folded {
  int64_t rise = 0;
  std::vector<std::pair<int64_t, int64_t>> results;  // result index, bytes
};

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

// Every node's forward and backward folded once, for walks that price many slot choices.
struct Folds {
  std::vector<Folded> forward, backward;
  Folds(const graph::BlockGraph& g, const graph::Lifetimes& lt) {
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
};

// One layer's copies of offloaded slots against its compute: the compute's clock (its
// nodes' times; of each second a copy runs beside it, it loses `slowdown`), when the copies
// started so far run (one after another, beside the compute where they `overlap` it, else
// in its place), how long the compute waited for them and how much longer it ran.
struct CopyClock {
  bool overlap = true;
  double slowdown = 0;
  double now = 0;
  double free = 0;                              // when the copies started so far end
  double ahead = 0;                             // seconds before `now` from which a copy may start (fetch_ahead)
  std::vector<std::pair<double, double>> runs;  // per ticket, from 1: when it starts and ends
  size_t running = 0;                           // the first of `runs` not over at `now`
  double copies = 0, waited = 0, slowed = 0;
  /// The copies started next may run from `seconds` before now, one after another (a
  /// prefetch: the backward above, once its own copies back end), the compute beside them
  /// slowed as beside any other.
  void fetch_ahead(double seconds) {
    ahead = seconds;
    free = now - seconds;
  }
  uint64_t start(double seconds) {
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
  // `seconds` of compute, alone on the device: slower where a copy runs.
  void compute(double seconds) {
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
  void await(uint64_t ticket) {
    const double end = runs.at(ticket - 1).second;
    if (end > now) waited += end - std::exchange(now, end);
  }
};

// Seconds each node's backward takes: the layer's measured pass less its forward, shared
// in proportion to the nodes' forward times; without a measured pass, twice its forward.
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

// The cost model's backend of the block walk: each op replays its declared allocations,
// event by event, or folded where `folds` is given (a timeline that only counts).
struct Simulator {
  using Tensor = SimTensor;
  const graph::BlockGraph& g;
  Live& live;
  const NodeTimes& times;
  bool early;
  LayerCost& cost;
  const Folds* folds = nullptr;
  Live* host = nullptr;                                 // where offloaded memory waits (LayerPlan::offloaded)
  CopyClock* clock = nullptr;                           // null: copies untimed
  const std::vector<double>* backward_times = nullptr;  // per node: its backward's seconds (backward_seconds)

  Tensor make(int64_t bytes) { return std::make_shared<Buffer>(&live, bytes); }

  // The results of a folded node: their bytes come after its rise, which covers them.
  void replay(const Folded& f, std::vector<Tensor>& results) {
    live.rise(f.rise);
    for (const auto& [index, bytes] : f.results) results.at(index) = make(bytes);
  }

  // Replays `e`; result i that the events allocate takes `bytes[i]`.
  void replay(const graph::Events& e, std::vector<Tensor>& results, const std::vector<int64_t>& bytes) {
    std::map<int64_t, Tensor> temps;
    for (const auto& ev : e.list()) {
      using K = graph::Events::Event::Kind;
      if (ev.kind == K::out) results.at(ev.index) = make(bytes.at(ev.index));
      if (ev.kind == K::temp) temps[ev.handle] = make(ev.bytes);
      if (ev.kind == K::release) temps.erase(ev.handle);
    }
    TORCH_INTERNAL_ASSERT(temps.empty(), "an op's events leave a temporary live");
  }

  std::vector<Tensor> forward(int i, const std::vector<Tensor>& in, bool recompute) {
    const graph::Node& n = g.nodes[i];
    std::vector<Tensor> res(n.outputs.size());
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
  std::vector<Tensor> backward(int i, const std::vector<Tensor>& dy, const std::vector<Tensor>&,
                               const std::vector<Tensor>&) {
    const graph::Node& n = g.nodes[i];
    std::vector<Tensor> res(n.inputs.size());
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
  Tensor add(const Tensor& a, const Tensor&) { return make(a->bytes); }
  void dropped(int, const Tensor&) {}
  void refilled(Slot s, const std::vector<Tensor>&) { cost.recomputed_bytes += g.slot_bytes(s); }
  template <class F>
  void recompute(F&& f) {
    f();
  }
  bool early_stop() const { return early; }
  Tensor shard(const Tensor& whole) { return make(whole->bytes / g.tp); }
  Tensor gather(const Tensor&) {
    graph::Events e;
    const int64_t whole = g.values[g.input].info.bytes();
    graph::all_gather_events(e, whole, 0);
    std::vector<Tensor> res(1);
    replay(e, res, {whole});
    const double gather = times.input_gather_seconds(g);
    cost.recompute_seconds += gather;
    cost.recompute_link_seconds += gather;
    if (clock != nullptr) clock->compute(gather);
    return res[0];
  }
  struct Moved {
    std::vector<Tensor> tensors;
    uint64_t ticket = 0;
  };
  Moved offload(const std::vector<Tensor>& group) { return relocate(group, *host, &cost.host_storages); }
  Moved fetch(const std::vector<Tensor>& group) { return relocate(group, live); }
  void await(uint64_t ticket) {
    if (clock != nullptr) clock->await(ticket);
  }
  // A buffer per distinct buffer of `group` on `to`, as the engine copies per storage, and
  // the copy started on the clock; `storages`, when given, counts them.
  Moved relocate(const std::vector<Tensor>& group, Live& to, int64_t* storages = nullptr) {
    std::map<const Buffer*, Tensor> copies;
    Moved m;
    int64_t bytes = 0;
    for (const Tensor& t : group) {
      Tensor& c = copies[t.get()];
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
};

// Every parameter on one tensor-parallel rank of the stage `shape` places, in the model's
// order (embedding, layers, loss head), from the declared graphs: a tied head parameter
// counted once where the stage holds the embedding too, and as the last stage's own copy
// where it does not.
std::vector<graph::Param> stage_params(const ModelConfig& c, const StepShape& shape) {
  std::vector<graph::Param> params;
  std::set<std::string> named;
  const auto add = [&](const graph::BlockGraph& g) {
    for (const auto& p : g.params) {
      if (named.insert(p.name).second) params.push_back(p);
    }
  };
  if (shape.has_embedding()) add(graph::embed_graph(c, 1, 1, at::kFloat, shape.tp));
  const auto block = graph::block_graph(c, 1, 1, at::kFloat, shape.tp).params;
  for (int64_t l = 0; l < shape.stage_layers(c.n_layer); ++l) params.insert(params.end(), block.begin(), block.end());
  if (shape.has_head(c.n_layer)) add(graph::head_graph(c, 1, 1, at::kFloat, 1, shape.tp));
  return params;
}

int64_t numel(const graph::Param& p) { return graph::TensorInfo{p.sizes, at::kFloat, {}}.numel(); }

std::vector<int64_t> param_numels(const ModelConfig& c, const StepShape& shape) {
  std::vector<int64_t> numels;
  for (const graph::Param& p : stage_params(c, shape)) numels.push_back(numel(p));
  return numels;
}

// What the optimizer of the busiest rank holds: the elements whose moments it keeps, and
// the most elements it keeps plus the largest parameter it updates (the step's peak,
// whose temporaries are two of that parameter). One rank: every parameter.
struct OptimizerShare {
  int64_t moments = 0;  // elements, for each of the two moments
  int64_t step = 0;     // max over ranks of 2 x moments + 2 x largest updated, elements
  int rank = 0;         // the rank of that max (the lowest of equals)
  std::vector<int> owner;
};
OptimizerShare optimizer_share(const std::vector<int64_t>& numels, int64_t ranks) {
  OptimizerShare s;
  s.owner = zero_owners(numels, ranks);
  std::vector<int64_t> load(static_cast<size_t>(ranks)), largest(load.size());
  for (size_t i = 0; i < numels.size(); ++i) {
    const auto r = static_cast<size_t>(s.owner[i]);
    load[r] += numels[i];
    largest[r] = std::max(largest[r], numels[i]);
  }
  for (size_t r = 0; r < load.size(); ++r) {
    s.moments = std::max(s.moments, load[r]);
    if (2 * load[r] + 2 * largest[r] > s.step) {
      s.step = 2 * load[r] + 2 * largest[r];
      s.rank = static_cast<int>(r);
    }
  }
  return s;
}
}  // namespace

graph::BlockGraph shape_block(const ModelConfig& cfg, const StepShape& shape) {
  graph::BlockGraph g = graph::block_graph(cfg, shape.batch, shape.seq, shape.dtype, shape.tp, shape.sp);
  g.device = shape.device;
  return g;
}

std::vector<int> zero_owners(const std::vector<int64_t>& numels, int64_t ranks) {
  TORCH_CHECK(ranks >= 1, "zero_owners needs at least one rank, got ", ranks);
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(static_cast<size_t>(ranks));
  std::vector<int> owner(numels.size());
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());  // the first of equal loads
    owner[i] = static_cast<int>(least - load.begin());
    *least += numels[i];
  }
  return owner;
}

double NodeTimes::link_seconds(const graph::LinkTraffic& traffic) const {
  if (link_bytes_per_second <= 0) return 0.0;
  return static_cast<double>(traffic.messages) * link_latency_seconds + traffic.bytes / link_bytes_per_second;
}

double NodeTimes::node_seconds(const graph::Node& n) const {
  auto it = seconds.find(n.name);
  if (it != seconds.end()) return it->second;
  return (flops_per_second > 0 ? n.flops / flops_per_second : 0.0) + link_seconds(n.forward_link);
}

double NodeTimes::node_link_seconds(const graph::Node& n) const {
  if (n.forward_link.none()) return 0.0;
  const auto it = seconds.find(n.name);
  return it != seconds.end() ? it->second : link_seconds(n.forward_link);
}

double NodeTimes::input_gather_seconds(const graph::BlockGraph& block) const {
  const auto it = seconds.find(graph::kInputGather);
  return it == seconds.end() ? link_seconds(block.input_gather()) : it->second;
}

namespace {

// The walk of `g` on the simulator: its forward from its inputs (the caller's take no
// bytes here), keeping by `keep`, and, when `backward`, its backward from the output
// gradient. `kept`: what the forward leaves live for the backward. `folds`: g's, or null
// to replay every declared event. `backward_times`: backward_seconds(g, lt, times).
LayerCost simulate(const graph::BlockGraph& g, const graph::Lifetimes& lt, const Folds* folds,
                   const std::vector<bool>& keep, bool early_stop, const NodeTimes& times,
                   const std::vector<double>& backward_times, bool backward,
                   graph::InputHold hold = graph::InputHold::whole, SlotMask offloaded = {}, double fetch_ahead = 0) {
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

// A block's walk under the slots `dropped`, its input held whole or as this rank's share,
// the slots `offloaded` in host memory between its forward and its backward.
LayerCost simulate(const graph::BlockGraph& g, const graph::Lifetimes& lt, const Folds* folds, SlotMask dropped,
                   bool early_stop, const NodeTimes& times, const std::vector<double>& backward_times, bool backward,
                   bool input_sharded, SlotMask offloaded, double fetch_ahead = 0) {
  std::vector<bool> keep(kSlotCount, true);
  for (const Slot s : dropped.slots()) keep[static_cast<size_t>(s)] = false;
  LayerCost lc = simulate(g, lt, folds, keep, early_stop, times, backward_times, backward,
                          input_sharded ? graph::InputHold::sharded : graph::InputHold::whole, offloaded, fetch_ahead);
  const int64_t away = g.offload_bytes(keep, offloaded, input_sharded);
  const int64_t table = g.kept_bytes(keep, input_sharded) - away;
  TORCH_INTERNAL_ASSERT(lc.kept == table && lc.host == away, "the walk keeps ", lc.kept, " bytes on the device and ",
                        lc.host, " in host memory but the slot table ", table, " and ", away);
  return lc;
}

// The walk of a graph no plan applies to (the embedding, the loss head).
LayerCost simulate_kept(const graph::BlockGraph& g) {
  const graph::Lifetimes lt(g);
  return simulate(g, lt, nullptr, std::vector<bool>(kSlotCount, true), true, NodeTimes{},
                  std::vector<double>(g.nodes.size(), 0.0), /*backward=*/true);
}

}  // namespace

struct LayerPricer::Prepared {
  const graph::BlockGraph& g;
  graph::Lifetimes lt;
  Folds folds;
  bool early_stop;
  NodeTimes times;
  std::vector<double> backward_times;
  Prepared(const graph::BlockGraph& block, bool early, NodeTimes t)
      : g(block),
        lt(block),
        folds(block, lt),
        early_stop(early),
        times(std::move(t)),
        backward_times(backward_seconds(block, lt, times)) {}
};

LayerPricer::LayerPricer(const graph::BlockGraph& block, bool early_stop, NodeTimes times)
    : p_(std::make_shared<const Prepared>(block, early_stop, std::move(times))) {}

LayerCost LayerPricer::price(SlotMask dropped, bool input_sharded, SlotMask offloaded, double fetch_ahead) const {
  return simulate(p_->g, p_->lt, &p_->folds, dropped, p_->early_stop, p_->times, p_->backward_times,
                  /*backward=*/true, input_sharded, offloaded, fetch_ahead);
}

LayerCost LayerPricer::forward(SlotMask dropped, bool input_sharded, SlotMask offloaded) const {
  return simulate(p_->g, p_->lt, &p_->folds, dropped, p_->early_stop, p_->times, p_->backward_times,
                  /*backward=*/false, input_sharded, offloaded);
}

LayerCost price_layer(const graph::BlockGraph& g, SlotMask dropped, bool early_stop, const NodeTimes& times,
                      bool input_sharded, SlotMask offloaded) {
  const graph::Lifetimes lt(g);
  return simulate(g, lt, nullptr, dropped, early_stop, times, backward_seconds(g, lt, times), /*backward=*/true,
                  input_sharded, offloaded);
}

StaticBytes static_bytes(const ModelConfig& model, const StepShape& shape) {
  // The parameters are the same whichever attention op and loss head run: a config whose
  // autos are not resolved yet has them too.
  ModelConfig cfg = model;
  if (cfg.attention == Attention::automatic) cfg.attention = Attention::math;
  if (cfg.loss_head == LossHead::automatic) cfg.loss_head = LossHead::fused;
  TORCH_CHECK(cfg.vocab_size > 0, "The cost model needs model.vocab_size");
  const at::ScalarType master = shape.dtype == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(shape.first_layer >= 0 && shape.in_flight() >= 1 && shape.stage_layers(cfg.n_layer) >= 1 &&
                  shape.first_layer + shape.stage_layers(cfg.n_layer) <= cfg.n_layer,
              "The pipeline stage of layers [", shape.first_layer, ", ", shape.first_layer + shape.layers, ") with ",
              shape.in_flight(), " microbatches in flight is not a stage of a model of ", cfg.n_layer, " layers");
  const std::vector<int64_t> numels = param_numels(cfg, shape);
  const int64_t P = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  StaticBytes s;
  s.params = nbytes(P, master);
  s.grads = nbytes(P, master);
  s.optimizer = 2 * nbytes(optimizer_share(numels, shape.zero_ranks).moments, master);
  s.compute_copies = shape.dtype != master ? nbytes(P, shape.dtype) : 0;
  if (graph::block_graph(cfg, 1, 1, shape.dtype).uses(graph::op::rope())) {
    s.params += ops::rope_tables_bytes(cfg.max_seq, cfg.head_dim(), shape.dtype);
  }
  // Ids for the embedding, targets for the head, of each microbatch in flight.
  const int64_t ends = (shape.has_embedding() ? 1 : 0) + (shape.has_head(cfg.n_layer) ? 1 : 0);
  s.batch = shape.in_flight() * ends * nbytes(shape.batch * shape.seq, at::kLong);
  s.resident = shape.resident;
  return s;
}

StepConstants step_constants(const ModelConfig& cfg, const StepShape& shape) {
  StepConstants k;
  k.statics = static_bytes(cfg, shape);
  if (shape.has_embedding()) {
    const LayerCost embed =
        simulate_kept(graph::embed_graph(cfg, shape.batch, shape.seq, shape.dtype, shape.tp, shape.sp));
    k.embed_peak = embed.forward_peak;
    k.embed_saved = embed.kept;
    k.embed_backward = embed.backward_peak - embed.kept;
  }
  if (shape.has_head(cfg.n_layer)) {
    const LayerCost head =
        simulate_kept(graph::head_graph(cfg, shape.batch, shape.seq, shape.dtype, shape.ce_chunk, shape.tp, shape.sp));
    k.head_peak = std::max(head.forward_peak, head.backward_peak);
    k.head_saved = head.kept;
  }
  // AdamW's denominator: a square root and its quotient, per parameter updated; taken
  // with the moments of the same rank, so that under ZeRO-1 the step's point is the
  // highest of any rank's, not the busiest rank's moments plus another's parameter.
  const at::ScalarType master = shape.dtype == at::kDouble ? at::kDouble : at::kFloat;
  k.optimizer = nbytes(optimizer_share(param_numels(cfg, shape), shape.zero_ranks).step, master) - k.statics.optimizer;
  return k;
}

StepPrediction predict_step(const ModelConfig& cfg, const StepShape& shape, const ActivationPlan& plan, bool early_stop,
                            const NodeTimes& times) {
  TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == cfg.n_layer, "The activation plan has ", plan.layers.size(),
              " layers but the model has ", cfg.n_layer);
  TORCH_CHECK(shape.grad_accum >= 1, "A step runs at least one microbatch, got ", shape.grad_accum);
  const StepConstants k = step_constants(cfg, shape);  // checks the stage
  // The stage's layers [F, E).
  const int64_t F = shape.first_layer, E = F + shape.stage_layers(cfg.n_layer);
  const graph::BlockGraph block = shape_block(cfg, shape);
  const int64_t input_bytes = block.slot_bytes(Slot::input), out_bytes = block.values[block.output].info.bytes();
  StepPrediction p;
  p.statics = k.statics;
  p.first_layer = F;
  p.embedding = k.embed_saved;
  p.head = k.head_saved;

  // Layers running the other attention op (LayerPlan::attention): its graph and times.
  const auto runs_other = [&](const LayerPlan& lp) { return lp.attention && *lp.attention != cfg.attention; };
  std::optional<graph::BlockGraph> other_block;
  for (int64_t l = F; l < E; ++l) {
    if (!runs_other(plan.layers[l]) || other_block) continue;
    const OtherAttention* other = times.other_attention.get();
    TORCH_CHECK(other != nullptr && other->op == *plan.layers[l].attention, "The activation plan runs ",
                attention_name(*plan.layers[l].attention), " attention in layer ", l + 1, " of a model of ",
                attention_name(cfg.attention), " attention, but its times do not price that op");
    ModelConfig c = cfg;
    c.attention = other->op;
    other_block = shape_block(c, shape);
  }
  // Prices per distinct slot choice (layers of one policy mostly share a few).
  const LayerPricer pricer(block, early_stop, times);
  std::optional<LayerPricer> other_pricer;
  if (other_block) other_pricer.emplace(*other_block, early_stop, times.other_attention->times);
  std::map<std::tuple<SlotMask, bool, SlotMask, bool, double>, LayerCost> priced;
  auto price = [&](const LayerPlan& lp, bool other, double fetch_ahead = 0) -> const LayerCost& {
    const auto key = std::tuple{lp.dropped, lp.input_sharded, lp.offloaded, other, fetch_ahead};
    auto it = priced.find(key);
    if (it == priced.end()) {
      it = priced
               .emplace(key,
                        (other ? *other_pricer : pricer).price(lp.dropped, lp.input_sharded, lp.offloaded, fetch_ahead))
               .first;
    }
    return it->second;
  };
  // A uniform chunk's layers: their first forward keeps only the chunk's input (its first
  // layer), and the chunk's recompute rebuilds each whole. Priced from the top: a layer that
  // prefetches starts its copies back once the layer above's have ended, and has the rest
  // of that layer's backward ahead of its own.
  const LayerCost& whole = price(LayerPlan{}, false);
  p.layers.resize(static_cast<size_t>(E - F));
  for (int64_t l = E - 1; l >= F; --l) {
    const LayerPlan& lp = plan.layers[l];
    LayerCost& c = p.layers[static_cast<size_t>(l - F)];
    if (plan.chunk_of(l) < 0) {
      const LayerCost* above = plan.prefetches(l, E) ? &p.layers[static_cast<size_t>(l + 1 - F)] : nullptr;
      c = price(lp, runs_other(lp), above ? above->backward_clock_seconds - above->fetched_by_seconds : 0.0);
      continue;
    }
    TORCH_CHECK(!runs_other(lp), "The activation plan runs ", attention_name(*lp.attention), " attention in layer ",
                l + 1, ", which is in a uniform chunk; a chunk's layers run the model's attention op");
    c = pricer.forward(first_forward_drops(plan, l), lp.input_sharded, lp.offloaded);
    c.backward_peak = whole.backward_peak;
  }
  p.kept_activations = k.embed_saved + k.head_saved;
  for (const LayerCost& c : p.layers) p.kept_activations += c.kept;
  double block_seconds = 0, block_link_seconds = 0;
  for (const auto& n : block.nodes) {
    block_seconds += times.node_seconds(n);
    block_link_seconds += times.node_link_seconds(n);
  }

  // The step's actions in the order the engine runs them: `live` is what is held between
  // actions (the statics and every microbatch's kept activations, `held` per layer), and
  // each action's own working bytes rise above it.
  const int64_t base = p.statics.total();
  int64_t live = base;
  std::vector<std::vector<int64_t>> held(static_cast<size_t>(shape.grad_accum), std::vector<int64_t>(E - F));
  // Host memory the same way: what each microbatch's layers offloaded, until their backward
  // (or their chunk's recompute) brings it back.
  int64_t host = 0;
  std::vector<std::vector<int64_t>> away(held);
  const auto consider = [&](int64_t bytes, int64_t kept_now, const std::string& where) {
    if (bytes > p.peak) {
      p.peak = bytes;
      p.peak_at = where;
      p.working_set = bytes - kept_now;
    }
  };
  const auto layer_name = [](const char* what, int64_t l) { return fmt::format("{} of layer {}", what, l + 1); };
  const auto add_recompute = [&](const LayerCost& c, bool first_microbatch) {
    for (const auto& [kind, n] : c.ops) p.ops[kind] += n;
    p.recompute_flops += c.recompute_flops;
    p.recompute_seconds += c.recompute_seconds;
    p.recompute_link_seconds += c.recompute_link_seconds;
    if (first_microbatch) p.recomputed_bytes += c.recomputed_bytes;
  };
  LayerCost rebuild;  // the recompute of one whole layer of a chunk
  for (const auto& n : block.nodes) {
    if (n.op->kind()[0] != '\0') ++rebuild.ops[n.op->kind()];
  }
  rebuild.recompute_flops = block.forward_flops();
  rebuild.recompute_seconds = block_seconds;
  rebuild.recompute_link_seconds = block_link_seconds;
  rebuild.recomputed_bytes = whole.kept - input_bytes;
  const schedule::Stage stage{F, E, shape.has_embedding(), shape.has_head(cfg.n_layer)};
  for (const schedule::Action& a :
       schedule::step(plan, stage, shape.schedule, shape.stages, shape.stage, shape.grad_accum)) {
    const bool first_microbatch = a.microbatch == 0;
    std::vector<int64_t>* mine = a.microbatch >= 0 ? &held[static_cast<size_t>(a.microbatch)] : nullptr;
    const auto at = [&](int64_t l) -> int64_t& { return (*mine)[static_cast<size_t>(l - F)]; };
    // The layer's offloaded bytes back on the device, held with its kept ones until its
    // backward (whose peak counts both).
    const auto fetch = [&](int64_t l) {
      int64_t& bytes = away[static_cast<size_t>(a.microbatch)][static_cast<size_t>(l - F)];
      at(l) += bytes;
      live += bytes;
      host -= std::exchange(bytes, 0);
    };
    switch (a.kind) {
      case schedule::Kind::embed_forward:
        consider(live + k.embed_peak, live, "embedding forward");
        live += k.embed_saved;
        break;
      case schedule::Kind::forward: {
        const LayerCost& c = p.layers[static_cast<size_t>(a.layer - F)];
        consider(live + c.forward_peak, live, layer_name("forward", a.layer));
        at(a.layer) = c.kept;
        live += c.kept;
        away[static_cast<size_t>(a.microbatch)][static_cast<size_t>(a.layer - F)] = c.host;
        host += c.host;
        p.host_peak = std::max(p.host_peak, host);
        p.offloaded_bytes += c.host;
        p.copy_seconds += c.copy_seconds;
        p.copy_wait_seconds += c.copy_wait_seconds;
        p.copy_slowdown_seconds += c.copy_slowdown_seconds;
        if (runs_other(plan.layers[a.layer])) p.attention_seconds += times.other_attention->pass_delta;
        break;
      }
      case schedule::Kind::head_forward:
        consider(live + k.head_peak, live, "loss head");
        live += k.head_saved;
        break;
      case schedule::Kind::head_backward:  // its peak is the head's, taken at its forward
        live -= k.head_saved;
        break;
      case schedule::Kind::recompute: {
        // With the output gradient live, the chunk's layers are rebuilt whole, each over
        // the ones under it; a sharded input is gathered first, beside its share.
        for (int64_t j = a.layer; j <= a.last; ++j) {
          fetch(j);
          live -= at(j);
        }
        if (plan.layers[a.layer].input_sharded) {
          consider(live + out_bytes + at(a.layer) + 2 * input_bytes, live + at(a.layer),
                   layer_name("recompute", a.layer));
          const double gather = times.input_gather_seconds(block);
          p.recompute_seconds += gather;
          p.recompute_link_seconds += gather;
        }
        for (int64_t j = a.layer; j <= a.last; ++j) {
          consider(live + out_bytes + whole.forward_peak, live, layer_name("recompute", j));
          at(j) = whole.kept;
          live += whole.kept;
          add_recompute(rebuild, first_microbatch);
        }
        break;
      }
      case schedule::Kind::fetch:
        fetch(a.layer);
        break;
      case schedule::Kind::backward: {
        const bool chunked = plan.chunk_of(a.layer) >= 0;
        const LayerCost& c = p.layers[static_cast<size_t>(a.layer - F)];
        fetch(a.layer);
        live -= at(a.layer);
        at(a.layer) = 0;
        consider(live + c.backward_peak, live, layer_name("backward", a.layer));
        if (!chunked) add_recompute(c, first_microbatch);
        break;
      }
      case schedule::Kind::embed_backward:
        consider(live + k.embed_backward, live, "embedding backward");
        live -= k.embed_saved;
        break;
      case schedule::Kind::optimizer:
        TORCH_INTERNAL_ASSERT(live == base && host == 0, "the simulated step ends its microbatches with ", live - base,
                              " bytes of activations still held and ", host, " in host memory");
        consider(live + k.optimizer, live, "optimizer step");
        break;
    }
  }
  return p;
}

}  // namespace remat::cost

namespace remat::cost {
namespace {

// A graph with its lifetimes, at a stable address for the runs that refer to both.
struct Shaped {
  graph::BlockGraph g;
  graph::Lifetimes lt;
  explicit Shaped(graph::BlockGraph graph) : g(std::move(graph)), lt(g) {}
};
using Run = graph::BlockRun<Simulator>;

// A microbatch's runs between its forward and its backward, and the tensor between parts.
struct MicrobatchRuns {
  std::unique_ptr<Run> embed, head;
  std::vector<std::unique_ptr<Run>> layers;  // from the stage's first layer
  SimTensor x, dx;
};

}  // namespace

SlotMask first_forward_drops(const ActivationPlan& plan, int64_t l) {
  const LayerPlan& lp = plan.layers.at(static_cast<size_t>(l));
  if (plan.chunk_of(l) < 0) return lp.dropped;
  SlotMask all = SlotMask::droppable();
  if (lp.chunk_begin >= 0) all.add(Slot::input);
  return all;
}

DeviceMemory predict_device_memory(const ModelConfig& cfg, const StepShape& shape, const ActivationPlan& plan,
                                   bool early_stop, const memory::AllocatorRules& rules, int64_t workspace) {
  memory::CachingAllocatorModel allocator(rules);
  for (const auto& e : step_allocations(cfg, shape, plan, early_stop, 2, workspace)) allocator.apply(e);
  return {allocator.peak_allocated(), allocator.peak_reserved()};
}

std::vector<memory::AllocatorEvent> step_allocations(const ModelConfig& cfg, const StepShape& shape,
                                                     const ActivationPlan& plan, bool early_stop, int64_t steps,
                                                     int64_t workspace) {
  TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == cfg.n_layer, "The activation plan has ", plan.layers.size(),
              " layers but the model has ", cfg.n_layer);
  TORCH_CHECK(shape.grad_accum >= 1 && steps >= 1, "A step runs at least one microbatch, got ", shape.grad_accum,
              ", and at least one step is simulated, got ", steps);
  static_bytes(cfg, shape);  // checks the stage
  const int64_t F = shape.first_layer, E = F + shape.stage_layers(cfg.n_layer);
  const bool has_head = shape.has_head(cfg.n_layer);
  std::vector<memory::AllocatorEvent> events;
  Live live(&events), host;
  LayerCost unused;
  const NodeTimes untimed;
  const auto sim = [&](const Shaped& s) { return Simulator{s.g, live, untimed, early_stop, unused, nullptr, &host}; };
  const auto make = [&](int64_t bytes) { return std::make_shared<Buffer>(&live, bytes); };
  // The caller's inputs (token ids, targets) are in the batch bytes, as in the walk of a part.
  const auto input = [&](const Shaped& s, int v) {
    return make(s.g.values[v].external ? 0 : s.g.values[v].info.bytes());
  };

  const Shaped embed(graph::embed_graph(cfg, shape.batch, shape.seq, shape.dtype, shape.tp, shape.sp));
  const Shaped head(graph::head_graph(cfg, shape.batch, shape.seq, shape.dtype, shape.ce_chunk, shape.tp, shape.sp));
  std::map<Attention, std::unique_ptr<Shaped>> blocks;
  const auto block_of = [&](int64_t l) -> const Shaped& {
    const Attention op = plan.layers[static_cast<size_t>(l)].attention.value_or(cfg.attention);
    auto& b = blocks[op];
    if (!b) {
      ModelConfig c = cfg;
      c.attention = op;
      b = std::make_unique<Shaped>(shape_block(c, shape));
    }
    return *b;
  };
  const std::vector<bool> keep_all(kSlotCount, true);

  // What the step holds throughout, as the model and trainer allocate it: each parameter,
  // the rotary tables, the gradients' one flat buffer, the batches in flight, the BLAS workspace.
  const at::ScalarType master = shape.dtype == at::kDouble ? at::kDouble : at::kFloat;
  const std::vector<graph::Param> params = stage_params(cfg, shape);
  std::vector<SimTensor> held;
  int64_t P = 0;
  for (const graph::Param& p : params) {
    held.push_back(make(nbytes(numel(p), master)));
    P += numel(p);
  }
  if (block_of(F).g.uses(graph::op::rope())) {
    held.push_back(make(ops::rope_tables_bytes(cfg.max_seq, cfg.head_dim(), shape.dtype)));
  }
  held.push_back(make(nbytes(P, master)));
  const int64_t ends = (shape.has_embedding() ? 1 : 0) + (has_head ? 1 : 0);
  for (int64_t b = 0; b < shape.in_flight() * ends; ++b)
    held.push_back(make(nbytes(shape.batch * shape.seq, at::kLong)));
  held.push_back(make(workspace));

  // The busiest rank's parameters, in AdamW's order: its group of matrices, then the rest.
  std::vector<int64_t> numels;
  for (const graph::Param& p : params) numels.push_back(numel(p));
  const OptimizerShare share = optimizer_share(numels, shape.zero_ranks);
  std::vector<size_t> updated;
  for (const bool matrices : {true, false}) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (share.owner[i] == share.rank && (params[i].sizes.size() >= 2) == matrices) updated.push_back(i);
    }
  }

  std::vector<SimTensor> copies, moments;
  const schedule::Stage stage{F, E, shape.has_embedding(), has_head};
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<MicrobatchRuns> mbs(static_cast<size_t>(shape.grad_accum));
    for (auto& mb : mbs) mb.layers.resize(static_cast<size_t>(E - F));
    // The compute dtype's copies of the parameters, cast again after every update.
    if (shape.dtype != master) {
      copies.clear();
      for (const int64_t n : numels) copies.push_back(make(nbytes(n, shape.dtype)));
    }
    for (const schedule::Action& a :
         schedule::step(plan, stage, shape.schedule, shape.stages, shape.stage, shape.grad_accum)) {
      MicrobatchRuns* mb = a.microbatch >= 0 ? &mbs[static_cast<size_t>(a.microbatch)] : nullptr;
      const auto run_of = [&](int64_t l) -> std::unique_ptr<Run>& { return mb->layers[static_cast<size_t>(l - F)]; };
      switch (a.kind) {
        case schedule::Kind::embed_forward: {
          Simulator s = sim(embed);
          mb->embed = std::make_unique<Run>(embed.g, embed.lt, keep_all);
          mb->x = mb->embed->forward(s, input(embed, embed.g.input));
          break;
        }
        case schedule::Kind::forward: {
          const Shaped& b = block_of(a.layer);
          Simulator s = sim(b);
          if (!mb->x) mb->x = input(b, b.g.input);  // a later stage receives its input
          std::vector<bool> keep(keep_all);
          for (const Slot slot : first_forward_drops(plan, a.layer).slots()) keep[static_cast<size_t>(slot)] = false;
          const LayerPlan& lp = plan.layers[static_cast<size_t>(a.layer)];
          run_of(a.layer) = std::make_unique<Run>(
              b.g, b.lt, keep, true, lp.input_sharded ? graph::InputHold::sharded : graph::InputHold::whole,
              lp.offloaded);
          mb->x = run_of(a.layer)->forward(s, std::move(mb->x));
          if (a.layer == E - 1 && !has_head) mb->x.reset();  // sent to the next stage
          break;
        }
        case schedule::Kind::head_forward: {
          Simulator s = sim(head);
          std::vector<SimTensor> side;
          for (const int v : head.g.side_inputs) side.push_back(input(head, v));
          mb->head = std::make_unique<Run>(head.g, head.lt, keep_all);
          mb->head->forward(s, std::move(mb->x), false, std::move(side)).reset();
          break;
        }
        case schedule::Kind::head_backward: {
          Simulator s = sim(head);
          mb->dx = mb->head->backward(s, make(head.g.output_bytes()));
          mb->head.reset();
          break;
        }
        case schedule::Kind::fetch: {
          Simulator s = sim(block_of(a.layer));
          run_of(a.layer)->start_fetch(s);
          break;
        }
        case schedule::Kind::recompute: {
          const Shaped& b = block_of(a.layer);  // a chunk's layers run the model's op
          Simulator s = sim(b);
          if (!mb->dx) mb->dx = make(b.g.output_bytes());  // an earlier stage receives its output's gradient
          run_of(a.layer)->restore(s);
          run_of(a.layer)->settle(s);
          SimTensor x = run_of(a.layer)->value(b.g.input);
          for (int64_t j = a.layer; j <= a.last; ++j) {
            auto fresh = std::make_unique<Run>(b.g, b.lt, keep_all);
            x = fresh->forward(s, std::move(x), /*recompute=*/true);
            run_of(j) = std::move(fresh);
          }
          break;
        }
        case schedule::Kind::backward: {
          const Shaped& b = block_of(a.layer);
          Simulator s = sim(b);
          if (!mb->dx) mb->dx = make(b.g.output_bytes());  // an earlier stage receives its output's gradient
          mb->dx = run_of(a.layer)->backward(s, std::move(mb->dx));
          run_of(a.layer).reset();
          if (a.layer == F && !shape.has_embedding()) mb->dx.reset();  // sent to the previous stage
          break;
        }
        case schedule::Kind::embed_backward: {
          Simulator s = sim(embed);
          mb->embed->backward(s, std::move(mb->dx)).reset();
          mb->embed.reset();
          break;
        }
        case schedule::Kind::optimizer: {
          // The gradient norm: each gradient squared, then summed to one element.
          std::vector<SimTensor> sums;
          for (const int64_t n : numels) {
            const SimTensor squared = make(nbytes(n, master));
            sums.push_back(make(nbytes(1, master)));
          }
          sums.clear();
          // AdamW creates an updated parameter's moments at its first update; its
          // denominator is a square root and that root's quotient, both live at once.
          for (const size_t i : updated) {
            const int64_t bytes = nbytes(numels[i], master);
            if (step == 0) {
              moments.push_back(make(bytes));
              moments.push_back(make(bytes));
            }
            SimTensor root = make(bytes);
            const SimTensor quotient = make(bytes);
            root.reset();
          }
          break;
        }
      }
    }
  }
  // What the steps hold throughout stays live: the list ends with the last step.
  std::vector<memory::AllocatorEvent> out;
  out.swap(events);
  return out;
}

}  // namespace remat::cost
