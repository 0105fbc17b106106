// GPT-2: pre-LN blocks, learned positions, GELU MLP, tied head, dropout on embeddings,
// attention probabilities and both residual branches.
#include "model/transformer.h"

#include <set>

namespace remat::detail {
namespace {

using namespace remat::ops;

struct Gpt2Arch {
  struct Block {
    at::Tensor ln1_w, ln1_b, qkv_w, qkv_b, attn_proj_w, attn_proj_b;
    at::Tensor ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b;
    template <class F>
    void visit(const std::string& p, F&& f) {
      f(p + "ln_1.weight", ln1_w);
      f(p + "ln_1.bias", ln1_b);
      f(p + "attn.c_attn.weight", qkv_w);
      f(p + "attn.c_attn.bias", qkv_b);
      f(p + "attn.c_proj.weight", attn_proj_w);
      f(p + "attn.c_proj.bias", attn_proj_b);
      f(p + "ln_2.weight", ln2_w);
      f(p + "ln_2.bias", ln2_b);
      f(p + "mlp.c_fc.weight", fc_w);
      f(p + "mlp.c_fc.bias", fc_b);
      f(p + "mlp.c_proj.weight", mlp_proj_w);
      f(p + "mlp.c_proj.bias", mlp_proj_b);
    }
  };

  struct Weights {
    at::Tensor wte, wpe, lnf_w, lnf_b;
    std::vector<Block> h;
    template <class F>
    void visit(F&& f) {
      f("wte.weight", wte);
      f("wpe.weight", wpe);
      for (size_t l = 0; l < h.size(); ++l) h[l].visit("h." + std::to_string(l) + ".", f);
      f("ln_f.weight", lnf_w);
      f("ln_f.bias", lnf_b);
    }
    // Linear weights are [out, in] here; Hugging Face's Conv1D files hold them [in, out].
    static Weights make(const ModelConfig& c, const at::TensorOptions& o) {
      const int64_t C = c.d_model, F = c.d_ff;
      Weights w;
      w.wte = at::empty({c.vocab_size, C}, o);
      w.wpe = at::empty({c.max_seq, C}, o);
      w.lnf_w = at::empty({C}, o);
      w.lnf_b = at::empty({C}, o);
      for (int64_t l = 0; l < c.n_layer; ++l) {
        Block b;
        b.ln1_w = at::empty({C}, o);
        b.ln1_b = at::empty({C}, o);
        b.qkv_w = at::empty({3 * C, C}, o);
        b.qkv_b = at::empty({3 * C}, o);
        b.attn_proj_w = at::empty({C, C}, o);
        b.attn_proj_b = at::empty({C}, o);
        b.ln2_w = at::empty({C}, o);
        b.ln2_b = at::empty({C}, o);
        b.fc_w = at::empty({F, C}, o);
        b.fc_b = at::empty({F}, o);
        b.mlp_proj_w = at::empty({C, F}, o);
        b.mlp_proj_b = at::empty({C}, o);
        w.h.push_back(b);
      }
      return w;
    }
  };

  struct EmbedSaved {
    EmbeddingSaved tok;
    PositionEmbeddingSaved pos;
    DropoutSaved drop;
    std::vector<at::Tensor> tensors() const { return concat({tok.tensors(), pos.tensors(), drop.tensors()}); }
  };

  struct BlockSaved {
    LayerNormSaved ln1;
    LinearSaved qkv;
    AttentionSaved attn;
    LinearSaved attn_proj;
    DropoutSaved attn_drop;
    LayerNormSaved ln2;
    LinearSaved fc;
    GeluSaved act;
    LinearSaved mlp_proj;
    DropoutSaved mlp_drop;
    std::set<std::string> missing;  ///< slots the plan dropped that recompute has not refilled
    bool input_missing = false;     ///< uniform:N: the block input is owned by the chunk
    std::vector<at::Tensor> tensors() const {
      return concat({ln1.tensors(), qkv.tensors(), attn.tensors(), attn_proj.tensors(), attn_drop.tensors(),
                     ln2.tensors(), fc.tensors(), act.tensors(), mlp_proj.tensors(), mlp_drop.tensors()});
    }
  };

  Gpt2Arch(const ModelConfig& c, at::Device, at::ScalarType) : c(c) {}

  static const at::Tensor& head(const Weights& w) { return w.wte; }
  static at::Tensor& head(Weights& w) { return w.wte; }

  static bool hf_transposed(const std::string& name) {
    return ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
           ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight");
  }

  // Causal-mask buffers of older checkpoints, and the tied head's copy.
  static bool ignorable(const std::string& name) {
    return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") || name == "lm_head.weight";
  }

  double p(bool train) const { return train ? c.dropout : 0.0; }

  Fwd<EmbedSaved> embed_forward(const Weights& w, const at::Tensor& ids, const StepContext& ctx, bool train) const {
    EmbedSaved s;
    auto tok = embedding_forward(ids, w.wte);
    auto pos = position_embedding_forward(ids.size(1), w.wpe);
    auto drop = dropout_forward(tok.out + pos.out, p(train), dropout_key(ctx, 0, DropoutSite::embedding));
    s.tok = std::move(tok.saved);
    s.pos = pos.saved;
    s.drop = std::move(drop.saved);
    return {drop.out, std::move(s)};
  }

  void embed_backward(const at::Tensor& dy, EmbedSaved& s, const Weights&, Weights& g) const {
    at::Tensor dx = dropout_backward(dy, s.drop);
    embedding_backward(dx, s.tok, g.wte);
    position_embedding_backward(dx, s.pos, g.wpe);
  }

  Fwd<BlockSaved> block_forward(const Weights& W, int64_t l, const at::Tensor& x, const StepContext& ctx,
                                bool train) const {
    const Block& w = W.h[l];
    const int64_t B = x.size(0), T = x.size(1), C = c.d_model, H = c.n_head, D = c.head_dim();
    BlockSaved s;
    auto ln1 = layernorm_forward(x, w.ln1_w, w.ln1_b, c.norm_eps);
    auto qkv = linear_forward(ln1.out, w.qkv_w, w.qkv_b);
    auto q = qkv.out.narrow(-1, 0, C).view({B, T, H, D});
    auto k = qkv.out.narrow(-1, C, C).view({B, T, H, D});
    auto v = qkv.out.narrow(-1, 2 * C, C).view({B, T, H, D});
    auto attn = attention_forward(q, k, v, p(train), dropout_key(ctx, l, DropoutSite::attn_probs));
    auto proj = linear_forward(attn.out.reshape({B, T, C}), w.attn_proj_w, w.attn_proj_b);
    auto d1 = dropout_forward(proj.out, p(train), dropout_key(ctx, l, DropoutSite::attn_resid));
    at::Tensor x1 = residual_forward(x, d1.out).out;
    auto ln2 = layernorm_forward(x1, w.ln2_w, w.ln2_b, c.norm_eps);
    auto fc = linear_forward(ln2.out, w.fc_w, w.fc_b);
    auto act = gelu_forward(fc.out);
    auto mp = linear_forward(act.out, w.mlp_proj_w, w.mlp_proj_b);
    auto d2 = dropout_forward(mp.out, p(train), dropout_key(ctx, l, DropoutSite::mlp_resid));
    at::Tensor out = residual_forward(x1, d2.out).out;
    if (train) {
      s.ln1 = std::move(ln1.saved);
      s.qkv = std::move(qkv.saved);
      s.attn = std::move(attn.saved);
      s.attn_proj = std::move(proj.saved);
      s.attn_drop = std::move(d1.saved);
      s.ln2 = std::move(ln2.saved);
      s.fc = std::move(fc.saved);
      s.act = std::move(act.saved);
      s.mlp_proj = std::move(mp.saved);
      s.mlp_drop = std::move(d2.saved);
    }
    return {out, std::move(s)};
  }

  static at::Tensor& input(BlockSaved& s) { return s.ln1.x; }

  // The Saved fields behind each slot name of remat/plan.h.
  static std::vector<at::Tensor*> slot_fields(BlockSaved& s, const std::string& slot) {
    if (slot == "attn.norm") return {&s.ln1.mean, &s.ln1.rstd};
    if (slot == "attn.qkv_in") return {&s.qkv.x};
    if (slot == "attn.qkv") return {&s.attn.q, &s.attn.k, &s.attn.v};
    if (slot == "attn.probs") return {&s.attn.probs};
    if (slot == "attn.dropout") return {&s.attn.mask, &s.attn.probs_d};
    if (slot == "attn.proj_in") return {&s.attn_proj.x};
    if (slot == "attn.resid") return {&s.attn_drop.mask};
    if (slot == "mlp.norm") return {&s.ln2.x, &s.ln2.mean, &s.ln2.rstd};
    if (slot == "mlp.fc_in") return {&s.fc.x};
    if (slot == "mlp.act_in") return {&s.act.x};
    if (slot == "mlp.proj_in") return {&s.mlp_proj.x};
    if (slot == "mlp.resid") return {&s.mlp_drop.mask};
    TORCH_INTERNAL_ASSERT(false, "unknown slot ", slot);
  }

  int64_t embed_bytes(int64_t B, int64_t T) const {
    return embedding_saved_bytes(B * T) + dropout_saved_bytes(B * T * c.d_model, c.dropout);
  }
  int64_t head_bytes(int64_t B, int64_t T, at::ScalarType f) const {
    return layernorm_saved_bytes(B * T, c.d_model, f) + cross_entropy_saved_bytes(B * T, c.d_model, f);
  }

  // The op kinds one block forward executes, for counting whole-block recomputes.
  std::vector<std::string> forward_ops() const {
    std::vector<std::string> ops = {"layernorm", "linear", "attention", "linear", "residual",
                                    "layernorm", "linear", "gelu",      "linear", "residual"};
    if (c.dropout > 0) ops.insert(ops.end(), {"dropout", "dropout"});
    return ops;
  }

  // Refills a dropped slot of layer l from the kept tensors, re-executing only the forward
  // ops it depends on. A re-executed op refills every dropped slot it produces: backward
  // consumes slots in reverse forward order, so all of them are still to be used.
  void ensure(const Weights& W, int64_t l, const StepContext& ctx, BlockSaved& s, const std::string& slot,
              ActivationStore& st) const {
    if (!s.missing.count(slot)) return;
    const trace::Recompute recompute(l);
    if (!st.options().early_stop) return rerun_block(*this, W, l, ctx, s, st);
    const Block& w = W.h[l];
    const at::Tensor& x = s.ln1.x;
    const int64_t B = x.size(0), T = x.size(1), C = c.d_model, H = c.n_head, D = c.head_dim();
    const StepContext k = recompute_context(ctx, st);
    const double p = c.dropout;
    auto fill = [&](const std::string& name, const std::vector<std::pair<at::Tensor*, at::Tensor>>& values) {
      refill(s, l, st, name, values);
    };
    auto mask = [&](DropoutSite site) {
      if (p == 0) return at::Tensor();
      st.count_op("dropout");
      return dropout_mask({B, T, C}, p, dropout_key(k, l, site), x.device());
    };
    using Timer = ActivationStore::NodeTimer;  // names: the cost model's nodes (src/plan/programs.cpp)
    if (slot == "attn.norm" || slot == "attn.qkv_in") {
      const Timer timer(st, "ln_1", x.device());
      auto r = layernorm_forward(x, w.ln1_w, w.ln1_b, c.norm_eps);
      st.count_op("layernorm");
      fill("attn.norm", {{&s.ln1.mean, r.saved.mean}, {&s.ln1.rstd, r.saved.rstd}});
      fill("attn.qkv_in", {{&s.qkv.x, r.out}});
    } else if (slot == "attn.qkv") {
      ensure(W, l, ctx, s, "attn.qkv_in", st);
      const Timer timer(st, "c_attn", x.device());
      auto r = linear_forward(s.qkv.x, w.qkv_w, w.qkv_b);
      st.count_op("linear");
      fill("attn.qkv", {{&s.attn.q, r.out.narrow(-1, 0, C).view({B, T, H, D})},
                        {&s.attn.k, r.out.narrow(-1, C, C).view({B, T, H, D})},
                        {&s.attn.v, r.out.narrow(-1, 2 * C, C).view({B, T, H, D})}});
    } else if (slot == "attn.probs" || slot == "attn.dropout" || slot == "attn.proj_in") {
      ensure(W, l, ctx, s, "attn.qkv", st);
      const Timer timer(st, "attention", x.device());
      auto r = attention_forward(s.attn.q, s.attn.k, s.attn.v, p, dropout_key(k, l, DropoutSite::attn_probs));
      st.count_op("attention");
      fill("attn.probs", {{&s.attn.probs, r.saved.probs}});
      fill("attn.dropout", {{&s.attn.mask, r.saved.mask}, {&s.attn.probs_d, r.saved.probs_d}});
      fill("attn.proj_in", {{&s.attn_proj.x, r.out.reshape({B, T, C})}});
    } else if (slot == "attn.resid") {
      const Timer timer(st, "attn_resid_mask", x.device());
      fill("attn.resid", {{&s.attn_drop.mask, mask(DropoutSite::attn_resid)}});
    } else if (slot == "mlp.norm" || slot == "mlp.fc_in") {
      at::Tensor x1 = s.ln2.x;
      const bool with_x1 = s.missing.count("mlp.norm") > 0;
      if (with_x1) ensure(W, l, ctx, s, "attn.proj_in", st);
      const Timer timer(st, with_x1 ? "attn_proj_ln_2" : "ln_2", x.device());
      if (with_x1) {
        auto proj = linear_forward(s.attn_proj.x, w.attn_proj_w, w.attn_proj_b);
        st.count_op("linear");
        auto d1 = dropout_forward(proj.out, p, dropout_key(k, l, DropoutSite::attn_resid));
        if (p > 0) st.count_op("dropout");
        fill("attn.resid", {{&s.attn_drop.mask, d1.saved.mask}});
        x1 = residual_forward(x, d1.out).out;
        st.count_op("residual");
      }
      auto r = layernorm_forward(x1, w.ln2_w, w.ln2_b, c.norm_eps);
      st.count_op("layernorm");
      fill("mlp.norm", {{&s.ln2.x, x1}, {&s.ln2.mean, r.saved.mean}, {&s.ln2.rstd, r.saved.rstd}});
      fill("mlp.fc_in", {{&s.fc.x, r.out}});
    } else if (slot == "mlp.act_in") {
      ensure(W, l, ctx, s, "mlp.fc_in", st);
      const Timer timer(st, "c_fc", x.device());
      auto r = linear_forward(s.fc.x, w.fc_w, w.fc_b);
      st.count_op("linear");
      fill("mlp.act_in", {{&s.act.x, r.out}});
    } else if (slot == "mlp.proj_in") {
      ensure(W, l, ctx, s, "mlp.act_in", st);
      const Timer timer(st, "gelu", x.device());
      auto r = gelu_forward(s.act.x);
      st.count_op("gelu");
      fill("mlp.proj_in", {{&s.mlp_proj.x, r.out}});
    } else if (slot == "mlp.resid") {
      const Timer timer(st, "mlp_resid_mask", x.device());
      fill("mlp.resid", {{&s.mlp_drop.mask, mask(DropoutSite::mlp_resid)}});
    }
  }

  // Each Saved field is released as soon as its backward has consumed it; dropped slots
  // are refilled just before their backward needs them.
  at::Tensor block_backward(const at::Tensor& dy, BlockSaved& s, const Weights& W, Weights& G, int64_t l,
                            const StepContext& ctx, ActivationStore* st) const {
    auto need = [&](std::initializer_list<const char*> slots) {
      for (const char* slot : slots) {
        if (st != nullptr) st->recompute([&] { ensure(W, l, ctx, s, slot, *st); });
      }
    };
    const Block& w = W.h[l];
    Block& g = G.h[l];
    const int64_t B = dy.size(0), T = dy.size(1), C = c.d_model, H = c.n_head, D = c.head_dim();
    need({"mlp.resid"});
    at::Tensor d = dropout_backward(dy, std::exchange(s.mlp_drop, {}));
    need({"mlp.proj_in"});
    d = linear_backward(d, std::exchange(s.mlp_proj, {}), w.mlp_proj_w, g.mlp_proj_w, &g.mlp_proj_b);
    need({"mlp.act_in"});
    d = gelu_backward(d, std::exchange(s.act, {}));
    need({"mlp.fc_in"});
    d = linear_backward(d, std::exchange(s.fc, {}), w.fc_w, g.fc_w, &g.fc_b);
    need({"mlp.norm"});
    at::Tensor dx1 = dy + layernorm_backward(d, std::exchange(s.ln2, {}), w.ln2_w, g.ln2_w, g.ln2_b);
    need({"attn.resid"});
    d = dropout_backward(dx1, std::exchange(s.attn_drop, {}));
    need({"attn.proj_in"});
    d = linear_backward(d, std::exchange(s.attn_proj, {}), w.attn_proj_w, g.attn_proj_w, &g.attn_proj_b);
    need({"attn.qkv", "attn.probs", "attn.dropout"});
    auto ag = attention_backward(d.view({B, T, H, D}), std::exchange(s.attn, {}));
    at::Tensor dqkv = at::cat({ag.dq.reshape({B, T, C}), ag.dk.reshape({B, T, C}), ag.dv.reshape({B, T, C})}, -1);
    ag = {};
    need({"attn.qkv_in"});
    d = linear_backward(dqkv, std::exchange(s.qkv, {}), w.qkv_w, g.qkv_w, &g.qkv_b);
    need({"attn.norm"});
    return dx1 + layernorm_backward(d, std::exchange(s.ln1, {}), w.ln1_w, g.ln1_w, g.ln1_b);
  }

  Fwd<LayerNormSaved> final_norm_forward(const Weights& w, const at::Tensor& x) const {
    return layernorm_forward(x, w.lnf_w, w.lnf_b, c.norm_eps);
  }
  at::Tensor final_norm_backward(const at::Tensor& dy, const LayerNormSaved& s, const Weights& w, Weights& g) const {
    return layernorm_backward(dy, s, w.lnf_w, g.lnf_w, g.lnf_b);
  }

  double forward_flops(int64_t T) const {
    const int64_t C = c.d_model, F = c.d_ff, V = c.vocab_size;
    const AttentionShape a{1, T, c.n_head, c.n_head, c.head_dim()};
    double block = 2 * layernorm_flops(T, C) + linear_flops(T, C, 3 * C, true) + attention_flops(a, c.dropout) +
                   linear_flops(T, C, C, true) + 2 * dropout_flops(T * C, c.dropout) + 2 * residual_flops(T * C) +
                   linear_flops(T, C, F, true) + gelu_flops(T * F) + linear_flops(T, F, C, true);
    return dropout_flops(T * C, c.dropout) + c.n_layer * block + layernorm_flops(T, C) + cross_entropy_flops(T, C, V);
  }

  ModelConfig c;
};

}  // namespace

std::unique_ptr<Model> make_gpt2(const ModelConfig& cfg, at::Device device, at::ScalarType dtype, uint64_t seed) {
  return std::make_unique<TransformerModel<Gpt2Arch>>(cfg, device, dtype, seed);
}

}  // namespace remat::detail
