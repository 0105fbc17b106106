// The training loop of one microbatch, written once for both architectures.
//
// An Arch supplies: Weights (all parameter tensors, visit(f) over (name, tensor&) in a
// fixed order, make(cfg, options) allocating them), EmbedSaved/BlockSaved/NormSaved
// (each with tensors()), and the forward/backward of the embedding, one block and the
// final norm, plus which weight the loss head uses. The same Weights type holds the
// values, the gradients and, in bfloat16 runs, the per-step compute copies.
#pragma once

#include "remat/cost.h"
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

/// Writes recomputed tensors into the fields of `slot` if the slot is still missing, and
/// tells the store (which checks and counts them).
template <class Saved>
void refill(Saved& s, int64_t l, ActivationStore& st, const std::string& slot,
            const std::vector<std::pair<at::Tensor*, at::Tensor>>& values) {
  if (!s.missing.count(slot)) return;
  std::vector<at::Tensor> ts;
  for (const auto& [dst, v] : values) ts.push_back(*dst = v);
  s.missing.erase(slot);
  st.refilled(l, slot, ts);
}

/// Recompute without early stop: the whole block forward again, the ops no backward needs
/// included, refilling every missing slot of `s` from it.
template <class Arch>
void rerun_block(const Arch& arch, const typename Arch::Weights& W, int64_t l, const StepContext& ctx,
                 typename Arch::BlockSaved& s, ActivationStore& st) {
  auto f = arch.block_forward(W, l, Arch::input(s), recompute_context(ctx, st), /*train=*/true);
  for (const auto& op : arch.forward_ops()) st.count_op(op);
  const std::set<std::string> missing = s.missing;
  for (const auto& slot : missing) {
    std::vector<std::pair<at::Tensor*, at::Tensor>> values;
    auto dst = Arch::slot_fields(s, slot);
    auto src = Arch::slot_fields(f.saved, slot);
    for (size_t i = 0; i < dst.size(); ++i) values.emplace_back(dst[i], *src[i]);
    refill(s, l, st, slot, values);
  }
}

/// Returns the recompute pool's idle buffers to the system when it goes out of scope, if
/// `active`. Declared before a microbatch's saved tensors, it runs after they are freed,
/// also when a recompute throws (a failed determinism check), so no buffer stays pooled.
struct PoolDrain {
  bool active;
  ~PoolDrain() {
    if (active) memory::release_pool();
  }
};

template <class Arch>
class TransformerModel final : public Model {
 public:
  using Weights = typename Arch::Weights;

  TransformerModel(const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype,
                   uint64_t seed)
      : Model(cfg, device, compute_dtype), arch_(cfg, device, compute_dtype) {
    // Masters are float32, or float64 when computing in float64 (gradient tests).
    const auto f32 = at::TensorOptions().dtype(compute_dtype == at::kDouble ? at::kDouble : at::kFloat);
    // Initialise on CPU from one seeded generator so a seed means the same model on
    // every device, then move.
    weights_ = Weights::make(cfg, f32);
    auto gen = at::detail::createCPUGenerator(seed);
    for (auto& [name, t] : weight_refs(weights_)) {
      init_param(name, *t, cfg, gen);
      *t = t->to(device);
    }
    grads_ = Weights::make(cfg, f32.device(device));
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
    const PoolDrain drain{store_ != nullptr && store_->options().pool};

    // Coarse trace slices around the parts whose results outlive a block scope.
    std::optional<trace::Scope> part(std::in_place, "embedding forward", trace::Category::layer);
    auto emb = arch_.embed_forward(W, tokens, ctx, /*train=*/true);
    part.reset();
    at::Tensor x = emb.out;
    std::vector<typename Arch::BlockSaved> saved(L);
    for (int64_t l = 0; l < L; ++l) {
      const trace::Scope layer_scope("forward", trace::Category::layer, l);
      auto f = arch_.block_forward(W, l, x, ctx, /*train=*/true);
      x = f.out;
      saved[l] = std::move(f.saved);
      if (store_) drop_slots(l, saved[l]);
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
      for (int64_t l = 0; l < L; ++l) store_->add_kept_bytes(distinct_storage_bytes(saved[l].tensors(), seen));
    }
    if (measured != nullptr) {
      std::unordered_set<const void*> seen;
      measured->embedding = distinct_storage_bytes(emb.saved.tensors(), seen);
      measured->blocks.assign(L, 0);
      for (int64_t l = 0; l < L; ++l) measured->blocks[l] = distinct_storage_bytes(saved[l].tensors(), seen);
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
      if (saved[l].input_missing) recompute_chunk(W, l, ctx, saved);
      dx = arch_.block_backward(dx, saved[l], W, grads_, l, ctx, store_.get());
      saved[l] = {};
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

  double forward_flops(int64_t seq) const override { return arch_.forward_flops(seq); }

  void set_activation_plan(const ActivationPlan& plan, const StoreOptions& options) override {
    TORCH_CHECK(static_cast<int64_t>(plan.layers.size()) == cfg_.n_layer, "The activation plan has ",
                plan.layers.size(), " layers but the model has ", cfg_.n_layer);
    bool any = false;
    for (const auto& lp : plan.layers) any = any || !lp.keeps_all();
    store_ = any ? std::make_unique<ActivationStore>(plan, options) : nullptr;
  }
  ActivationStore* store() override { return store_.get(); }

  ActivationBytes predict_activation_bytes(int64_t B, int64_t T) const override {
    // The cost model's block program holds each slot's tensors (the planner prices the same).
    const cost::BlockProgram block = cost::block_program(cfg_, B, T, compute_dtype_);
    std::map<std::string, int64_t> slots;
    for (const auto& [slot, tensors] : block.slots) slots[slot] = block.slot_bytes(slot);
    ActivationBytes out;
    out.embedding = arch_.embed_bytes(B, T);
    out.head = arch_.head_bytes(B, T, compute_dtype_);
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
      const LayerPlan* lp = store_ ? &store_->plan().layers[l] : nullptr;
      int64_t bytes = 0;
      for (const auto& [slot, b] : slots) {
        const bool input_dropped = slot == "input" && lp != nullptr && lp->chunk_begin >= 0 && lp->chunk_begin != l;
        const bool dropped = slot != "input" && lp != nullptr && lp->dropped.count(slot) > 0;
        if (!input_dropped && !dropped) bytes += b;
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

  // Applies layer l's plan to its freshly saved tensors.
  void drop_slots(int64_t l, typename Arch::BlockSaved& s) {
    const LayerPlan& lp = store_->plan().layers[l];
    for (const auto& slot : lp.dropped) {
      store_->drop(l, slot, Arch::slot_fields(s, slot));
      s.missing.insert(slot);
    }
    if (lp.chunk_begin >= 0 && lp.chunk_begin != l) {
      Arch::input(s).reset();
      s.input_missing = true;
    }
  }

  // uniform:N: the backward of a chunk's last layer re-runs the whole chunk's forward from
  // its first layer's kept input, keeping everything, as one recompute.
  void recompute_chunk(const Weights& W, int64_t last, const StepContext& ctx,
                       std::vector<typename Arch::BlockSaved>& saved) {
    const int64_t first = store_->plan().layers[last].chunk_begin;
    const StepContext k = recompute_context(ctx, *store_);
    store_->recompute([&] {
      at::Tensor x = Arch::input(saved[first]);
      for (int64_t j = first; j <= last; ++j) {
        const trace::Recompute recompute(j);
        auto f = arch_.block_forward(W, j, x, k, /*train=*/true);
        for (const auto& op : arch_.forward_ops()) store_->count_op(op);
        for (const auto& slot : saved[j].missing) {
          std::vector<at::Tensor> ts;
          for (at::Tensor* t : Arch::slot_fields(f.saved, slot)) ts.push_back(*t);
          store_->refilled(j, slot, ts);
        }
        x = f.out;
        saved[j] = std::move(f.saved);
      }
    });
  }

  // Final-norm output [B, T, C] without dropout; nothing is kept for a backward.
  at::Tensor hidden(const at::Tensor& tokens) {
    const Weights& W = compute_weights();
    const StepContext none;
    at::Tensor x = arch_.embed_forward(W, tokens, none, /*train=*/false).out;
    for (int64_t l = 0; l < cfg_.n_layer; ++l) x = arch_.block_forward(W, l, x, none, false).out;
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

}  // namespace remat::detail
