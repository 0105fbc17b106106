#include "model/transformer.h"

#include "remat/dist.h"
#include "remat/ops/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

namespace remat::detail {

std::vector<at::Tensor> Weights::of(const std::vector<int>& idx) const {
  std::vector<at::Tensor> out;
  out.reserve(idx.size());
  for (int i : idx) out.push_back(tensors[static_cast<size_t>(i)]);
  return out;
}

namespace {

// The parameter layout of `decl` for `cfg` on one of `tp` ranks (`sp`: with sequence
// parallelism): the embedding's, each layer's, then the head's not already named by the
// embedding; tensors uninitialised, of a rank's sizes, with options `o`.
Weights make_weights(const ArchDecl& decl, const ModelConfig& cfg, int64_t tp, bool sp, const at::TensorOptions& o) {
  Weights w;
  std::map<std::string, int> index;
  // The vocabulary parameters: the first of each node the plan splits by vocabulary rows
  // (the embedding's table, the loss head's weight), named so whether or not tp splits.
  std::set<std::string> vocab;
  auto add = [&](const std::string& name, const graph::Param& p) {
    auto [it, fresh] = index.emplace(name, static_cast<int>(w.names.size()));
    if (fresh) {
      w.names.push_back(name);
      w.tensors.push_back(at::empty(p.sizes, o));
      w.shards.push_back(p.shard);
      w.partial.push_back(p.partial);
      w.vocab.push_back(vocab.count(p.name) > 0);
    }
    return it->second;
  };
  const auto params = [&](const graph::BlockGraph& g) {
    for (const graph::Node& n : g.nodes) {
      const auto& names = decl.tp_plan.vocab;
      if (std::find(names.begin(), names.end(), n.name) != names.end()) vocab.insert(g.params.at(n.params.at(0)).name);
    }
    return graph::tensor_parallel(g, decl.tp_plan, tp, sp).params;
  };
  const int64_t T = sp ? tp : 1;  // a position per rank
  for (const auto& p : params(decl.embed(cfg, 1, T, at::kFloat))) w.embed.push_back(add(p.name, p));
  const auto block = params(decl.block(cfg, 1, T, at::kFloat));
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    w.layers.emplace_back();
    for (const auto& p : block) w.layers.back().push_back(add(decl.layer_prefix + std::to_string(l) + "." + p.name, p));
  }
  for (const auto& p : params(decl.head(cfg, 1, T, at::kFloat, 1))) w.head.push_back(add(p.name, p));
  return w;
}

const std::vector<bool> kKeepAll(kSlotCount, true);

}  // namespace

std::vector<at::Tensor> Engine::forward(int i, const std::vector<at::Tensor>& in, bool recompute) {
  const graph::Node& n = g.nodes[i];
  std::vector<at::Tensor> p;
  for (int k : n.params) p.push_back(weights[k]);
  if (!recompute || store == nullptr) return n.op->forward(in, p, n.attrs, ctx);
  if (n.op->kind()[0] != '\0') store->count_op(n.op->kind());
  const ActivationStore::NodeTimer timer(*store, n.name.c_str(), ctx.device);
  return n.op->forward(in, p, n.attrs, recompute_ctx);
}

std::vector<at::Tensor> Engine::backward(int i, const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                         const std::vector<at::Tensor>& out) {
  const graph::Node& n = g.nodes[i];
  std::vector<at::Tensor> p;
  std::vector<at::Tensor*> gp;
  for (int k : n.params) {
    p.push_back(weights[k]);
    gp.push_back(&grads[k]);
  }
  return n.op->backward(dy, in, out, p, gp, n.attrs, ctx);
}

void Engine::dropped(int v, const at::Tensor& t) {
  const auto s = static_cast<Slot>(g.slot_of[v]);
  if (store == nullptr || s == Slot::input) return;
  const auto& vs = g.slot(s);
  const int root = g.root(v);
  const bool view_of_dropped = root != v && g.saved[root] && g.slot_of[root] == g.slot_of[v];
  store->drop(ctx.microbatch, layer, slot_name(s), static_cast<size_t>(std::find(vs.begin(), vs.end(), v) - vs.begin()),
              t, view_of_dropped);
}

at::Tensor Engine::shard(const at::Tensor& whole) {
  TORCH_INTERNAL_ASSERT(ctx.tp != nullptr, "a sharded block input without a tensor-parallel group");
  return ops::share_of_elements(whole, *ctx.tp);
}

at::Tensor Engine::gather(const at::Tensor& share) {
  TORCH_INTERNAL_ASSERT(ctx.tp != nullptr, "a sharded block input without a tensor-parallel group");
  const trace::Scope trace_scope("all_gather", trace::Category::backward);
  std::optional<ActivationStore::NodeTimer> timer;
  if (store != nullptr) timer.emplace(*store, graph::kInputGather, ctx.device);
  return ops::gather_elements(share, g.values[static_cast<size_t>(g.input)].info.sizes, *ctx.tp,
                              fmt::format("the all-gather of layer {}'s kept input (step {})", layer, ctx.step + 1));
}

TransformerModel::TransformerModel(const ArchDecl& decl, const ModelConfig& cfg, at::Device device,
                                   at::ScalarType compute_dtype, uint64_t seed, dist::Group* tp,
                                   bool sequence_parallel)
    : Model(cfg, device, compute_dtype, tp, sequence_parallel), decl_(decl) {
  // Masters are float32, or float64 when computing in float64 (gradient tests).
  const auto f32 = at::TensorOptions().dtype(compute_dtype == at::kDouble ? at::kDouble : at::kFloat);
  weights_ = make_weights(decl, cfg, tp_size(), sp_, f32);
  // Initialise on CPU from one seeded generator so a seed means the same model on every
  // device and every tensor-parallel layout (a rank keeps its part of the whole), then move.
  auto gen = at::detail::createCPUGenerator(seed);
  for (size_t i = 0; i < weights_.tensors.size(); ++i) {
    std::vector<int64_t> whole = weights_.tensors[i].sizes().vec();
    if (weights_.shards[i].split()) whole[static_cast<size_t>(weights_.shards[i].dim)] *= tp_size();
    at::Tensor full = at::empty(whole, f32);
    init_param(weights_.names[i], full, cfg, gen);
    weights_.tensors[i] = graph::take_part(full, weights_.shards[i], tp_size(), tp != nullptr ? tp->rank() : 0)
                              .contiguous()
                              .to(device);
  }
  grads_ = weights_;
  int64_t numel = 0;
  for (const at::Tensor& w : weights_.tensors) numel += w.numel();
  grad_buffer_ = at::zeros({numel}, weights_.tensors.at(0).options());
  numel = 0;
  for (size_t i = 0; i < weights_.tensors.size(); ++i) {
    const at::Tensor& w = weights_.tensors[i];
    grads_.tensors[i] = grad_buffer_.narrow(0, numel, w.numel()).view(w.sizes());
    numel += w.numel();
    params_.push_back(
        Param{weights_.names[i], w, grads_.tensors[i], w.dim() >= 2, weights_.shards[i], weights_.partial[i],
              weights_.vocab[i]});
  }
  const graph::BlockGraph head = graph_of(Part::head, 1, 1, 1);
  for (const auto& n : head.nodes) {
    if (n.op == &graph::op::loss(cfg.loss_head)) head_weight_ = weights_.head[static_cast<size_t>(n.params.at(0))];
  }
  TORCH_INTERNAL_ASSERT(head_weight_ >= 0, "the head declares no loss");
  if (decl.block(cfg, 1, 1, compute_dtype).uses(graph::op::rope())) {
    rope_ = ops::rope_tables(cfg.max_seq, cfg.head_dim(), cfg.rope_theta, compute_dtype, device);
  }
}

double TransformerModel::forward_backward(const at::Tensor& tokens, const at::Tensor& targets, const StepContext& ctx,
                                          double loss_scale, int64_t ce_chunk, ActivationBytes* measured) {
  check_batch(tokens, targets);
  const Weights& W = compute_weights();
  const int64_t L = cfg_.n_layer, B = tokens.size(0), T = tokens.size(1);
  const GraphShape& emb = shaped(Part::embed, B, T, 0, sp_);
  const GraphShape& blk = shaped(Part::block, B, T, 0, sp_);
  const GraphShape& head = shaped(Part::head, B, T, ce_chunk, sp_);
  const PoolDrain drain{store_ != nullptr && store_->options().pool};

  // Coarse trace slices around the parts outside the blocks.
  std::optional<trace::Scope> scope(std::in_place, "embedding forward", trace::Category::layer);
  Run embed_run(emb.graph, emb.lifetimes, kKeepAll);
  at::Tensor x;
  {
    Engine e = engine(emb, W, W.embed, false, 0, ctx, nullptr);
    x = embed_run.forward(e, tokens);
  }
  scope.reset();
  std::vector<std::unique_ptr<Run>> runs;
  for (int64_t l = 0; l < L; ++l) {
    const trace::Scope layer_scope("forward", trace::Category::layer, l);
    Engine e = engine(blk, W, W.layers[l], false, l, ctx, store_.get());
    runs.push_back(std::make_unique<Run>(blk.graph, blk.lifetimes, keeps(l), true, hold(l)));
    x = runs.back()->forward(e, std::move(x));
  }
  scope.emplace("loss head forward", trace::Category::layer);
  Run head_run(head.graph, head.lifetimes, kKeepAll);
  double loss = 0;
  {
    Engine e = engine(head, W, W.head, false, 0, ctx, nullptr);
    loss = head_run.forward(e, std::move(x), false, {targets.reshape({-1})}).item<double>();
  }
  scope.reset();

  if (store_) {
    std::unordered_set<const void*> seen;
    for (int64_t l = 0; l < L; ++l) store_->add_kept_bytes(distinct_storage_bytes(runs[l]->held(), seen));
  }
  if (measured != nullptr) {
    std::unordered_set<const void*> seen;
    measured->embedding = distinct_storage_bytes(embed_run.held(), seen);
    measured->blocks.assign(L, 0);
    for (int64_t l = 0; l < L; ++l) measured->blocks[l] = distinct_storage_bytes(runs[l]->held(), seen);
    measured->head = distinct_storage_bytes(head_run.held(), seen);
  }

  scope.emplace("loss head backward", trace::Category::layer);
  at::Tensor dx;
  {
    Engine e = engine(head, W, W.head, true, 0, ctx, nullptr);
    dx = head_run.backward(e, at::scalar_tensor(loss_scale, at::kDouble));
  }
  scope.reset();
  for (int64_t l = L - 1; l >= 0; --l) {
    const trace::Scope layer_scope("backward", trace::Category::layer, l);
    if (!runs[l]->value(blk.graph.input).defined()) recompute_chunk(blk, l, ctx, runs);
    Engine e = engine(blk, W, W.layers[l], true, l, ctx, store_.get());
    dx = runs[l]->backward(e, std::move(dx));
    runs[l].reset();
    if (store_) store_->finished_backward(l);
  }
  scope.emplace("embedding backward", trace::Category::layer);
  Engine e = engine(emb, W, W.embed, true, 0, ctx, nullptr);
  embed_run.backward(e, std::move(dx));
  return loss;
}

double TransformerModel::evaluate(const at::Tensor& tokens, const at::Tensor& targets, int64_t ce_chunk) {
  check_batch(tokens, targets);
  const GraphShape& head = shaped(Part::head, tokens.size(0), tokens.size(1), ce_chunk);
  const Weights& W = compute_weights();
  Engine e = engine(head, W, W.head, false, 0, {}, nullptr, /*train=*/false);
  return Run(head.graph, head.lifetimes, kKeepAll, /*training=*/false)
      .forward(e, blocks_output(tokens), false, {targets.reshape({-1})})
      .item<double>();
}

at::Tensor TransformerModel::last_logits(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) > 0, "[model] tokens must be [B, T] with T > 0, got ",
              tokens.sizes());
  const GraphShape& head = shaped(Part::head, tokens.size(0), tokens.size(1));
  const Weights& W = compute_weights();
  Engine e = engine(head, W, W.head, false, 0, {}, nullptr, /*train=*/false);
  const at::Tensor h = Run(head.graph, head.lifetimes, kKeepAll, /*training=*/false).forward(e, blocks_output(tokens));
  const at::Tensor logits = at::matmul(h.select(1, tokens.size(1) - 1), W.tensors[head_weight_].t()).to(at::kFloat);
  // A vocabulary-parallel head holds a share of the vocabulary's rows: the ranks' logits, side by side.
  return tp_size() == 1 ? logits : tp_->all_gather(logits, 1, "gathering the logits of the vocabulary's shares");
}

double TransformerModel::forward_flops(int64_t seq) const {
  return graph_of(Part::embed, 1, seq).forward_flops() + cfg_.n_layer * graph_of(Part::block, 1, seq).forward_flops() +
         graph_of(Part::head, 1, seq, seq).forward_flops();
}

void TransformerModel::set_activation_plan(const ActivationPlan& plan, const StoreOptions& options) {
  TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == cfg_.n_layer, "The activation plan has ",
              plan.layers.size(), " layers but the model has ", cfg_.n_layer);
  bool any = false;
  for (const auto& lp : plan.layers) {
    any = any || !lp.keeps_all();
    for (const auto& slot : lp.dropped) slot_of_name(slot);  // refuses a slot no block has
    TORCH_CHECK(!lp.input_sharded || (tp_size() > 1 && !sp_),
                "The activation plan keeps block inputs as a share per tensor-parallel rank "
                "(distribute_saved_activations), which needs parallel.tp > 1 without parallel.sp; this model runs "
                "with tp = ", tp_size(), sp_ ? " and sequence parallelism" : "", ".");
  }
  store_ = any ? std::make_unique<ActivationStore>(plan, options) : nullptr;
}

ActivationBytes TransformerModel::predict_activation_bytes(int64_t B, int64_t T) const {
  // The graphs' saved values: the blocks' by the slot table (the planner prices the same).
  const graph::BlockGraph g = graph_of(Part::block, B, T, 0, sp_);
  ActivationBytes out;
  out.embedding = graph_of(Part::embed, B, T, 0, sp_).saved_bytes();
  out.head = graph_of(Part::head, B, T, 1, sp_).saved_bytes();
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    out.blocks.push_back(g.kept_bytes(keeps(l), hold(l) == graph::InputHold::sharded));
  }
  return out;
}

void TransformerModel::check_batch(const at::Tensor& tokens, const at::Tensor& targets) const {
  TORCH_CHECK(tokens.dim() == 2 && tokens.sizes() == targets.sizes(),
              "[model] tokens and targets must both be [B, T], got ", tokens.sizes(), " and ", targets.sizes());
  TORCH_CHECK(tokens.size(1) <= cfg_.max_seq, "The sequence has ", tokens.size(1),
              " tokens but the model's context is ", cfg_.max_seq, " (model.max_seq); use sequences of at most ",
              cfg_.max_seq, " tokens.");
}

graph::BlockGraph TransformerModel::graph_of(Part p, int64_t B, int64_t T, int64_t chunk, bool sp) const {
  switch (p) {
    case Part::embed:
      return graph::tensor_parallel(decl_.embed(cfg_, B, T, compute_dtype_), decl_.tp_plan, tp_size(), sp);
    case Part::block:
      return graph::tensor_parallel(decl_.block(cfg_, B, T, compute_dtype_), decl_.tp_plan, tp_size(), sp);
    case Part::head:
      return graph::tensor_parallel(decl_.head(cfg_, B, T, compute_dtype_, chunk), decl_.tp_plan, tp_size(), sp);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown part");
}

const GraphShape& TransformerModel::shaped(Part p, int64_t B, int64_t T, int64_t chunk, bool sp) {
  auto& slot = parts_[{p, B, T, chunk, sp}];
  if (!slot) slot = std::make_unique<GraphShape>(graph_of(p, B, T, chunk, sp));
  return *slot;
}

std::vector<bool> TransformerModel::keeps(int64_t l) const {
  std::vector<bool> keep(kSlotCount, true);
  if (!store_) return keep;
  const LayerPlan& lp = store_->plan().layers[static_cast<size_t>(l)];
  for (const auto& slot : lp.dropped) keep[static_cast<size_t>(slot_of_name(slot))] = false;
  if (lp.chunk_begin >= 0 && lp.chunk_begin != l) keep[static_cast<size_t>(Slot::input)] = false;
  return keep;
}

graph::InputHold TransformerModel::hold(int64_t l) const {
  const bool sharded = store_ && store_->plan().layers[static_cast<size_t>(l)].input_sharded;
  return sharded ? graph::InputHold::sharded : graph::InputHold::whole;
}

Engine TransformerModel::engine(const GraphShape& s, const Weights& W, const std::vector<int>& params, bool backward,
                                int64_t l,
                                const StepContext& ctx, ActivationStore* store, bool train) {
  graph::RunContext run{ctx.seed, ctx.step, ctx.microbatch, ctx.first_row, l, train, device_,
                        rope_ ? &*rope_ : nullptr, tp_};
  graph::RunContext again = run;
  if (store != nullptr) {
    const StepContext k = recompute_context(ctx, *store);
    again.seed = k.seed;
    again.step = k.step;
    again.microbatch = k.microbatch;
  }
  return Engine{s.graph, W.of(params), backward ? grads_.of(params) : std::vector<at::Tensor>{},
                run, again, store, l};
}

void TransformerModel::recompute_chunk(const GraphShape& blk, int64_t last, const StepContext& ctx,
                                       std::vector<std::unique_ptr<Run>>& runs) {
  const int64_t first = store_->plan().layers[static_cast<size_t>(last)].chunk_begin;
  const Weights& W = compute_weights();
  store_->recompute([&] {
    {
      Engine e = engine(blk, W, W.layers[first], false, first, ctx, store_.get());
      runs[first]->gather_input(e);
    }
    at::Tensor x = runs[first]->value(blk.graph.input);
    for (int64_t j = first; j <= last; ++j) {
      const trace::Recompute recompute(j);
      Engine e = engine(blk, W, W.layers[j], false, j, ctx, store_.get());
      auto fresh = std::make_unique<Run>(blk.graph, blk.lifetimes, kKeepAll);
      x = fresh->forward(e, std::move(x), /*recompute=*/true);
      for (int s = 1; s < kSlotCount; ++s) {
        if (!runs[j]->missing(static_cast<Slot>(s))) continue;
        std::vector<at::Tensor> ts;
        for (int v : blk.graph.slot(static_cast<Slot>(s))) ts.push_back(fresh->value(v));
        store_->refilled(ctx.microbatch, j, slot_name(static_cast<Slot>(s)), ts);
      }
      runs[j] = std::move(fresh);
    }
  });
}

at::Tensor TransformerModel::blocks_output(const at::Tensor& tokens) {
  const Weights& W = compute_weights();
  const StepContext none;
  const int64_t B = tokens.size(0), T = tokens.size(1);
  const GraphShape& emb = shaped(Part::embed, B, T);
  const GraphShape& blk = shaped(Part::block, B, T);
  const std::vector<bool> keep_none(kSlotCount, false);
  Engine ee = engine(emb, W, W.embed, false, 0, none, nullptr, /*train=*/false);
  at::Tensor x = Run(emb.graph, emb.lifetimes, keep_none, /*training=*/false).forward(ee, tokens);
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    Engine e = engine(blk, W, W.layers[l], false, l, none, nullptr, /*train=*/false);
    x = Run(blk.graph, blk.lifetimes, keep_none, /*training=*/false).forward(e, std::move(x));
  }
  return x;
}

const Weights& TransformerModel::compute_weights() {
  if (compute_dtype_ == params_.front().value.scalar_type()) return weights_;
  int64_t version = 0;
  for (const auto& t : weights_.tensors) version += t._version();
  if (!cast_valid_ || version != cast_version_) {
    cast_ = weights_;
    for (auto& t : cast_.tensors) t = t.to(compute_dtype_);
    cast_version_ = version;
    cast_valid_ = true;
  }
  return cast_;
}

}  // namespace remat::detail
