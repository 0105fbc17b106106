#include "model/transformer.h"

#include "remat/dist.h"
#include "remat/memory.h"
#include "remat/ops/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <set>
#include <utility>

namespace remat::detail {

std::vector<at::Tensor> Weights::of(const std::vector<int>& idx) const {
  std::vector<at::Tensor> out;
  out.reserve(idx.size());
  for (int i : idx) out.push_back(tensors[static_cast<size_t>(i)]);
  return out;
}

namespace {

// The parameter layout of `decl` for `cfg` on one of `tp` ranks (`sp`: with sequence
// parallelism) of the stage `stage` (count resolved): the embedding's (first stage), each
// of its layers', then the head's (last stage) not already named by the embedding; tensors
// uninitialised, of a rank's sizes, with options `o`.
Weights make_weights(const ArchDecl& decl, const ModelConfig& cfg, int64_t tp, bool sp, const at::TensorOptions& o,
                     const StageSpan& stage) {
  Weights w;
  std::map<std::string, int> index;
  // The vocabulary parameters: the first of each node the plan splits by vocabulary rows
  // (the embedding's table, the loss head's weight), named so whether or not tp splits.
  std::set<std::string> vocab;
  const bool first = stage.first == 0, last = stage.first + stage.count == cfg.n_layer;
  // Parameters both the embedding and the head read: tied across stages (Param::tied) in
  // a stage that holds one of the two parts only.
  std::set<std::string> shared;
  auto add = [&](const std::string& name, const graph::Param& p) {
    auto [it, fresh] = index.emplace(name, static_cast<int>(w.names.size()));
    if (fresh) {
      w.names.push_back(name);
      w.tensors.push_back(at::empty(p.sizes, o));
      w.shards.push_back(p.shard);
      w.partial.push_back(p.partial);
      w.vocab.push_back(vocab.count(p.name) > 0);
      w.tied.push_back(first != last && shared.count(name) > 0);
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
  const auto embed = params(decl.embed(cfg, 1, T, at::kFloat));
  const auto head = params(decl.head(cfg, 1, T, at::kFloat, 1));
  for (const auto& p : embed) {
    for (const auto& q : head) {
      if (p.name == q.name) shared.insert(p.name);
    }
  }
  if (first) {
    for (const auto& p : embed) w.embed.push_back(add(p.name, p));
  }
  const auto block = params(decl.block(cfg, 1, T, at::kFloat));
  for (int64_t l = stage.first; l < stage.first + stage.count; ++l) {
    w.layers.emplace_back();
    for (const auto& p : block) w.layers.back().push_back(add(decl.layer_prefix + std::to_string(l) + "." + p.name, p));
  }
  if (last) {
    for (const auto& p : head) w.head.push_back(add(p.name, p));
  }
  return w;
}

const std::vector<bool> kKeepAll(kSlotCount, true);

// Makes `tensors` views, in order, of one new flat buffer of options `o` (zeros when
// `zeroed`), and returns it: one allocation, which one kernel reads or writes whole.
at::Tensor flat_views(std::vector<at::Tensor>& tensors, const at::TensorOptions& o, bool zeroed) {
  int64_t numel = 0;
  for (const at::Tensor& t : tensors) numel += t.numel();
  at::Tensor flat = zeroed ? at::zeros({numel}, o) : at::empty({numel}, o);
  numel = 0;
  for (at::Tensor& t : tensors) {
    t = flat.narrow(0, numel, t.numel()).view(t.sizes());
    numel += t.numel();
  }
  return flat;
}

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
  store->drop(ctx.microbatch, layer, s, static_cast<size_t>(std::find(vs.begin(), vs.end(), v) - vs.begin()), t,
              view_of_dropped);
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

memory::HostPool::Moved Engine::offload(const std::vector<at::Tensor>& group) {
  TORCH_INTERNAL_ASSERT(store != nullptr, "an offloaded slot outside a planned block");
  const trace::Scope trace_scope("offload", trace::Category::layer, layer);
  return store->host().to_host(group);
}

memory::HostPool::Moved Engine::fetch(const std::vector<at::Tensor>& group) {
  const trace::Scope trace_scope("fetch", trace::Category::backward, layer);
  memory::HostPool::Moved back;
  store->recompute([&] { back = store->host().to_device(group, ctx.device); });
  return back;
}

void Engine::await(uint64_t ticket) {
  const trace::Scope trace_scope("copy wait", trace::Category::layer, layer);
  store->host().await(ticket);
}

TransformerModel::TransformerModel(const ArchDecl& decl, const ModelConfig& cfg, at::Device device,
                                   at::ScalarType compute_dtype, uint64_t seed, dist::Group* tp, bool sequence_parallel,
                                   StageSpan stage)
    : Model(cfg, device, compute_dtype, tp, sequence_parallel, stage), decl_(decl) {
  plan_.layers.resize(static_cast<size_t>(cfg.n_layer));
  // Masters are float32, or float64 when computing in float64 (gradient tests).
  const auto f32 = at::TensorOptions().dtype(compute_dtype == at::kDouble ? at::kDouble : at::kFloat);
  // The masters, their gradients and their compute copies: a flat buffer each, views in
  // the same order, so that one pass casts the masters after an update.
  weights_ = make_weights(decl, cfg, tp_size(), sp_, f32.device(at::kMeta), stage_);
  value_buffer_ = flat_views(weights_.tensors, f32.device(device), false);
  std::map<std::string, size_t> mine;
  for (size_t i = 0; i < weights_.names.size(); ++i) mine.emplace(weights_.names[i], i);
  // Initialise on CPU from one seeded generator so a seed means the same model on every
  // device, every tensor-parallel layout (a rank keeps its part of the whole) and every
  // pipeline stage (all of the whole model's are drawn, in order, and a stage keeps its
  // own; the meta layout allocates nothing), then move.
  const Weights all = make_weights(decl, cfg, tp_size(), sp_, f32.device(at::kMeta), {0, cfg.n_layer});
  auto gen = at::detail::createCPUGenerator(seed);
  for (size_t j = 0; j < all.tensors.size(); ++j) {
    std::vector<int64_t> whole = all.tensors[j].sizes().vec();
    if (all.shards[j].split()) whole[static_cast<size_t>(all.shards[j].dim)] *= tp_size();
    at::Tensor full = at::empty(whole, f32);
    init_param(all.names[j], full, cfg, gen);
    const auto it = mine.find(all.names[j]);
    if (it == mine.end()) {
      other_stages_.insert(all.names[j]);
      continue;
    }
    weights_.tensors[it->second].copy_(
        graph::take_part(full, all.shards[j], tp_size(), tp != nullptr ? tp->rank() : 0));
  }
  grads_ = weights_;
  grad_buffer_ = flat_views(grads_.tensors, f32.device(device), true);
  for (size_t i = 0; i < weights_.tensors.size(); ++i) {
    const at::Tensor& w = weights_.tensors[i];
    params_.push_back(Param{weights_.names[i], w, grads_.tensors[i], w.dim() >= 2, weights_.shards[i],
                            weights_.partial[i], weights_.vocab[i], weights_.tied[i]});
  }
  find_added_only();
  if (last_stage()) {
    const graph::BlockGraph head = graph_of(Part::head, 1, 1, 1);
    for (const auto& n : head.nodes) {
      if (n.op == &graph::op::loss(cfg.loss_head)) head_weight_ = weights_.head[static_cast<size_t>(n.params.at(0))];
    }
    TORCH_INTERNAL_ASSERT(head_weight_ >= 0, "the head declares no loss");
  }
  if (decl.block(cfg, 1, 1, compute_dtype).uses(graph::op::rope())) {
    rope_ = ops::rope_tables(cfg.max_seq, cfg.head_dim(), cfg.rope_theta, cfg.rope_scaling, compute_dtype, device);
  }
}

std::unique_ptr<Microbatch> TransformerModel::forward(at::Tensor input, const at::Tensor& targets,
                                                      const StepContext& ctx, int64_t ce_chunk,
                                                      ActivationBytes* measured) {
  const auto [B, T] = check_input(input, targets);
  const Weights& W = compute_weights();
  auto mb = std::make_unique<TransformerMicrobatch>(this, ctx);
  mb->weights.resize(static_cast<size_t>(stage_.count));
  for (int64_t l = stage_.first; l < end_layer(); ++l) {
    mb->block_shapes.push_back(&shaped(Part::block, B, T, 0, sp_, l));
  }
  if (!first_stage()) {
    const GraphShape& blk = *mb->block_shapes.front();
    const graph::TensorInfo& in = blk.graph.values[static_cast<size_t>(blk.graph.input)].info;
    TORCH_CHECK(input.sizes() == at::IntArrayRef(in.sizes) && input.scalar_type() == in.dtype,
                "[model] the stage's input must be the previous stage's output ", at::IntArrayRef(in.sizes), " ",
                in.dtype, ", got ", input.sizes(), " ", input.scalar_type());
  }

  // Coarse trace slices around the parts outside the blocks.
  std::optional<trace::Scope> scope;
  // Moved in, so that a layer which drops or offloads its input frees it, as the cost model counts.
  at::Tensor x = std::move(input);
  for (const schedule::Action& a :
       schedule::forward(plan(), parts(), static_cast<int64_t>(ctx.microbatch), ctx.backward_follows)) {
    switch (a.kind) {
      case schedule::Kind::embed_forward: {
        scope.emplace("embedding forward", trace::Category::layer);
        mb->embed_shape = &shaped(Part::embed, B, T, 0, sp_);
        const GraphShape& emb = *mb->embed_shape;
        mb->embed = std::make_unique<Run>(emb.graph, emb.lifetimes, kKeepAll);
        const Gathered weights(*this, W.embed, Part::embed, 0, "forward", &ctx);
        Engine e = engine(emb, W, W.embed, std::nullopt, 0, ctx, nullptr);
        x = mb->embed->forward(e, std::move(x));
        scope.reset();
        break;
      }
      case schedule::Kind::forward: {
        const int64_t l = a.layer;
        const trace::Scope layer_scope("forward", trace::Category::layer, l);
        const GraphShape& blk = *mb->block_shapes[static_cast<size_t>(l - stage_.first)];
        at::Tensor* kept = plan().keeps_weights(l) ? &mb->weights[static_cast<size_t>(l - stage_.first)] : nullptr;
        const Gathered weights(*this, W.layers[l - stage_.first], Part::block, l, "forward", &ctx, kept);
        Engine e = engine(blk, W, W.layers[l - stage_.first], std::nullopt, l, ctx, store_.get());
        mb->layers.push_back(std::make_unique<Run>(blk.graph, blk.lifetimes, keeps(l), true, hold(l),
                                                   plan().layers[static_cast<size_t>(l)].offloaded));
        x = mb->layers.back()->forward(e, std::move(x));
        break;
      }
      case schedule::Kind::head_forward: {
        scope.emplace("loss head forward", trace::Category::layer);
        mb->head_shape = &shaped(Part::head, B, T, ce_chunk, sp_);
        const GraphShape& head = *mb->head_shape;
        mb->head = std::make_unique<Run>(head.graph, head.lifetimes, kKeepAll);
        const Gathered weights(*this, W.head, Part::head, 0, "forward", &ctx,
                               a.weights_kept ? &mb->head_weights : nullptr);
        Engine e = engine(head, W, W.head, std::nullopt, 0, ctx, nullptr);
        mb->loss = mb->head->forward(e, std::move(x), false, {targets.reshape({-1})}).item<double>();
        scope.reset();
        break;
      }
      default:
        TORCH_INTERNAL_ASSERT(false, "a microbatch's forward schedules a backward action");
    }
  }
  if (!last_stage()) mb->output = std::move(x);

  if (store_) {
    std::unordered_set<const void*> seen;
    for (const auto& run : mb->layers) store_->add_kept_bytes(distinct_storage_bytes(run->held(), seen));
  }
  if (measured != nullptr) {
    std::unordered_set<const void*> seen;
    *measured = {};
    if (mb->embed) measured->embedding = distinct_storage_bytes(mb->embed->held(), seen);
    for (const auto& run : mb->layers) measured->blocks.push_back(distinct_storage_bytes(run->held(), seen));
    if (mb->head) measured->head = distinct_storage_bytes(mb->head->held(), seen);
  }
  return mb;
}

at::Tensor TransformerModel::backward(Microbatch& handle, at::Tensor dy, double loss_scale) {
  auto* mb = dynamic_cast<TransformerMicrobatch*>(&handle);
  TORCH_CHECK(mb != nullptr && mb->model == this, "[model] backward of a microbatch another model's forward made");
  TORCH_CHECK(!mb->consumed, "[model] the microbatch's backward already ran; it runs once");
  if (!last_stage()) check_output_gradient(*mb, dy);
  mb->consumed = true;
  // The first backward since zero_grad() writes the gradients its ops write whole; with
  // sharded gradients every backward writes fresh buffers, and the first copies them on.
  const bool first = fresh_grads_;
  const bool sharded = grads_sharded();
  const ops::GradInto into = first || sharded ? ops::GradInto::write : ops::GradInto::add;
  fresh_grads_ = false;
  // Idle pooled buffers go back to the system when the backward ends, also when a
  // recompute throws (a failed determinism check); the microbatch's own leave the pool.
  const PoolDrain drain{store_ != nullptr && store_->options().pool};
  const Weights& W = compute_weights();
  const StepContext& ctx = mb->ctx;

  std::optional<trace::Scope> scope;
  at::Tensor dx = std::move(dy);
  // Sharded: from the head's backward to the embedding's, or the one of them a pipeline
  // stage runs.
  at::Tensor ends_grads;
  const std::string ends_part = "the embedding and the loss head";
  for (const schedule::Action& a : schedule::backward(plan(), parts(), static_cast<int64_t>(ctx.microbatch))) {
    switch (a.kind) {
      case schedule::Kind::head_backward: {
        scope.emplace("loss head backward", trace::Category::layer);
        const Gathered weights(*this, W.head, Part::head, 0, "backward", &ctx,
                               mb->head_weights.defined() ? &mb->head_weights : nullptr);
        if (sharded) ends_grads = open_part_grads(ends_);
        Engine e = engine(*mb->head_shape, W, W.head, into, 0, ctx, nullptr);
        dx = mb->head->backward(e, at::scalar_tensor(loss_scale, at::kDouble));
        scope.reset();
        if (gradients_ready_) gradients_ready_(head_own_params());
        if (sharded && !first_stage()) close_part_grads(ends_, std::move(ends_grads), first, ends_part, ctx);
        break;
      }
      case schedule::Kind::recompute:
        recompute_chunk(a.layer, a.last, ctx, mb->block_shapes, mb->layers);
        break;
      case schedule::Kind::fetch: {
        const size_t l = static_cast<size_t>(a.layer - stage_.first);
        Engine e = engine(*mb->block_shapes[l], W, W.layers[l], std::nullopt, a.layer, ctx, store_.get());
        mb->layers[l]->start_fetch(e);
        break;
      }
      case schedule::Kind::backward:
        dx = layer_backward(*mb, a.layer, std::move(dx), into, first);
        break;
      case schedule::Kind::embed_backward: {
        scope.emplace("embedding backward", trace::Category::layer);
        const Gathered weights(*this, W.embed, Part::embed, 0, "backward", &ctx);
        if (sharded && !last_stage()) ends_grads = open_part_grads(ends_);
        Engine e = engine(*mb->embed_shape, W, W.embed, into, 0, ctx, nullptr);
        dx = mb->embed->backward(e, std::move(dx));  // token ids: undefined
        part_ready(W.embed);
        if (sharded) close_part_grads(ends_, std::move(ends_grads), first, ends_part, ctx);
        break;
      }
      default:
        TORCH_INTERNAL_ASSERT(false, "a microbatch's backward schedules a forward action");
    }
  }
  return dx;
}

at::Tensor TransformerModel::layer_backward(TransformerMicrobatch& mb, int64_t l, at::Tensor dx, ops::GradInto into,
                                            bool first) {
  const trace::Scope layer_scope("backward", trace::Category::layer, l);
  const Weights& W = compute_weights();
  const StepContext& ctx = mb.ctx;
  auto& run = mb.layers[static_cast<size_t>(l - stage_.first)];
  const GraphShape& blk = *mb.block_shapes[static_cast<size_t>(l - stage_.first)];
  const std::vector<int>& params = W.layers[static_cast<size_t>(l - stage_.first)];
  at::Tensor& kept = mb.weights[static_cast<size_t>(l - stage_.first)];
  const Gathered weights(*this, params, Part::block, l, "backward", &ctx, kept.defined() ? &kept : nullptr);
  const bool sharded = grads_sharded();
  at::Tensor grads = sharded ? open_part_grads(params) : at::Tensor();
  Engine e = engine(blk, W, params, into, l, ctx, store_.get());
  dx = run->backward(e, std::move(dx));
  run.reset();
  if (store_) store_->finished_backward(l);
  part_ready(params);
  if (sharded) close_part_grads(params, std::move(grads), first, fmt::format("layer {}", l), ctx);
  return dx;
}

void TransformerModel::part_ready(const std::vector<int>& part) const {
  // Parameters come embedding first, then the layers', then the head's own (a tied one is
  // the embedding's): each part's backward completes every parameter from its first on.
  if (gradients_ready_) gradients_ready_(static_cast<size_t>(*std::min_element(part.begin(), part.end())));
}

double TransformerModel::evaluate(const at::Tensor& input, const at::Tensor& targets, int64_t ce_chunk,
                                  at::Tensor* output) {
  TORCH_CHECK(last_stage() || output != nullptr,
              "[model] the evaluation of a stage before the last needs somewhere "
              "to put its output");
  const auto [B, T] = check_input(input, targets, /*sharded=*/false);
  at::Tensor x = blocks_output(input);
  if (!last_stage()) {
    *output = std::move(x);
    return 0.0;
  }
  const GraphShape& head = shaped(Part::head, B, T, ce_chunk);
  const Weights& W = compute_weights();
  const Gathered weights(*this, W.head, Part::head, 0, "an evaluation");
  Engine e = engine(head, W, W.head, std::nullopt, 0, {}, nullptr, /*train=*/false);
  return Run(head.graph, head.lifetimes, kKeepAll, /*training=*/false)
      .forward(e, std::move(x), false, {targets.reshape({-1})})
      .item<double>();
}

at::Tensor TransformerModel::last_logits(const at::Tensor& tokens) {
  check_whole("Generation");
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) > 0, "[model] tokens must be [B, T] with T > 0, got ",
              tokens.sizes());
  const GraphShape& head = shaped(Part::head, tokens.size(0), tokens.size(1));
  const at::Tensor x = blocks_output(tokens);
  const Weights& W = compute_weights();
  const Gathered weights(*this, W.head, Part::head, 0, "generation");
  Engine e = engine(head, W, W.head, std::nullopt, 0, {}, nullptr, /*train=*/false);
  const at::Tensor h = Run(head.graph, head.lifetimes, kKeepAll, /*training=*/false).forward(e, x);
  const at::Tensor logits = at::matmul(h.select(1, tokens.size(1) - 1), W.tensors[head_weight_].t()).to(at::kFloat);
  // A vocabulary-parallel head holds a share of the vocabulary's rows: the ranks' logits, side by side.
  return tp_size() == 1 ? logits : tp_->all_gather(logits, 1, "gathering the logits of the vocabulary's shares");
}

double TransformerModel::forward_flops(int64_t seq) const {
  double flops = (first_stage() ? graph_of(Part::embed, 1, seq).forward_flops() : 0.0) +
                 (last_stage() ? graph_of(Part::head, 1, seq, seq).forward_flops() : 0.0);
  for (int64_t l = stage_.first; l < end_layer(); ++l) {
    flops += graph_of(Part::block, 1, seq, 0, false, l).forward_flops();
  }
  return flops;
}

void TransformerModel::set_activation_plan(const ActivationPlan& plan, const StoreOptions& options) {
  TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == cfg_.n_layer, "The activation plan has ", plan.layers.size(),
              " layers but the model has ", cfg_.n_layer);
  bool any = false;
  for (int64_t l = stage_.first; l < end_layer(); ++l) {
    const LayerPlan& lp = plan.layers[static_cast<size_t>(l)];
    TORCH_CHECK(lp.chunk_begin < 0 || lp.chunk_begin >= stage_.first, "The activation plan's chunk of layer ", l + 1,
                " (counted from 1) begins at layer ", lp.chunk_begin + 1, ", before this pipeline stage's first layer ",
                stage_.first + 1,
                "; a chunk cannot cross a stage boundary: compile the policy with the stage split "
                "(ac.stages, ac.num_layers_per_stage).");
    any = any || !lp.keeps_all();
    TORCH_CHECK(!lp.input_sharded || (tp_size() > 1 && !sp_),
                "The activation plan keeps block inputs as a share per tensor-parallel rank "
                "(distribute_saved_activations), which needs parallel.tp > 1 without parallel.sp; this model runs "
                "with tp = ",
                tp_size(), sp_ ? " and sequence parallelism" : "", ".");
    TORCH_CHECK(!lp.attention || *lp.attention != Attention::automatic, "The activation plan leaves layer ", l + 1,
                "'s attention op to be chosen (auto); a plan names math or tiled.");
    const bool chunked = plan.chunk_of(l) >= 0;
    TORCH_CHECK(!chunked || !lp.attention || *lp.attention == cfg_.attention, "The activation plan runs ",
                attention_name(*lp.attention), " attention in layer ", l + 1,
                ", which is in a uniform chunk; a "
                "chunk's layers run the model's attention op (",
                attention_name(cfg_.attention), ").");
  }
  plan_ = plan;
  store_ = any ? std::make_unique<ActivationStore>(plan, options, stage_.first, end_layer()) : nullptr;
}

ActivationBytes TransformerModel::predict_activation_bytes(int64_t B, int64_t T) const {
  // The graphs' saved values: the blocks' by the slot table (the planner prices the same).
  ActivationBytes out;
  if (first_stage()) out.embedding = graph_of(Part::embed, B, T, 0, sp_).saved_bytes();
  if (last_stage()) out.head = graph_of(Part::head, B, T, 1, sp_).saved_bytes();
  // The device's: offloaded slots wait in host memory.
  for (int64_t l = stage_.first; l < end_layer(); ++l) {
    const graph::BlockGraph g = graph_of(Part::block, B, T, 0, sp_, l);
    const bool sharded = hold(l) == graph::InputHold::sharded;
    const SlotMask offloaded = plan().layers[static_cast<size_t>(l)].offloaded;
    out.blocks.push_back(g.kept_bytes(keeps(l), sharded) - g.offload_bytes(keeps(l), offloaded, sharded));
  }
  return out;
}

std::pair<int64_t, int64_t> TransformerModel::check_input(const at::Tensor& input, const at::Tensor& targets,
                                                          bool sharded) const {
  if (first_stage()) {
    TORCH_CHECK(input.dim() == 2, "[model] the tokens must be [B, T], got ", input.sizes());
  } else {
    TORCH_CHECK(input.dim() == 3, "[model] a stage after the first takes the previous stage's output [B, T, C], got ",
                input.sizes());
  }
  // Sequence parallel: an activation holds this rank's share of the positions.
  const int64_t B = input.size(0), T = input.size(1) * (first_stage() || !sp_ || !sharded ? 1 : tp_size());
  TORCH_CHECK(T <= cfg_.max_seq, "The sequence has ", T, " tokens but the model's context is ", cfg_.max_seq,
              " (model.max_seq); use sequences of at most ", cfg_.max_seq, " tokens.");
  if (last_stage()) {
    TORCH_CHECK(targets.dim() == 2 && targets.size(0) == B && targets.size(1) == T,
                "[model] tokens and targets must both be [B, T] = [", B, ", ", T, "], got targets ", targets.sizes());
  }
  return {B, T};
}

void TransformerModel::check_whole(const char* what) const {
  TORCH_CHECK(first_stage() && last_stage(), what, " runs every layer, but this model is the pipeline stage of layers ",
              stage_.first + 1, " to ", end_layer(), " (counted from 1) of ", cfg_.n_layer, ".");
}

Attention TransformerModel::attention(int64_t l) const {
  return l >= 0 && l < cfg_.n_layer ? plan_.layers[static_cast<size_t>(l)].attention.value_or(cfg_.attention)
                                    : cfg_.attention;
}

graph::BlockGraph TransformerModel::graph_of(Part p, int64_t B, int64_t T, int64_t chunk, bool sp, int64_t l) const {
  switch (p) {
    case Part::embed:
      return graph::tensor_parallel(decl_.embed(cfg_, B, T, compute_dtype_), decl_.tp_plan, tp_size(), sp);
    case Part::block: {
      ModelConfig c = cfg_;
      c.attention = attention(l);
      return graph::tensor_parallel(decl_.block(c, B, T, compute_dtype_), decl_.tp_plan, tp_size(), sp);
    }
    case Part::head:
      return graph::tensor_parallel(decl_.head(cfg_, B, T, compute_dtype_, chunk), decl_.tp_plan, tp_size(), sp);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown part");
}

const GraphShape& TransformerModel::shaped(Part p, int64_t B, int64_t T, int64_t chunk, bool sp, int64_t l) {
  const Attention op = p == Part::block ? attention(l) : cfg_.attention;
  auto& slot = parts_[{p, B, T, chunk, sp, op}];
  if (!slot) slot = std::make_unique<GraphShape>(graph_of(p, B, T, chunk, sp, l));
  return *slot;
}

std::vector<bool> TransformerModel::keeps(int64_t l) const {
  std::vector<bool> keep(kSlotCount, true);
  const LayerPlan& lp = plan_.layers[static_cast<size_t>(l)];
  for (const Slot slot : lp.dropped.slots()) keep[static_cast<size_t>(slot)] = false;
  if (lp.chunk_begin >= 0 && lp.chunk_begin != l) keep[static_cast<size_t>(Slot::input)] = false;
  return keep;
}

graph::InputHold TransformerModel::hold(int64_t l) const {
  return plan_.layers[static_cast<size_t>(l)].input_sharded ? graph::InputHold::sharded : graph::InputHold::whole;
}

Engine TransformerModel::engine(const GraphShape& s, const Weights& W, const std::vector<int>& params,
                                std::optional<ops::GradInto> backward, int64_t l, const StepContext& ctx,
                                ActivationStore* store, bool train) {
  graph::RunContext run{ctx.seed, ctx.step, ctx.microbatch, ctx.first_row, l, train, device_, rope_ ? &*rope_ : nullptr,
                        tp_};
  graph::RunContext again = run;
  if (store != nullptr) {
    const StepContext k = recompute_context(ctx, *store);
    again.seed = k.seed;
    again.step = k.step;
    again.microbatch = k.microbatch;
  }
  if (backward) run.grads = *backward;
  return Engine{s.graph, W.of(params), backward ? grads_.of(params) : std::vector<at::Tensor>{}, run, again, store, l};
}

void TransformerModel::recompute_chunk(int64_t first, int64_t last, const StepContext& ctx,
                                       const std::vector<const GraphShape*>& shapes,
                                       std::vector<std::unique_ptr<Run>>& runs) {
  const Weights& W = compute_weights();
  // The stage's runs and weights count from its first layer.
  const auto local = [&](int64_t l) { return static_cast<size_t>(l - stage_.first); };
  const GraphShape& blk = *shapes[local(first)];  // a chunk's layers run the model's op
  store_->recompute([&] {
    {
      Engine e = engine(blk, W, W.layers[local(first)], std::nullopt, first, ctx, store_.get());
      runs[local(first)]->restore(e);
      runs[local(first)]->settle(e);
    }
    at::Tensor x = runs[local(first)]->value(blk.graph.input);
    for (int64_t j = first; j <= last; ++j) {
      const trace::Recompute recompute(j);
      const Gathered weights(*this, W.layers[local(j)], Part::block, j, "recompute", &ctx);
      Engine e = engine(blk, W, W.layers[local(j)], std::nullopt, j, ctx, store_.get());
      auto fresh = std::make_unique<Run>(blk.graph, blk.lifetimes, kKeepAll);
      x = fresh->forward(e, std::move(x), /*recompute=*/true);
      for (int s = 1; s < kSlotCount; ++s) {
        if (!runs[local(j)]->missing(static_cast<Slot>(s))) continue;
        std::vector<at::Tensor> ts;
        for (int v : blk.graph.slot(static_cast<Slot>(s))) ts.push_back(fresh->value(v));
        store_->refilled(ctx.microbatch, j, static_cast<Slot>(s), ts);
      }
      runs[local(j)] = std::move(fresh);
    }
  });
}

at::Tensor TransformerModel::blocks_output(const at::Tensor& input) {
  const Weights& W = compute_weights();
  const StepContext none;
  const int64_t B = input.size(0), T = input.size(1);
  const std::vector<bool> keep_none(kSlotCount, false);
  at::Tensor x = input;
  if (first_stage()) {
    const GraphShape& emb = shaped(Part::embed, B, T);
    const Gathered weights(*this, W.embed, Part::embed, 0, "an evaluation");
    Engine ee = engine(emb, W, W.embed, std::nullopt, 0, none, nullptr, /*train=*/false);
    x = Run(emb.graph, emb.lifetimes, keep_none, /*training=*/false).forward(ee, input);
  }
  for (int64_t l = stage_.first; l < end_layer(); ++l) {
    const GraphShape& blk = shaped(Part::block, B, T, 0, false, l);
    const Gathered weights(*this, W.layers[l - stage_.first], Part::block, l, "an evaluation");
    Engine e = engine(blk, W, W.layers[l - stage_.first], std::nullopt, l, none, nullptr, /*train=*/false);
    x = Run(blk.graph, blk.lifetimes, keep_none, /*training=*/false).forward(e, std::move(x));
  }
  return x;
}

const Weights& TransformerModel::compute_weights() {
  if (values_sharded()) return gathered_;
  if (compute_dtype_ == value_buffer_.scalar_type()) return weights_;
  if (!cast_buffer_.defined()) {
    cast_ = weights_;
    cast_buffer_ = flat_views(cast_.tensors, value_buffer_.options().dtype(compute_dtype_), false);
  }
  // An update or a load writes the masters in place, through views sharing the buffer's
  // version counter.
  if (value_buffer_._version() != cast_version_) {
    const trace::Scope scope("compute copies", trace::Category::step);
    cast_buffer_.copy_(value_buffer_);
    cast_version_ = value_buffer_._version();
  }
  return cast_;
}

void TransformerModel::cast_compute_copies() {
  cast_version_ = -1;
  compute_weights();
}

void TransformerModel::shard_gradients(const std::vector<bool>& owned, dist::Group& group) {
  TORCH_CHECK(owned.size() == params_.size(), "[model] shard_gradients takes one flag per parameter (", params_.size(),
              "), got ", owned.size());
  std::vector<bool> keeps(owned);
  for (size_t i = 0; i < keeps.size(); ++i) keeps[i] = keeps[i] || weights_.tied[i];
  std::vector<at::Tensor> kept;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (keeps[i]) kept.push_back(params_[i].grad);
  }
  // The whole buffer goes first, its cached segments with it, so that the device holds
  // only the kept one.
  for (Param& p : params_) p.grad = at::Tensor();
  for (at::Tensor& g : grads_.tensors) g = at::Tensor();
  grad_buffer_ = at::Tensor();
  memory::release_cached(device_);
  grad_buffer_ = flat_views(kept, value_buffer_.options(), false);  // the first backward copies in
  for (size_t i = 0, k = 0; i < params_.size(); ++i) {
    if (keeps[i]) params_[i].grad = kept[k++];
  }
  std::set<int> ends(weights_.embed.begin(), weights_.embed.end());
  ends.insert(weights_.head.begin(), weights_.head.end());
  ends_.assign(ends.begin(), ends.end());
  kept_grads_ = keeps;
  grad_group_ = &group;
}

void TransformerModel::shard_values(const std::vector<bool>& owned, dist::Group& group) {
  TORCH_CHECK(owned.size() == params_.size(), "[model] shard_values takes one flag per parameter (", params_.size(),
              "), got ", owned.size());
  TORCH_CHECK(grads_sharded(), "[model] shard_values needs the gradients sharded first (shard_gradients)");
  std::vector<at::Tensor> old, kept;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owned[i]) old.push_back(weights_.tensors[i]);
  }
  kept = old;
  at::Tensor buffer = flat_views(kept, value_buffer_.options(), false);
  for (size_t k = 0; k < kept.size(); ++k) kept[k].copy_(old[k]);
  old.clear();
  // The whole buffer and its compute copies go, their cached segments with them, so that
  // the device holds only the kept masters; the others keep their shapes on the meta device.
  const auto meta = value_buffer_.options().device(at::kMeta);
  for (size_t i = 0, k = 0; i < params_.size(); ++i) {
    weights_.tensors[i] = owned[i] ? kept[k++] : at::empty(weights_.tensors[i].sizes(), meta);
    params_[i].value = weights_.tensors[i];
  }
  cast_ = Weights();
  cast_buffer_ = at::Tensor();
  cast_version_ = -1;
  value_buffer_ = std::move(buffer);
  memory::release_cached(device_);
  gathered_ = weights_;
  for (at::Tensor& t : gathered_.tensors) t = at::Tensor();
  kept_values_ = owned;
  value_group_ = &group;
}

TransformerModel::Gathered::Gathered(TransformerModel& m, const std::vector<int>& params, Part part, int64_t l,
                                     const char* pass, const StepContext* ctx, at::Tensor* kept)
    : m_(m), params_(params) {
  if (!m_.values_sharded()) return;
  const bool again = kept == nullptr || !kept->defined();
  std::optional<trace::Scope> scope;
  if (again) {
    scope.emplace("weight gather", trace::Category::layer);
    // As bits: each weight's owner gives its bytes and every other rank zeros, so that the
    // sum of 64-bit words is the owners' bytes exactly, in any dtype (Gloo sums no bfloat16).
    const int64_t size = static_cast<int64_t>(c10::elementSize(m_.compute_dtype_));
    int64_t numel = 0;
    for (const int i : params_) numel += m_.weights_.tensors[static_cast<size_t>(i)].numel();
    words_ = at::zeros({(numel * size + 7) / 8}, m_.value_buffer_.options().dtype(at::kLong));
  } else {
    words_ = std::exchange(*kept, at::Tensor());
  }
  const at::Tensor flat = words_.view(m_.compute_dtype_);
  int64_t numel = 0;
  for (const int i : params_) {
    const at::Tensor& master = m_.weights_.tensors[static_cast<size_t>(i)];
    at::Tensor w = flat.narrow(0, numel, master.numel()).view(master.sizes());
    if (again && m_.kept_values_[static_cast<size_t>(i)]) w.copy_(master);
    m_.gathered_.tensors[static_cast<size_t>(i)] = std::move(w);
    numel += master.numel();
  }
  if (!again) return;
  const std::string name = part == Part::embed  ? std::string("the embedding's")
                           : part == Part::head ? std::string("the loss head's")
                                                : fmt::format("layer {}'s", l);
  std::vector<at::Tensor> sum{words_};
  m_.value_group_->all_reduce(sum, dist::Reduce::sum,
                              ctx != nullptr ? fmt::format("gathering {} weights for the {} of step {}, microbatch {}",
                                                           name, pass, ctx->step + 1, ctx->microbatch + 1)
                                             : fmt::format("gathering {} weights for {}", name, pass));
  if (kept != nullptr) *kept = words_;
}

TransformerModel::Gathered::~Gathered() {
  if (!m_.values_sharded()) return;
  for (const int i : params_) m_.gathered_.tensors[static_cast<size_t>(i)] = at::Tensor();
}

void TransformerModel::check_output_gradient(const TransformerMicrobatch& mb, const at::Tensor& dy) const {
  const graph::BlockGraph& g = mb.block_shapes.back()->graph;
  const graph::TensorInfo& out = g.values[static_cast<size_t>(g.output)].info;
  TORCH_CHECK(dy.defined(), "[model] a stage before the last needs the gradient of its output");
  TORCH_CHECK(dy.sizes() == at::IntArrayRef(out.sizes) && dy.scalar_type() == out.dtype,
              "[model] the output gradient must have the output's shape and dtype ", at::IntArrayRef(out.sizes), " ",
              out.dtype, ", got ", dy.sizes(), " ", dy.scalar_type());
}

size_t TransformerModel::head_own_params() const {
  int before = -1;  // the last parameter of the parts below the head
  for (const auto& layer : weights_.layers) before = std::max(before, *std::max_element(layer.begin(), layer.end()));
  for (const int i : weights_.embed) before = std::max(before, i);
  return static_cast<size_t>(before + 1);
}

at::Tensor TransformerModel::open_part_grads(const std::vector<int>& params) {
  // The partial gradients first (sequence parallelism): one prefix to sum over the
  // tensor-parallel group in place. The tied ones last: a suffix the data-parallel sum
  // leaves out.
  std::vector<int> order(params);
  const auto rank = [&](int i) {
    const auto k = static_cast<size_t>(i);
    return weights_.partial[k] ? 0 : weights_.tied[k] ? 2 : 1;
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rank(a) < rank(b); });
  std::vector<at::Tensor> views = weights_.of(order);
  at::Tensor flat = flat_views(views, value_buffer_.options(), false);
  for (size_t k = 0; k < order.size(); ++k) grads_.tensors[static_cast<size_t>(order[k])] = views[k];
  for (const int i : added_only_) {
    if (std::find(params.begin(), params.end(), i) != params.end()) grads_.tensors[static_cast<size_t>(i)].zero_();
  }
  return flat;
}

void TransformerModel::close_part_grads(const std::vector<int>& params, at::Tensor flat, bool first,
                                        const std::string& part, const StepContext& ctx) {
  {
    const trace::Scope scope("gradient sum", trace::Category::backward);
    int64_t partial = 0, tied = 0;
    for (const int i : params) {
      const int64_t n = grads_.tensors[static_cast<size_t>(i)].numel();
      if (weights_.partial[static_cast<size_t>(i)]) partial += n;
      if (weights_.tied[static_cast<size_t>(i)]) tied += n;
    }
    if (partial > 0 && tp_size() > 1) {
      // Over the tensor-parallel group before the data-parallel one, as sum_partial_grads.
      std::vector<at::Tensor> positions{flat.narrow(0, 0, partial)};
      tp_->all_reduce(positions, dist::Reduce::sum,
                      fmt::format("the sequence-parallel gradient sum of {} (step {}, microbatch {})", part,
                                  ctx.step + 1, ctx.microbatch + 1));
    }
    if (flat.numel() > tied) {
      std::vector<at::Tensor> sum{flat.narrow(0, 0, flat.numel() - tied)};
      grad_group_->all_reduce(
          sum, dist::Reduce::sum,
          fmt::format("the gradient sum of {} (step {}, microbatch {})", part, ctx.step + 1, ctx.microbatch + 1));
    }
  }
  for (const int i : params) {
    at::Tensor& g = grads_.tensors[static_cast<size_t>(i)];
    at::Tensor& kept = params_[static_cast<size_t>(i)].grad;
    if (kept_grads_[static_cast<size_t>(i)]) first ? kept.copy_(g) : kept.add_(g);
    g = at::Tensor();
  }
}

void TransformerModel::find_added_only() {
  // The head's and the blocks' ops write their whole gradients (checked here, since a step
  // would otherwise read stale ones); the embedding's add into rows, and need zeros unless
  // the head, whose backward runs first, writes the same tied table.
  std::vector<graph::BlockGraph> writing;
  if (last_stage()) writing.push_back(graph_of(Part::head, 1, 1, 1));
  if (!weights_.layers.empty()) writing.push_back(graph_of(Part::block, 1, 1, 0, false, stage_.first));
  for (const graph::BlockGraph& g : writing) {
    for (const graph::Node& n : g.nodes) {
      TORCH_INTERNAL_ASSERT(n.params.empty() || n.op->writes_grads(), "node ", n.name,
                            " adds into part of its gradients, outside the embedding");
    }
  }
  if (!first_stage()) return;
  const std::set<int> by_head(weights_.head.begin(), weights_.head.end());
  std::set<int> added;
  for (const graph::Node& n : graph_of(Part::embed, 1, 1).nodes) {
    if (n.op->writes_grads()) continue;
    for (const int k : n.params) {
      const int i = weights_.embed[static_cast<size_t>(k)];
      if (by_head.count(i) == 0) added.insert(i);
    }
  }
  added_only_.assign(added.begin(), added.end());
}

}  // namespace remat::detail
