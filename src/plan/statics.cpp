#include "plan/statics.h"

#include "remat/ops.h"
#include "remat/schedule.h"
#include "util/fused_adamw.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>

namespace remat::cost {

using ops::nbytes;

namespace {

// The block's parameters on one tensor-parallel rank, whatever the sequence split.
std::vector<graph::Param> block_params(const ModelConfig& c, const Layout& layout) {
  Layout shard;
  shard.tp = layout.tp;
  return graph::block_graph(c, 1, 1, at::kFloat, shard).params;
}

// Which of a pipeline stage's `params` are a table it shares with another stage (the
// embedding's, which the loss head reads too): the ones sharded gradients keep whole.
std::vector<bool> tied_params(const ModelConfig& c, const std::vector<graph::Param>& params, const Layout& layout) {
  std::vector<bool> tied(params.size());
  if (layout.has_embedding() == layout.has_head()) return tied;
  Layout shard;
  shard.tp = layout.tp;
  std::set<std::string> embed;
  for (const auto& p : graph::embed_graph(c, 1, 1, at::kFloat, shard).params) embed.insert(p.name);
  for (const auto& p : graph::head_graph(c, 1, 1, at::kFloat, 1, shard).params) {
    if (embed.count(p.name) == 0) continue;
    for (size_t i = 0; i < params.size(); ++i) tied[i] = tied[i] || params[i].name == p.name;
  }
  return tied;
}

}  // namespace

std::vector<graph::Param> stage_params(const ModelConfig& c, const Layout& layout) {
  std::vector<graph::Param> params;
  std::set<std::string> named;
  const auto add = [&](const graph::BlockGraph& g) {
    for (const auto& p : g.params) {
      if (named.insert(p.name).second) params.push_back(p);
    }
  };
  Layout shard;  // the parameters are a tensor-parallel rank's, whatever the sequence split
  shard.tp = layout.tp;
  if (layout.has_embedding()) add(graph::embed_graph(c, 1, 1, at::kFloat, shard));
  const auto block = block_params(c, layout);
  for (int64_t l = 0; l < layout.stage_layers(c.n_layer); ++l) params.insert(params.end(), block.begin(), block.end());
  if (layout.has_head()) add(graph::head_graph(c, 1, 1, at::kFloat, 1, shard));
  return params;
}

int64_t numel(const graph::Param& p) { return graph::TensorInfo{p.sizes, at::kFloat, {}}.numel(); }

int64_t numel(const std::vector<graph::Param>& params) {
  int64_t n = 0;
  for (const graph::Param& p : params) n += numel(p);
  return n;
}

at::ScalarType master_dtype(at::ScalarType compute) { return compute == at::kDouble ? at::kDouble : at::kFloat; }

OptimizerShare optimizer_share(const ModelConfig& cfg, const std::vector<graph::Param>& params, const Layout& layout) {
  const int64_t ranks = layout.zero_ranks();
  OptimizerShare s;
  s.own_grads = layout.grads_sharded();
  std::vector<int64_t> numels;
  for (const graph::Param& p : params) numels.push_back(numel(p));
  const std::vector<int> owner = zero_owners(numels, ranks);
  const std::vector<bool> tied = s.own_grads ? tied_params(cfg, params, layout) : std::vector<bool>(params.size());
  // Per rank: the elements it owns, its largest, and the tied ones among them.
  std::vector<int64_t> load(static_cast<size_t>(ranks)), largest(load.size()), tied_owned(load.size());
  int64_t all_tied = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const auto r = static_cast<size_t>(owner[i]);
    load[r] += numels[i];
    largest[r] = std::max(largest[r], numels[i]);
    tied_owned[r] += tied[i] ? numels[i] : 0;
    all_tied += tied[i] ? numels[i] : 0;
  }
  // A rank keeps its own gradients and the tied ones another rank owns.
  const auto grads = [&](size_t r) { return s.own_grads ? load[r] + all_tied - tied_owned[r] : 0; };
  // The busiest keeps the most between updates; the walked rank peaks highest in its update.
  int64_t most = -1, highest = -1;
  const int64_t copies = share_copies(layout);
  for (size_t r = 0; r < load.size(); ++r) {
    const int64_t kept = copies * load[r] + grads(r);
    if (kept > most) {
      most = kept;
      s.moments = load[r];
      s.grads = grads(r);
    }
    const int64_t peak = kept + (util::kFusedAdamW ? 0 : 2 * largest[r]);
    if (peak > highest) {
      highest = peak;
      s.rank = static_cast<int>(r);
    }
  }
  if (layout.dp_rank && ranks > 1) {
    TORCH_CHECK(*layout.dp_rank >= 0 && *layout.dp_rank < ranks, "[optimizer_share] data-parallel rank ",
                *layout.dp_rank, " of ", ranks);
    s.rank = static_cast<int>(*layout.dp_rank);
    s.moments = load[static_cast<size_t>(s.rank)];  // no busier rank's share to hold
    s.grads = grads(static_cast<size_t>(s.rank));
  }
  s.rank_moments = load[static_cast<size_t>(s.rank)];
  s.rank_grads = grads(static_cast<size_t>(s.rank));
  for (const bool matrices : {true, false}) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (owner[i] == s.rank && (params[i].sizes.size() >= 2) == matrices) s.updated.push_back(i);
    }
  }
  return s;
}

int64_t share_copies(const Layout& layout, bool moments) {
  return (moments ? 2 : 0) + (layout.values_sharded() ? 1 : 0);
}

GradientBuffers gradient_buffers(const ModelConfig& cfg, const Layout& layout, at::ScalarType master) {
  if (!layout.grads_sharded()) return {};
  const int64_t layer = numel(block_params(cfg, layout));
  const int64_t all = numel(stage_params(cfg, layout));
  return {nbytes(layer, master), nbytes(all - layout.stage_layers(cfg.n_layer) * layer, master),
          layout.has_embedding() && layout.has_head()};
}

GatheredWeights gathered_weights(const ModelConfig& cfg, const Layout& layout, at::ScalarType compute) {
  if (!layout.values_sharded()) return {};
  // 64-bit words (the gather sums them as integers), as many as the part's bytes need.
  const auto words = [&](const std::vector<graph::Param>& params) {
    return (nbytes(numel(params), compute) + 7) / 8 * 8;
  };
  Layout shard;  // a tensor-parallel rank's parameters, whatever the sequence split
  shard.tp = layout.tp;
  GatheredWeights g;
  g.layer = words(block_params(cfg, layout));
  if (layout.has_embedding()) g.embed = words(graph::embed_graph(cfg, 1, 1, at::kFloat, shard).params);
  if (layout.has_head()) g.head = words(graph::head_graph(cfg, 1, 1, at::kFloat, 1, shard).params);
  return g;
}

int64_t step_count_bytes(bool updates) { return util::kFusedAdamW && updates ? nbytes(1, at::kFloat) : 0; }

void simulate_update(Live& live, const std::vector<graph::Param>& params, const OptimizerShare& share,
                     at::ScalarType master, std::vector<SimTensor>* moments) {
  const auto make = [&](int64_t bytes) { return std::make_shared<Buffer>(&live, bytes); };
  std::vector<SimTensor> sums;
  const std::set<size_t> own(share.updated.begin(), share.updated.end());
  SimTensor none;
  for (size_t i = 0; i < params.size(); ++i) {
    if (share.own_grads && own.count(i) == 0) {
      if (!none) none = make(nbytes(1, master));
      continue;
    }
    const SimTensor squared = make(nbytes(numel(params[i]), master));
    sums.push_back(make(nbytes(1, master)));
  }
  sums.clear();
  none.reset();
  const bool first = moments != nullptr && moments->empty();
  for (const size_t i : share.updated) {
    const int64_t bytes = nbytes(numel(params[i]), master);
    if (first) {
      moments->push_back(make(bytes));
      moments->push_back(make(bytes));
    }
    if (util::kFusedAdamW) continue;  // the fused kernel makes no temporaries
    SimTensor root = make(bytes);
    const SimTensor quotient = make(bytes);
    root.reset();
  }
  // The fused kernel's step count, made after the moments.
  if (first && step_count_bytes(!share.updated.empty()) > 0) {
    moments->push_back(make(step_count_bytes(true)));
  }
}

graph::BlockGraph shape_block(const ModelConfig& cfg, const StepShape& shape, const Layout& layout) {
  graph::BlockGraph g = graph::block_graph(cfg, shape.batch, shape.seq, shape.dtype, layout);
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

StaticBytes static_bytes(const ModelConfig& model, const StepShape& shape, const Layout& layout) {
  // The parameters are the same whichever attention op and loss head run: a config whose
  // autos are not resolved yet has them too.
  ModelConfig cfg = model;
  if (cfg.attention == Attention::automatic) cfg.attention = Attention::math;
  if (cfg.loss_head == LossHead::automatic) cfg.loss_head = LossHead::fused;
  TORCH_CHECK(cfg.vocab_size > 0, "The cost model needs model.vocab_size");
  const std::vector<int64_t> split = layout.stage_split(cfg.n_layer);
  TORCH_CHECK(layout.pp >= 1 && static_cast<int64_t>(split.size()) == layout.pp && layout.stage >= 0 &&
                  layout.stage < layout.pp && split[static_cast<size_t>(layout.stage)] >= 1 &&
                  std::accumulate(split.begin(), split.end(), int64_t{0}) == cfg.n_layer &&
                  layout.in_flight(shape.grad_accum) >= 1,
              "Stage ", layout.stage + 1, " of the split [", c10::Join(",", split), "] over ", layout.pp,
              " stages with ", shape.grad_accum, " microbatches is not a stage of a model of ", cfg.n_layer, " layers");
  const at::ScalarType master = master_dtype(shape.dtype);
  const std::vector<graph::Param> params = stage_params(cfg, layout);
  const int64_t P = numel(params);
  StaticBytes s;
  const OptimizerShare share = optimizer_share(cfg, params, layout);
  const int64_t moments = share.moments;
  // Sharded values: the busiest rank's masters, the parameters it updates, and no compute
  // copies: each part gathers its own.
  s.params = nbytes(layout.values_sharded() ? moments : P, master);
  s.grads = nbytes(layout.grads_sharded() ? share.grads : P, master);  // the busiest rank's when sharded
  s.optimizer = 2 * nbytes(moments, master) + step_count_bytes(moments > 0);
  s.compute_copies = shape.dtype != master && !layout.values_sharded() ? nbytes(P, shape.dtype) : 0;
  const GatheredWeights gathered = gathered_weights(cfg, layout, shape.dtype);
  s.gathered = std::max({gathered.layer, gathered.embed, gathered.head});
  if (graph::block_graph(cfg, 1, 1, shape.dtype).uses(graph::op::rope())) {
    s.params += ops::rope_tables_bytes(cfg.max_seq, cfg.head_dim(), shape.dtype);
  }
  // Ids for the embedding, targets for the head, of each microbatch in flight.
  const int64_t ends = (layout.has_embedding() ? 1 : 0) + (layout.has_head() ? 1 : 0);
  s.batch = layout.in_flight(shape.grad_accum) * ends * nbytes(shape.batch * shape.seq, at::kLong);
  return s;
}

StepConstants step_constants(const ModelConfig& cfg, const StepShape& shape, const Layout& layout) {
  StepConstants k;
  k.statics = static_bytes(cfg, shape, layout);
  // Sharded gradients: the ends' buffer lives from the head's backward to the embedding's,
  // or over the backward of the one a pipeline stage holds.
  const at::ScalarType master = master_dtype(shape.dtype);
  const int64_t ends = gradient_buffers(cfg, layout, master).ends;
  const GatheredWeights gathered = gathered_weights(cfg, layout, shape.dtype);
  if (layout.has_embedding()) {
    const LayerCost embed = simulate_kept(graph::embed_graph(cfg, shape.batch, shape.seq, shape.dtype, layout));
    k.embed_peak = embed.forward_peak + gathered.embed;
    k.embed_saved = embed.kept;
    k.embed_backward = embed.backward_peak - embed.kept + ends + gathered.embed;
  }
  if (layout.has_head()) {
    const LayerCost head =
        simulate_kept(graph::head_graph(cfg, shape.batch, shape.seq, shape.dtype, shape.ce_chunk, layout));
    k.head_peak = std::max(head.forward_peak, head.backward_peak + ends) + gathered.head;
    k.head_saved = head.kept;
  }
  // The update point is the rank of OptimizerShare's: its moments (and kept gradients and masters), not
  // the busiest rank's, under the temporaries of its update.
  const std::vector<graph::Param> params = stage_params(cfg, layout);
  const OptimizerShare share = optimizer_share(cfg, params, layout);
  Live live;
  simulate_update(live, params, share, master, nullptr);
  k.optimizer = live.peak() - share_copies(layout) * nbytes(share.moments - share.rank_moments, master) -
                nbytes(share.grads - share.rank_grads, master);
  return k;
}

graph::LinkTraffic DataParallelTraffic::fixed() const {
  return {gradients.bytes + exchange.bytes + gathers.bytes, gradients.messages + exchange.messages + gathers.messages};
}

graph::LinkTraffic DataParallelTraffic::total() const {
  const graph::LinkTraffic f = fixed();
  return {f.bytes + regathers.bytes, f.messages + regathers.messages};
}

namespace {

// What sharded gradients (stages 2 and 3) sum besides the gathers: each part's after each of
// its backwards (Model::shard_gradients, less a pipeline stage's tied table), that table
// once, the loss, and the gradient norm's squares of the whole and of the tensor-parallel
// parameters, one collective each (TrainStep's clip).
void sharded_gradient_sums(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                           const std::vector<graph::Param>& params, const std::function<void(int64_t)>& sum) {
  const at::ScalarType master = master_dtype(shape.dtype);
  const std::vector<bool> tied = tied_params(cfg, params, layout);
  const GradientBuffers parts = gradient_buffers(cfg, layout, master);
  int64_t tied_bytes = 0, whole = 0, split = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (tied[i]) tied_bytes += nbytes(numel(params[i]), master);
    if (tied[i] && !layout.has_embedding()) continue;  // the first stage's copy counts in the norm
    ++(params[i].shard.split() ? split : whole);
  }
  for (int64_t m = 0; m < shape.grad_accum; ++m) {
    for (int64_t l = 0; l < layout.stage_layers(cfg.n_layer); ++l) sum(parts.layer);
    if (parts.ends > tied_bytes) sum(parts.ends - tied_bytes);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (tied[i]) sum(nbytes(numel(params[i]), master));
  }
  sum(nbytes(1, at::kDouble));
  for (const int64_t n : {split, whole}) {
    if (n > 0) sum(nbytes(n, master));
  }
}

}  // namespace

DataParallelTraffic data_parallel_traffic(const ModelConfig& cfg, const StepShape& shape, const Layout& layout,
                                          const ActivationPlan& plan) {
  DataParallelTraffic t;
  if (layout.dp <= 1) return t;
  const auto sum = [&](graph::LinkTraffic& into) {
    return [&into, &layout](int64_t bytes) {
      const graph::LinkTraffic one = graph::LinkTraffic::all_reduce(bytes, layout.dp);
      into.bytes += one.bytes;
      into.messages += one.messages;
    };
  };
  const at::ScalarType master = master_dtype(shape.dtype);
  const std::vector<graph::Param> params = stage_params(cfg, layout);
  const int64_t elements = numel(params);
  if (layout.grads_sharded()) {
    sharded_gradient_sums(cfg, shape, layout, params, sum(t.gradients));
  } else {
    // GradientReduction: the flat buffer in buckets from its end, then the loss.
    const int64_t per_bucket = std::max<int64_t>(1, kGradientBucketBytes / nbytes(1, master));
    for (int64_t end = elements; end > 0; end -= per_bucket) {
      sum(t.gradients)(nbytes(std::min(per_bucket, end), master));
    }
    sum(t.gradients)(nbytes(1, at::kDouble));
  }
  if (layout.zero_ranks() > 1 && !layout.values_sharded()) sum(t.exchange)(nbytes(elements, master));
  if (!layout.values_sharded()) return t;
  const GatheredWeights g = gathered_weights(cfg, layout, shape.dtype);
  const int64_t F = layout.first_layer(cfg.n_layer), E = F + layout.stage_layers(cfg.n_layer);
  const schedule::Stage stage{F, E, layout.has_embedding(), layout.has_head()};
  const auto gather = sum(t.gathers), regather = sum(t.regathers);
  bool head_kept = false;  // by the head's forward just before
  for (const schedule::Action& a :
       schedule::step(plan, stage, layout.schedule, layout.pp, layout.stage, shape.grad_accum)) {
    switch (a.kind) {
      case schedule::Kind::embed_forward:
      case schedule::Kind::embed_backward:
        gather(g.embed);
        break;
      case schedule::Kind::head_forward:
        gather(g.head);
        head_kept = a.weights_kept;
        break;
      case schedule::Kind::head_backward:
        if (!head_kept) gather(g.head);
        break;
      case schedule::Kind::forward:
        gather(g.layer);
        break;
      case schedule::Kind::backward:
        if (!plan.keeps_weights(a.layer)) regather(g.layer);
        break;
      case schedule::Kind::recompute:
        for (int64_t j = a.layer; j <= a.last; ++j) regather(g.layer);
        break;
      default:
        break;
    }
  }
  return t;
}

}  // namespace remat::cost
