// The training loop of one microbatch, written once for both architectures.
//
// An Arch supplies: its block graph (block(cfg, B, T, dtype), remat/graph.h), Weights
// (all parameter tensors, visit(f) over (name, tensor&) in a fixed order, make(cfg,
// options, block params) allocating them; a block's parameters in the graph's order),
// EmbedSaved/NormSaved (each with tensors()), the forward/backward of the embedding and
// the final norm, which weight the loss head uses, and the rotation tables its ops read.
// The blocks run through the graph's walk (src/graph/walk.h). The same Weights type holds
// the values, the gradients and, in bfloat16 runs, the per-step compute copies.
#pragma once

#include "graph/walk.h"
#include "remat/graph.h"
#include "remat/model.h"
#include "remat/ops.h"
#include "remat/store.h"
#include "remat/trace.h"

#include <optional>
#include <set>
#include <unordered_set>

namespace remat::detail {

/// (name, tensor) references into a Weights struct, in visit order.
template <class W>
std::vector<std::pair<std::string, at::Tensor*>> weight_refs(W& w) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  w.visit([&](const std::string& name, at::Tensor& t) { out.emplace_back(name, &t); });
  return out;
}

/// Whether `s` ends with `suffix`.
inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// The tensors of several Saved structs, in order (for a block's Saved::tensors()).
inline std::vector<at::Tensor> concat(std::initializer_list<std::vector<at::Tensor>> parts) {
  std::vector<at::Tensor> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

/// Bytes held by the distinct storages among `ts` not yet in `seen` (views share).
int64_t distinct_storage_bytes(const std::vector<at::Tensor>& ts, std::unordered_set<const void*>& seen);

/// Initial value of a parameter from its name: biases 0, norm weights 1, residual
/// output projections N(0, std / sqrt(2 layers)), other matrices N(0, std).
void init_param(const std::string& name, at::Tensor& t, const ModelConfig& cfg, at::Generator& gen);

ops::DropoutKey dropout_key(const StepContext& ctx, int64_t layer, ops::DropoutSite site);

/// The context a recompute draws its dropout masks from: the forward's own, or (RNG
/// preservation off) a different one, as frameworks that do not preserve RNG state do.
StepContext recompute_context(const StepContext& ctx, const ActivationStore& st);

/// Returns the recompute pool's idle buffers to the system when it goes out of scope, if
/// `active`. Declared before a microbatch's saved tensors, it runs after they are freed,
/// also when a recompute throws (a failed determinism check), so no buffer stays pooled.
struct PoolDrain {
  bool active;
  ~PoolDrain() {
    if (active) memory::release_pool();
  }
};

/// A block graph at one shape with its lifetimes (cached per [B, T] by the model).
struct BlockShape {
  graph::BlockGraph graph;
  graph::Lifetimes lifetimes;
  explicit BlockShape(graph::BlockGraph g) : graph(std::move(g)), lifetimes(graph) {}
};

/// The engine's backend of the block walk: runs the ops' kernels on one layer's weights,
/// accumulating into its gradients, and reports to the store.
struct Engine {
  using Tensor = at::Tensor;
  const graph::BlockGraph& g;
  const std::vector<at::Tensor>& weights;
  std::vector<at::Tensor>* grads;   ///< null in the forward
  graph::RunContext ctx;            ///< the forward's keys
  graph::RunContext recompute_ctx;  ///< a recompute's (the same unless RNG preservation is off)
  ActivationStore* store;
  int64_t layer;

  std::vector<at::Tensor> forward(int i, const std::vector<at::Tensor>& in, bool recompute) {
    const graph::Node& n = g.nodes[i];
    std::vector<at::Tensor> p;
    for (int k : n.params) p.push_back(weights[k]);
    if (!recompute || store == nullptr) return n.op->forward(in, p, n.attrs, ctx);
    if (n.op->kind()[0] != '\0') store->count_op(n.op->kind());
    const ActivationStore::NodeTimer timer(*store, n.name.c_str(), ctx.device);
    return n.op->forward(in, p, n.attrs, recompute_ctx);
  }
  std::vector<at::Tensor> backward(int i, const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out) {
    const graph::Node& n = g.nodes[i];
    std::vector<at::Tensor> p;
    std::vector<at::Tensor*> gp;
    for (int k : n.params) {
      p.push_back(weights[k]);
      gp.push_back(&(*grads)[k]);
    }
    return n.op->backward(dy, in, out, p, gp, n.attrs, ctx);
  }
  at::Tensor add(const at::Tensor& a, const at::Tensor& b) { return a + b; }
  void dropped(int v, const at::Tensor& t) {
    const auto s = static_cast<Slot>(g.slot_of[v]);
    if (store == nullptr || s == Slot::input) return;
    const auto& vs = g.slot(s);
    const int root = g.root(v);
    const bool view_of_dropped = root != v && g.saved[root] && g.slot_of[root] == g.slot_of[v];
    store->drop(layer, slot_name(s), static_cast<size_t>(std::find(vs.begin(), vs.end(), v) - vs.begin()), t,
                view_of_dropped);
  }
  void refilled(Slot s, const std::vector<at::Tensor>& ts) {
    if (store != nullptr) store->refilled(layer, slot_name(s), ts);
  }
  template <class F>
  void recompute(F&& f) {
    if (store == nullptr) return f();
    store->recompute([&] {
      const trace::Recompute r(layer);
      f();
    });
  }
  bool early_stop() const { return store == nullptr || store->options().early_stop; }
};

using Run = graph::BlockRun<Engine>;

template <class Arch>
class TransformerModel final : public Model {
 public:
  using Weights = typename Arch::Weights;

  TransformerModel(const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype,
                   uint64_t seed)
      : Model(cfg, device, compute_dtype), arch_(cfg, device, compute_dtype),
        block_params_(Arch::block(cfg, 1, 1, compute_dtype).params) {
    // Masters are float32, or float64 when computing in float64 (gradient tests).
    const auto f32 = at::TensorOptions().dtype(compute_dtype == at::kDouble ? at::kDouble : at::kFloat);
    // Initialise on CPU from one seeded generator so a seed means the same model on
    // every device, then move.
    weights_ = Weights::make(cfg, f32, block_params_);
    auto gen = at::detail::createCPUGenerator(seed);
    for (auto& [name, t] : weight_refs(weights_)) {
      init_param(name, *t, cfg, gen);
      *t = t->to(device);
    }
    grads_ = Weights::make(cfg, f32.device(device), block_params_);
    auto w = weight_refs(weights_);
    auto g = weight_refs(grads_);
    for (size_t i = 0; i < w.size(); ++i) {
      g[i].second->zero_();
      params_.push_back(Param{w[i].first, *w[i].second, *g[i].second, w[i].second->dim() >= 2});
    }
  }

  double forward_backward(const at::Tensor& tokens, const at::Tensor& targets,
                          const StepContext& ctx, double loss_scale, int64_t ce_chunk,
                          ActivationBytes* measured) override {
    check_batch(tokens, targets);
    const Weights& W = compute_weights();
    const int64_t L = cfg_.n_layer;
    const BlockShape& blk = block(tokens.size(0), tokens.size(1));
    const PoolDrain drain{store_ != nullptr && store_->options().pool};

    // Coarse trace slices around the parts whose results outlive a block scope.
    std::optional<trace::Scope> part(std::in_place, "embedding forward", trace::Category::layer);
    auto emb = arch_.embed_forward(W, tokens, ctx, /*train=*/true);
    part.reset();
    at::Tensor x = std::move(emb.out);
    std::vector<std::unique_ptr<Run>> runs;
    for (int64_t l = 0; l < L; ++l) {
      const trace::Scope layer_scope("forward", trace::Category::layer, l);
      Engine e = engine(blk, W, nullptr, l, ctx);
      runs.push_back(std::make_unique<Run>(blk.graph, blk.lifetimes, keeps(l)));
      x = runs.back()->forward(e, std::move(x));
    }
    part.emplace("loss head forward", trace::Category::layer);
    auto norm = arch_.final_norm_forward(W, x);
    x.reset();
    const int64_t C = cfg_.d_model;
    auto ce = ops::cross_entropy_forward(norm.out.reshape({-1, C}), Arch::head(W),
                                         targets.reshape({-1}), ce_chunk);
    norm.out.reset();
    const double loss = ce.out.template item<double>();
    part.reset();

    if (store_) {
      std::unordered_set<const void*> seen;
      for (int64_t l = 0; l < L; ++l) store_->add_kept_bytes(distinct_storage_bytes(runs[l]->held(), seen));
    }
    if (measured != nullptr) {
      std::unordered_set<const void*> seen;
      measured->embedding = distinct_storage_bytes(emb.saved.tensors(), seen);
      measured->blocks.assign(L, 0);
      for (int64_t l = 0; l < L; ++l) measured->blocks[l] = distinct_storage_bytes(runs[l]->held(), seen);
      auto head = norm.saved.tensors();
      for (const auto& t : ce.saved.tensors()) head.push_back(t);
      measured->head = distinct_storage_bytes(head, seen);
    }

    part.emplace("loss head backward", trace::Category::layer);
    at::Tensor dh = ops::cross_entropy_backward(loss_scale, ce.saved, Arch::head(W), Arch::head(grads_));
    ce.saved = {};
    at::Tensor dx = arch_.final_norm_backward(dh.view({tokens.size(0), tokens.size(1), C}),
                                              norm.saved, W, grads_);
    dh.reset();
    norm.saved = {};
    part.reset();
    for (int64_t l = L - 1; l >= 0; --l) {
      const trace::Scope layer_scope("backward", trace::Category::layer, l);
      if (!runs[l]->value(blk.graph.input).defined()) recompute_chunk(blk, W, l, ctx, runs);
      Engine e = engine(blk, W, &grads_.layers[l], l, ctx);
      dx = runs[l]->backward(e, std::move(dx));
      runs[l].reset();
      if (store_) store_->finished_backward(l);
    }
    part.emplace("embedding backward", trace::Category::layer);
    arch_.embed_backward(dx, emb.saved, W, grads_);
    return loss;
  }
  double evaluate(const at::Tensor& tokens, const at::Tensor& targets, int64_t ce_chunk) override {
    check_batch(tokens, targets);
    at::Tensor h = hidden(tokens);
    auto ce = ops::cross_entropy_forward(h.reshape({-1, cfg_.d_model}), Arch::head(compute_weights()),
                                         targets.reshape({-1}), ce_chunk);
    return ce.out.template item<double>();
  }

  at::Tensor last_logits(const at::Tensor& tokens) override {
    TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) > 0, "[model] tokens must be [B, T] with T > 0, got ",
                tokens.sizes());
    at::Tensor h = hidden(tokens).select(1, tokens.size(1) - 1);
    return at::matmul(h, Arch::head(compute_weights()).t()).to(at::kFloat);
  }

  double forward_flops(int64_t seq) const override {
    return cfg_.n_layer * Arch::block(cfg_, 1, seq, compute_dtype_).forward_flops() + arch_.outside_flops(seq);
  }

  void set_activation_plan(const ActivationPlan& plan, const StoreOptions& options) override {
    TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == cfg_.n_layer, "The activation plan has ",
                plan.layers.size(), " layers but the model has ", cfg_.n_layer);
    bool any = false;
    for (const auto& lp : plan.layers) {
      any = any || !lp.keeps_all();
      for (const auto& slot : lp.dropped) slot_of_name(slot);  // refuses a slot no block has
    }
    store_ = any ? std::make_unique<ActivationStore>(plan, options) : nullptr;
  }
  ActivationStore* store() override { return store_.get(); }

  ActivationBytes predict_activation_bytes(int64_t B, int64_t T) const override {
    // The block graph's slot table: the bytes each slot's values hold (the planner prices the same).
    const graph::BlockGraph g = Arch::block(cfg_, B, T, compute_dtype_);
    ActivationBytes out;
    out.embedding = arch_.embed_bytes(B, T);
    out.head = arch_.head_bytes(B, T, compute_dtype_);
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
      const auto keep = keeps(l);
      int64_t bytes = 0;
      for (int s = 0; s < kSlotCount; ++s) {
        if (keep[static_cast<size_t>(s)]) bytes += g.slot_bytes(static_cast<Slot>(s));
      }
      out.blocks.push_back(bytes);
    }
    return out;
  }

 protected:
  bool hf_transposed(const std::string& name) const override { return Arch::hf_transposed(name); }
  bool ignorable(const std::string& name) const override { return Arch::ignorable(name); }

 private:
  void check_batch(const at::Tensor& tokens, const at::Tensor& targets) const {
    TORCH_CHECK(tokens.dim() == 2 && tokens.sizes() == targets.sizes(),
                "[model] tokens and targets must both be [B, T], got ", tokens.sizes(), " and ",
                targets.sizes());
    TORCH_CHECK(tokens.size(1) <= cfg_.max_seq, "The sequence has ", tokens.size(1),
                " tokens but the model's context is ", cfg_.max_seq,
                " (model.max_seq); use sequences of at most ", cfg_.max_seq, " tokens.");
  }

  // The block graph at [B, T], built once per shape.
  const BlockShape& block(int64_t B, int64_t T) {
    auto it = blocks_.find({B, T});
    if (it == blocks_.end()) {
      it = blocks_.emplace(std::make_pair(B, T), std::make_unique<BlockShape>(Arch::block(cfg_, B, T, compute_dtype_)))
               .first;
    }
    return *it->second;
  }

  // Per slot, whether layer l's forward keeps it.
  std::vector<bool> keeps(int64_t l) const {
    std::vector<bool> keep(kSlotCount, true);
    if (!store_) return keep;
    const LayerPlan& lp = store_->plan().layers[static_cast<size_t>(l)];
    for (const auto& slot : lp.dropped) keep[static_cast<size_t>(slot_of_name(slot))] = false;
    if (lp.chunk_begin >= 0 && lp.chunk_begin != l) keep[static_cast<size_t>(Slot::input)] = false;
    return keep;
  }

  Engine engine(const BlockShape& blk, const Weights& W, std::vector<at::Tensor>* grads, int64_t l,
                const StepContext& ctx, bool train = true) const {
    graph::RunContext run{ctx.seed, ctx.step, ctx.microbatch, l, train, device_, arch_.tables()};
    graph::RunContext again = run;
    if (store_) {
      const StepContext k = recompute_context(ctx, *store_);
      again.seed = k.seed;
      again.step = k.step;
      again.microbatch = k.microbatch;
    }
    return Engine{blk.graph, W.layers[static_cast<size_t>(l)], grads, run, again, store_.get(), l};
  }

  // uniform:N: the backward of a chunk's last layer re-runs the whole chunk's forward from
  // its first layer's kept input, keeping everything, as one recompute.
  void recompute_chunk(const BlockShape& blk, const Weights& W, int64_t last, const StepContext& ctx,
                       std::vector<std::unique_ptr<Run>>& runs) {
    const int64_t first = store_->plan().layers[static_cast<size_t>(last)].chunk_begin;
    store_->recompute([&] {
      at::Tensor x = runs[first]->value(blk.graph.input);
      for (int64_t j = first; j <= last; ++j) {
        const trace::Recompute recompute(j);
        Engine e = engine(blk, W, nullptr, j, ctx);
        auto fresh = std::make_unique<Run>(blk.graph, blk.lifetimes, std::vector<bool>(kSlotCount, true));
        x = fresh->forward(e, std::move(x), /*recompute=*/true);
        for (int s = 1; s < kSlotCount; ++s) {
          if (!runs[j]->missing(static_cast<Slot>(s))) continue;
          std::vector<at::Tensor> ts;
          for (int v : blk.graph.slot(static_cast<Slot>(s))) ts.push_back(fresh->value(v));
          store_->refilled(j, slot_name(static_cast<Slot>(s)), ts);
        }
        runs[j] = std::move(fresh);
      }
    });
  }

  // Final-norm output [B, T, C] without dropout; nothing is kept for a backward.
  at::Tensor hidden(const at::Tensor& tokens) {
    const Weights& W = compute_weights();
    const StepContext none;
    at::Tensor x = arch_.embed_forward(W, tokens, none, /*train=*/false).out;
    const BlockShape& blk = block(tokens.size(0), tokens.size(1));
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
      Engine e = engine(blk, W, nullptr, l, none, /*train=*/false);
      x = Run(blk.graph, blk.lifetimes, std::vector<bool>(kSlotCount, false), /*training=*/false).forward(e, std::move(x));
    }
    return arch_.final_norm_forward(W, x).out;
  }

  // The weights the ops compute with: the float32 masters themselves, or copies in the
  // compute dtype refreshed whenever the masters changed (once per optimizer step).
  const Weights& compute_weights() {
    if (compute_dtype_ == params_.front().value.scalar_type()) return weights_;
    auto src = weight_refs(weights_);
    int64_t version = 0;
    for (auto& [name, t] : src) version += t->_version();
    if (!cast_valid_ || version != cast_version_) {
      cast_ = weights_;
      auto dst = weight_refs(cast_);
      for (size_t i = 0; i < src.size(); ++i) *dst[i].second = src[i].second->to(compute_dtype_);
      cast_version_ = version;
      cast_valid_ = true;
    }
    return cast_;
  }

  Arch arch_;
  std::vector<graph::Param> block_params_;  ///< one layer's parameters, in the graph's order
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<BlockShape>> blocks_;  ///< by [B, T]
  std::unique_ptr<ActivationStore> store_;  ///< null: every slot kept
  Weights weights_;
  Weights grads_;
  Weights cast_;
  bool cast_valid_ = false;
  int64_t cast_version_ = 0;
};

}  // namespace remat::detail

namespace remat::detail {

std::unique_ptr<Model> make_gpt2(const ModelConfig& cfg, at::Device device, at::ScalarType dtype,
                                 uint64_t seed);
std::unique_ptr<Model> make_llama(const ModelConfig& cfg, at::Device device, at::ScalarType dtype,
                                  uint64_t seed);
graph::BlockGraph gpt2_block(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype);
graph::BlockGraph llama_block(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype);

}  // namespace remat::detail
