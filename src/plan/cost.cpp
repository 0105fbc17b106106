#include "remat/cost.h"

#include "remat/ops.h"

#include "graph/walk.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace remat::cost {
namespace {

using ops::nbytes;

// Live bytes of a simulated timeline and the highest total they reached; the head's
// program names its tensors, the blocks' walk holds them as Buffers.
class Live {
 public:
  void alloc(int64_t bytes) {
    current_ += bytes;
    peak_ = std::max(peak_, current_);
  }
  void free(int64_t bytes) { current_ -= bytes; }
  void reset_peak() { peak_ = current_; }
  void alloc(const std::string& name, int64_t bytes) {
    TORCH_INTERNAL_ASSERT(!tensors_.count(name), "cost program allocates ", name, " while it is live");
    tensors_[name] = bytes;
    current_ += bytes;
    peak_ = std::max(peak_, current_);
  }
  void free(const std::string& name) {
    auto it = tensors_.find(name);
    TORCH_INTERNAL_ASSERT(it != tensors_.end(), "cost program frees ", name, ", which is not live");
    current_ -= it->second;
    tensors_.erase(it);
  }
  bool has(const std::string& name) const { return tensors_.count(name) > 0; }
  int64_t current() const { return current_; }
  int64_t peak() const { return peak_; }

 private:
  std::map<std::string, int64_t> tensors_;
  int64_t current_ = 0;
  int64_t peak_ = 0;
};

// A simulated tensor: its bytes count as live from construction to destruction, so the
// walk's handles free simulated memory exactly where the engine's tensors die.
struct Buffer {
  Live* live;
  int64_t bytes;
  Buffer(Live* l, int64_t b) : live(l), bytes(b) { live->alloc(b); }
  ~Buffer() { live->free(bytes); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};
using SimTensor = std::shared_ptr<Buffer>;

// The cost model's backend of the block walk: each op replays its declared allocations.
struct Simulator {
  using Tensor = SimTensor;
  const graph::BlockGraph& g;
  Live& live;
  const NodeTimes& times;
  bool early;
  LayerCost& cost;

  Tensor make(int64_t bytes) { return std::make_shared<Buffer>(&live, bytes); }

  std::vector<graph::TensorInfo> params(const graph::Node& n) const {
    std::vector<graph::TensorInfo> out;
    for (int k : n.params) out.push_back({g.params[k].sizes, g.values[g.input].info.dtype, {}});
    return out;
  }

  // Replays `e`; result i that the events allocate takes `bytes[i]`.
  void replay(const graph::Events& e, std::vector<Tensor>& results, const std::vector<int64_t>& bytes) {
    std::map<int64_t, Tensor> temps;
    for (const auto& ev : e.list()) {
      using K = graph::Events::Event::Kind;
      if (ev.kind == K::out) results.at(ev.index) = make(bytes.at(ev.index));
      if (ev.kind == K::temp) temps[ev.handle] = make(ev.bytes);
      if (ev.kind == K::release) temps.erase(ev.handle);
      if (ev.kind == K::adopt) results.at(ev.index) = std::move(temps.at(ev.handle));
    }
    TORCH_INTERNAL_ASSERT(std::all_of(temps.begin(), temps.end(), [](const auto& t) { return !t.second; }),
                          "an op's events leave a temporary live");
  }

  std::vector<Tensor> forward(int i, const std::vector<Tensor>& in, bool recompute) {
    const graph::Node& n = g.nodes[i];
    const auto outs = g.infos(n.outputs);
    std::vector<Tensor> res(outs.size());
    std::vector<int64_t> bytes;
    for (size_t j = 0; j < outs.size(); ++j) {
      bytes.push_back(outs[j].bytes());
      if (n.op->view_of(j) >= 0) res[j] = in[n.op->view_of(j)];
    }
    graph::Events e;
    n.op->forward_events(e, g.infos(n.inputs), params(n), outs, n.attrs);
    replay(e, res, bytes);
    if (recompute) {
      if (n.op->kind()[0] != '\0') ++cost.ops[n.op->kind()];
      cost.recompute_flops += n.flops;
      cost.recompute_seconds += times.node_seconds(n);
    }
    return res;
  }
  std::vector<Tensor> backward(int i, const std::vector<Tensor>& dy, const std::vector<Tensor>&,
                               const std::vector<Tensor>&) {
    const graph::Node& n = g.nodes[i];
    const auto ins = g.infos(n.inputs);
    std::vector<Tensor> res(ins.size());
    std::vector<int64_t> bytes;
    for (size_t j = 0; j < ins.size(); ++j) {
      bytes.push_back(ins[j].with_sizes(ins[j].sizes).bytes());
      if (n.op->differentiable(j) && n.op->grad_alias(j) >= 0) res[j] = dy[n.op->grad_alias(j)];
    }
    graph::Events e;
    n.op->backward_events(e, ins, params(n), g.infos(n.outputs), n.attrs);
    replay(e, res, bytes);
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
};

// Largest parameter (bytes of one master copy) and the parameter count.
std::pair<int64_t, int64_t> param_counts(const ModelConfig& c) {
  const int64_t C = c.d_model, F = c.d_ff, V = c.vocab_size, L = c.n_layer;
  if (c.arch == Arch::gpt2) {
    const int64_t block = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + F * C + F + C * F + C;
    return {V * C + c.max_seq * C + L * block + 2 * C, std::max({V * C, c.max_seq * C, F * C, 3 * C * C})};
  }
  const int64_t KV = c.n_kv_head * c.head_dim();
  const int64_t block = 2 * C + 2 * C * C + 2 * KV * C + 3 * F * C;
  return {2 * V * C + C + L * block, std::max(V * C, F * C)};
}

// Live bytes while the loss head runs, from the last block's output to the gradient it
// hands the last block; and the bytes it keeps between its forward and backward.
struct HeadCost {
  int64_t peak = 0;
  int64_t saved = 0;
};

HeadCost head_cost(const ModelConfig& c, const StepShape& s) {
  const at::ScalarType f = s.dtype, sd = ops::stats_dtype(f);
  const int64_t N = s.batch * s.seq, D = nbytes(N * c.d_model, f), n = std::min(s.ce_chunk, N);
  const int64_t stats = (c.arch == Arch::gpt2 ? 2 : 1) * nbytes(N, sd);
  const int64_t logits = nbytes(n * c.vocab_size, sd), logits_f = f != sd ? nbytes(n * c.vocab_size, f) : 0;
  Live h;
  h.alloc("x", D);
  h.alloc("norm.out", D);
  h.alloc("norm.stats", stats);
  h.alloc("lse", nbytes(N, sd));
  // One chunk: the row masks, the logits (through a copy in the compute dtype when it is
  // narrower) and two per-row vectors.
  auto chunk = [&] {
    h.alloc("counted", nbytes(N, at::kBool));
    h.alloc("targets", nbytes(N, at::kLong));
    if (logits_f > 0) h.alloc("mm", logits_f);
    h.alloc("logits", logits);
    if (logits_f > 0) h.free("mm");
    h.alloc("rows", 2 * nbytes(n, sd));
  };
  chunk();
  for (const char* t : {"logits", "rows", "counted", "targets"}) h.free(t);
  HeadCost out;
  out.saved = h.current();
  // Backward: dx, then per chunk the logits again, their softmax in place and the
  // per-row scale.
  h.alloc("dh", D);
  chunk();
  if (logits_f > 0) h.alloc("dl", logits_f);
  h.free("logits");
  if (logits_f > 0) h.free("dl");
  for (const char* t : {"rows", "counted", "targets", "norm.out", "lse"}) h.free(t);
  // The final norm's backward: its input gradient plus, for RMSNorm, x-hat and two products.
  h.alloc("dx", D);
  if (c.arch != Arch::gpt2) h.alloc("rms", 2 * D);
  out.peak = h.peak();
  return out;
}

// Live bytes of the embedding's forward beyond its output, and what it keeps.
std::pair<int64_t, int64_t> embedding_cost(const ModelConfig& c, const StepShape& s) {
  const int64_t N = s.batch * s.seq, D = nbytes(N * c.d_model, s.dtype);
  if (c.arch != Arch::gpt2) return {D, 0};
  if (c.dropout == 0) return {2 * D, 0};
  const int64_t mask = nbytes(N * c.d_model, at::kBool);
  // token rows, their sum with positions, the mask, its float copy and the output
  return {4 * D + mask, mask};
}

}  // namespace

double NodeTimes::node_seconds(const graph::Node& n) const {
  auto it = seconds.find(n.name);
  if (it != seconds.end()) return it->second;
  return flops_per_second > 0 ? n.flops / flops_per_second : 0.0;
}

namespace {

// A layer's forward (and, when `backward`, its backward) under the slots `dropped`.
LayerCost simulate(const graph::BlockGraph& g, const std::set<std::string>& dropped, bool early_stop,
                   const NodeTimes& times, bool backward) {
  LayerCost lc;
  std::vector<bool> keep(kSlotCount, true);
  for (const auto& s : dropped) keep[static_cast<size_t>(slot_of_name(s))] = false;
  for (int s = 0; s < kSlotCount; ++s) {
    if (keep[static_cast<size_t>(s)]) lc.kept += g.slot_bytes(static_cast<Slot>(s));
  }
  const graph::Lifetimes lt(g);
  Live live;
  Simulator sim{g, live, times, early_stop, lc};
  graph::BlockRun<Simulator> run(g, lt, keep);
  // The forward from the kept input, then the backward from the output gradient.
  run.forward(sim, sim.make(g.values[g.input].info.bytes())).reset();
  lc.forward_peak = live.peak();
  TORCH_INTERNAL_ASSERT(live.current() == lc.kept, "the walk keeps ", live.current(), " bytes but the slot table ",
                        lc.kept);
  if (!backward) return lc;
  live.reset_peak();
  run.backward(sim, sim.make(g.values[g.output].info.bytes())).reset();
  lc.backward_peak = live.peak();
  return lc;
}

}  // namespace

LayerCost price_layer(const graph::BlockGraph& g, const std::set<std::string>& dropped, bool early_stop,
                      const NodeTimes& times) {
  return simulate(g, dropped, early_stop, times, /*backward=*/true);
}

StaticBytes static_bytes(const ModelConfig& cfg, const StepShape& shape) {
  TORCH_CHECK(cfg.vocab_size > 0, "The cost model needs model.vocab_size");
  const at::ScalarType master = shape.dtype == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t P = param_counts(cfg).first;
  StaticBytes s;
  s.params = nbytes(P, master);
  s.grads = nbytes(P, master);
  s.optimizer = 2 * nbytes(P, master);
  s.compute_copies = shape.dtype != master ? nbytes(P, shape.dtype) : 0;
  if (cfg.arch == Arch::llama) s.params += 2 * nbytes(cfg.max_seq * (cfg.head_dim() / 2), shape.dtype);  // RoPE tables
  s.batch = 2 * nbytes(shape.batch * shape.seq, at::kLong);
  s.resident = shape.resident;
  return s;
}

StepConstants step_constants(const ModelConfig& cfg, const StepShape& shape) {
  StepConstants k;
  k.statics = static_bytes(cfg, shape);
  std::tie(k.embed_peak, k.embed_saved) = embedding_cost(cfg, shape);
  const HeadCost head = head_cost(cfg, shape);
  k.head_peak = head.peak;
  k.head_saved = head.saved;
  const int64_t D = nbytes(shape.batch * shape.seq * cfg.d_model, shape.dtype);
  k.embed_backward = cfg.arch == Arch::gpt2 && cfg.dropout > 0 ? 3 * D : D;
  // AdamW's denominator: a square root and its quotient, per parameter.
  k.optimizer = 2 * nbytes(param_counts(cfg).second, shape.dtype == at::kDouble ? at::kDouble : at::kFloat);
  return k;
}

StepPrediction predict_step(const ModelConfig& cfg, const StepShape& shape, const ActivationPlan& plan,
                            bool early_stop, const NodeTimes& times) {
  const int64_t L = cfg.n_layer;
  TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == L, "The activation plan has ", plan.layers.size(),
              " layers but the model has ", L);
  const graph::BlockGraph block = graph::block_graph(cfg, shape.batch, shape.seq, shape.dtype);
  const int64_t input_bytes = block.slot_bytes(Slot::input), out_bytes = block.values[block.output].info.bytes();
  const StepConstants k = step_constants(cfg, shape);
  StepPrediction p;
  p.statics = k.statics;
  const int64_t embed_peak = k.embed_peak, embed_saved = k.embed_saved;
  p.embedding = embed_saved;
  p.head = k.head_saved;
  const int64_t base = p.statics.total();

  auto consider = [&](int64_t bytes, int64_t kept_now, const std::string& where) {
    if (bytes > p.peak) {
      p.peak = bytes;
      p.peak_at = where;
      p.working_set = bytes - base - kept_now;
    }
  };
  // Prices per distinct slot choice (layers of one policy mostly share a few).
  std::map<std::set<std::string>, LayerCost> priced;
  auto price = [&](const std::set<std::string>& dropped) -> const LayerCost& {
    auto it = priced.find(dropped);
    if (it == priced.end()) it = priced.emplace(dropped, price_layer(block, dropped, early_stop, times)).first;
    return it->second;
  };
  const LayerCost& whole = price({});
  // A uniform:N chunk: its first layer keeps its input, the others nothing; the chunk's
  // last layer re-runs all of it.
  auto chunk_first = [&](int64_t l) {
    const int64_t b = plan.layers[l].chunk_begin;
    if (b >= 0) return b;
    return l + 1 < L && plan.layers[l + 1].chunk_begin == l ? l : int64_t{-1};
  };
  auto chunk_last = [&](int64_t l) {
    const int64_t first = chunk_first(l);
    return first >= 0 && (l + 1 == L || plan.layers[l + 1].chunk_begin != first);
  };
  std::vector<int64_t> kept(L);
  for (int64_t l = 0; l < L; ++l) {
    const LayerPlan& lp = plan.layers[l];
    if (chunk_first(l) >= 0) {
      kept[l] = lp.chunk_begin >= 0 ? 0 : input_bytes;
      // Its first forward keeps only the chunk's input, if it is the chunk's first layer.
      std::set<std::string> all(block_slots().begin(), block_slots().end());
      if (lp.chunk_begin >= 0) all.insert(slot_name(Slot::input));
      LayerCost c;
      c.kept = kept[l];
      c.forward_peak = simulate(block, all, early_stop, times, /*backward=*/false).forward_peak;
      c.backward_peak = whole.backward_peak;
      p.layers.push_back(c);
    } else {
      p.layers.push_back(price(lp.dropped));
      kept[l] = p.layers.back().kept;
    }
  }
  double block_seconds = 0;
  for (const auto& n : block.nodes) block_seconds += times.node_seconds(n);

  const int64_t emb = base + embed_saved;
  const auto layer_name = [](const char* what, int64_t l) { return fmt::format("{} of layer {}", what, l + 1); };
  consider(base + embed_peak, 0, "embedding forward");
  int64_t below = 0;  // kept by the layers under the current one
  for (int64_t l = 0; l < L; ++l) {
    consider(emb + below + p.layers[l].forward_peak, embed_saved + below, layer_name("forward", l));
    below += kept[l];
  }
  consider(emb + below + k.head_peak, embed_saved + below, "loss head");
  LayerCost total;
  for (int64_t l = L - 1; l >= 0; --l) {
    below -= kept[l];
    const int64_t first = chunk_first(l);
    if (first < 0) {
      const LayerCost& c = p.layers[l];
      consider(emb + below + c.backward_peak, embed_saved + below, layer_name("backward", l));
      for (const auto& [k, n] : c.ops) total.ops[k] += n;
      total.recompute_flops += c.recompute_flops;
      total.recompute_seconds += c.recompute_seconds;
      total.recomputed_bytes += c.recomputed_bytes;
      continue;
    }
    if (!chunk_last(l)) continue;
    // The chunk [first, l]: its forward again with the output gradient live, then each
    // layer's backward with the rebuilt layers under it still held.
    const int64_t under = below - kept[first];  // kept by the layers under the chunk
    int64_t rebuilt = 0;
    const int64_t full = whole.kept;
    for (int64_t j = first; j <= l; ++j) {
      consider(emb + under + out_bytes + rebuilt + whole.forward_peak, embed_saved + under + rebuilt,
               layer_name("recompute", j));
      rebuilt += full;
      for (const auto& n : block.nodes) {
        if (n.op->kind()[0] != '\0') ++total.ops[n.op->kind()];
      }
      total.recompute_flops += block.forward_flops();
      total.recompute_seconds += block_seconds;
      total.recomputed_bytes += full - input_bytes;
    }
    for (int64_t j = l; j >= first; --j) {
      rebuilt -= full;
      consider(emb + under + rebuilt + whole.backward_peak, embed_saved + under + rebuilt,
               layer_name("backward", j));
    }
  }
  consider(emb + k.embed_backward, embed_saved, "embedding backward");
  consider(base + k.optimizer, 0, "optimizer step");

  p.kept_activations = embed_saved + std::accumulate(kept.begin(), kept.end(), int64_t{0}) + k.head_saved;
  const double micro = static_cast<double>(shape.grad_accum);
  for (const auto& [k, n] : total.ops) p.ops[k] = n * shape.grad_accum;
  p.recompute_flops = micro * total.recompute_flops;
  p.recompute_seconds = micro * total.recompute_seconds;
  p.recomputed_bytes = total.recomputed_bytes;
  return p;
}

}  // namespace remat::cost
