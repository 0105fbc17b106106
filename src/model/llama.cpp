// Llama: RMSNorm, rotary positions, grouped-query attention, fused SwiGLU MLP, untied
// head; dropout (model.dropout) on the attention probabilities only.
#include "model/transformer.h"

#include <set>

namespace remat::detail {
namespace {

using namespace remat::ops;

struct LlamaArch {
  struct Block {
    at::Tensor in_norm, wq, wk, wv, wo, post_norm, w_gate, w_up, w_down;
    template <class F>
    void visit(const std::string& p, F&& f) {
      f(p + "input_layernorm.weight", in_norm);
      f(p + "self_attn.q_proj.weight", wq);
      f(p + "self_attn.k_proj.weight", wk);
      f(p + "self_attn.v_proj.weight", wv);
      f(p + "self_attn.o_proj.weight", wo);
      f(p + "post_attention_layernorm.weight", post_norm);
      f(p + "mlp.gate_proj.weight", w_gate);
      f(p + "mlp.up_proj.weight", w_up);
      f(p + "mlp.down_proj.weight", w_down);
    }
  };

  struct Weights {
    at::Tensor embed, norm, lm_head;
    std::vector<Block> layers;
    template <class F>
    void visit(F&& f) {
      f("model.embed_tokens.weight", embed);
      for (size_t l = 0; l < layers.size(); ++l) layers[l].visit("model.layers." + std::to_string(l) + ".", f);
      f("model.norm.weight", norm);
      f("lm_head.weight", lm_head);
    }
    static Weights make(const ModelConfig& c, const at::TensorOptions& o) {
      const int64_t C = c.d_model, F = c.d_ff, KV = c.n_kv_head * c.head_dim();
      Weights w;
      w.embed = at::empty({c.vocab_size, C}, o);
      w.norm = at::empty({C}, o);
      w.lm_head = at::empty({c.vocab_size, C}, o);
      for (int64_t l = 0; l < c.n_layer; ++l) {
        Block b;
        b.in_norm = at::empty({C}, o);
        b.wq = at::empty({C, C}, o);
        b.wk = at::empty({KV, C}, o);
        b.wv = at::empty({KV, C}, o);
        b.wo = at::empty({C, C}, o);
        b.post_norm = at::empty({C}, o);
        b.w_gate = at::empty({F, C}, o);
        b.w_up = at::empty({F, C}, o);
        b.w_down = at::empty({C, F}, o);
        w.layers.push_back(b);
      }
      return w;
    }
  };

  struct EmbedSaved {
    EmbeddingSaved tok;
    std::vector<at::Tensor> tensors() const { return tok.tensors(); }
  };

  // q/k/v projections read the same normed input, as do gate/up: it is saved once.
  struct BlockSaved {
    RMSNormSaved n1;
    LinearSaved qkv_in;
    AttentionSaved attn;
    LinearSaved o;
    RMSNormSaved n2;
    LinearSaved gate_up_in;
    SwiGLUSaved act;
    LinearSaved down;
    std::set<std::string> missing;  ///< slots the plan dropped that recompute has not refilled
    bool input_missing = false;     ///< uniform:N: the block input is owned by the chunk
    std::vector<at::Tensor> tensors() const {
      return concat({n1.tensors(), qkv_in.tensors(), attn.tensors(), o.tensors(), n2.tensors(),
                     gate_up_in.tensors(), act.tensors(), down.tensors()});
    }
  };

  LlamaArch(const ModelConfig& c, at::Device device, at::ScalarType dtype)
      : c(c), rope(rope_tables(c.max_seq, c.head_dim(), c.rope_theta, dtype, device)) {}

  static const at::Tensor& head(const Weights& w) { return w.lm_head; }
  static at::Tensor& head(Weights& w) { return w.lm_head; }
  static bool hf_transposed(const std::string&) { return false; }
  static bool ignorable(const std::string& name) { return ends_with(name, ".rotary_emb.inv_freq"); }

  RopeTables tables(int64_t T) const { return {rope.cos.narrow(0, 0, T), rope.sin.narrow(0, 0, T)}; }

  Fwd<EmbedSaved> embed_forward(const Weights& w, const at::Tensor& ids, const StepContext&, bool) const {
    auto tok = embedding_forward(ids, w.embed);
    return {tok.out, EmbedSaved{std::move(tok.saved)}};
  }
  void embed_backward(const at::Tensor& dy, EmbedSaved& s, const Weights&, Weights& g) const {
    embedding_backward(dy, s.tok, g.embed);
  }

  Fwd<BlockSaved> block_forward(const Weights& W, int64_t l, const at::Tensor& x, const StepContext& ctx,
                                bool train) const {
    const Block& w = W.layers[l];
    const int64_t B = x.size(0), T = x.size(1), C = c.d_model, Hq = c.n_head, Hkv = c.n_kv_head, D = c.head_dim();
    const auto rt = tables(T);
    BlockSaved s;
    auto n1 = rmsnorm_forward(x, w.in_norm, c.norm_eps);
    auto q = linear_forward(n1.out, w.wq, {});
    auto k = linear_forward(n1.out, w.wk, {});
    auto v = linear_forward(n1.out, w.wv, {});
    auto qr = rope_forward(q.out.view({B, T, Hq, D}), rt);
    auto kr = rope_forward(k.out.view({B, T, Hkv, D}), rt);
    auto attn = attention_forward(qr.out, kr.out, v.out.view({B, T, Hkv, D}), train ? c.dropout : 0.0,
                                  dropout_key(ctx, l, DropoutSite::attn_probs));
    auto o = linear_forward(attn.out.reshape({B, T, C}), w.wo, {});
    at::Tensor x1 = residual_forward(x, o.out).out;
    auto n2 = rmsnorm_forward(x1, w.post_norm, c.norm_eps);
    auto gate = linear_forward(n2.out, w.w_gate, {});
    auto up = linear_forward(n2.out, w.w_up, {});
    auto act = swiglu_forward(gate.out, up.out);
    auto down = linear_forward(act.out, w.w_down, {});
    at::Tensor out = residual_forward(x1, down.out).out;
    if (train) {
      s.n1 = std::move(n1.saved);
      s.qkv_in = std::move(q.saved);
      s.attn = std::move(attn.saved);
      s.o = std::move(o.saved);
      s.n2 = std::move(n2.saved);
      s.gate_up_in = std::move(gate.saved);
      s.act = std::move(act.saved);
      s.down = std::move(down.saved);
    }
    return {out, std::move(s)};
  }

  static at::Tensor& input(BlockSaved& s) { return s.n1.x; }

  // The Saved fields behind each slot name of remat/plan.h (Llama has no residual dropout).
  static std::vector<at::Tensor*> slot_fields(BlockSaved& s, const std::string& slot) {
    if (slot == "attn.norm") return {&s.n1.rstd};
    if (slot == "attn.qkv_in") return {&s.qkv_in.x};
    if (slot == "attn.qkv") return {&s.attn.q, &s.attn.k, &s.attn.v};
    if (slot == "attn.probs") return {&s.attn.probs};
    if (slot == "attn.dropout") return {&s.attn.mask, &s.attn.probs_d};
    if (slot == "attn.proj_in") return {&s.o.x};
    if (slot == "mlp.norm") return {&s.n2.x, &s.n2.rstd};
    if (slot == "mlp.fc_in") return {&s.gate_up_in.x};
    if (slot == "mlp.act_in") return {&s.act.gate, &s.act.up};
    if (slot == "mlp.proj_in") return {&s.down.x};
    if (slot == "attn.resid" || slot == "mlp.resid") return {};
    TORCH_INTERNAL_ASSERT(false, "unknown slot ", slot);
  }

  int64_t embed_bytes(int64_t B, int64_t T) const { return embedding_saved_bytes(B * T); }
  int64_t head_bytes(int64_t B, int64_t T, at::ScalarType f) const {
    return rmsnorm_saved_bytes(B * T, c.d_model, f) + cross_entropy_saved_bytes(B * T, c.d_model, f);
  }

  std::vector<std::string> forward_ops() const {
    return {"rmsnorm", "linear", "linear", "linear", "rope",   "rope",   "attention", "linear",
            "residual", "rmsnorm", "linear", "linear", "swiglu", "linear", "residual"};
  }

  // Refills a dropped slot of layer l from the kept tensors, re-executing only the forward
  // ops it depends on (see the GPT-2 block for the reasoning).
  void ensure(const Weights& W, int64_t l, const StepContext& ctx, BlockSaved& s, const std::string& slot,
              ActivationStore& st) const {
    if (!s.missing.count(slot)) return;
    const trace::Recompute recompute(l);
    if (!st.options().early_stop) return rerun_block(*this, W, l, ctx, s, st);
    const Block& w = W.layers[l];
    const at::Tensor& x = s.n1.x;
    const int64_t B = x.size(0), T = x.size(1), C = c.d_model, Hq = c.n_head, Hkv = c.n_kv_head, D = c.head_dim();
    const StepContext k = recompute_context(ctx, st);
    auto fill = [&](const std::string& name, const std::vector<std::pair<at::Tensor*, at::Tensor>>& values) {
      refill(s, l, st, name, values);
    };
    using Timer = ActivationStore::NodeTimer;  // names: the cost model's nodes (src/plan/programs.cpp)
    if (slot == "attn.norm" || slot == "attn.qkv_in") {
      const Timer timer(st, "input_layernorm", x.device());
      auto r = rmsnorm_forward(x, w.in_norm, c.norm_eps);
      st.count_op("rmsnorm");
      fill("attn.norm", {{&s.n1.rstd, r.saved.rstd}});
      fill("attn.qkv_in", {{&s.qkv_in.x, r.out}});
    } else if (slot == "attn.qkv") {
      ensure(W, l, ctx, s, "attn.qkv_in", st);
      const Timer timer(st, "qkv_rope", x.device());
      const auto rt = tables(T);
      auto q = linear_forward(s.qkv_in.x, w.wq, {});
      auto kk = linear_forward(s.qkv_in.x, w.wk, {});
      auto v = linear_forward(s.qkv_in.x, w.wv, {});
      auto qr = rope_forward(q.out.view({B, T, Hq, D}), rt);
      auto kr = rope_forward(kk.out.view({B, T, Hkv, D}), rt);
      for (const char* op : {"linear", "linear", "linear", "rope", "rope"}) st.count_op(op);
      fill("attn.qkv", {{&s.attn.q, qr.out}, {&s.attn.k, kr.out}, {&s.attn.v, v.out.view({B, T, Hkv, D})}});
    } else if (slot == "attn.probs" || slot == "attn.dropout" || slot == "attn.proj_in") {
      ensure(W, l, ctx, s, "attn.qkv", st);
      const Timer timer(st, "attention", x.device());
      auto r = attention_forward(s.attn.q, s.attn.k, s.attn.v, c.dropout,
                                 dropout_key(k, l, DropoutSite::attn_probs));
      st.count_op("attention");
      fill("attn.probs", {{&s.attn.probs, r.saved.probs}});
      fill("attn.dropout", {{&s.attn.mask, r.saved.mask}, {&s.attn.probs_d, r.saved.probs_d}});
      fill("attn.proj_in", {{&s.o.x, r.out.reshape({B, T, C})}});
    } else if (slot == "mlp.norm" || slot == "mlp.fc_in") {
      at::Tensor x1 = s.n2.x;
      const bool with_x1 = s.missing.count("mlp.norm") > 0;
      if (with_x1) ensure(W, l, ctx, s, "attn.proj_in", st);
      const Timer timer(st, with_x1 ? "o_proj_post_layernorm" : "post_attention_layernorm", x.device());
      if (with_x1) {
        auto o = linear_forward(s.o.x, w.wo, {});
        x1 = residual_forward(x, o.out).out;
        st.count_op("linear");
        st.count_op("residual");
      }
      auto r = rmsnorm_forward(x1, w.post_norm, c.norm_eps);
      st.count_op("rmsnorm");
      fill("mlp.norm", {{&s.n2.x, x1}, {&s.n2.rstd, r.saved.rstd}});
      fill("mlp.fc_in", {{&s.gate_up_in.x, r.out}});
    } else if (slot == "mlp.act_in") {
      ensure(W, l, ctx, s, "mlp.fc_in", st);
      const Timer timer(st, "gate_up_proj", x.device());
      auto gate = linear_forward(s.gate_up_in.x, w.w_gate, {});
      auto up = linear_forward(s.gate_up_in.x, w.w_up, {});
      st.count_op("linear");
      st.count_op("linear");
      fill("mlp.act_in", {{&s.act.gate, gate.out}, {&s.act.up, up.out}});
    } else if (slot == "mlp.proj_in") {
      ensure(W, l, ctx, s, "mlp.act_in", st);
      const Timer timer(st, "swiglu", x.device());
      auto r = swiglu_forward(s.act.gate, s.act.up);
      st.count_op("swiglu");
      fill("mlp.proj_in", {{&s.down.x, r.out}});
    } else {
      s.missing.erase(slot);  // residual dropout: no tensors in Llama
    }
  }


  at::Tensor block_backward(const at::Tensor& dy, BlockSaved& s, const Weights& W, Weights& G, int64_t l,
                            const StepContext& ctx, ActivationStore* st) const {
    auto need = [&](std::initializer_list<const char*> slots) {
      for (const char* slot : slots) {
        if (st != nullptr) st->recompute([&] { ensure(W, l, ctx, s, slot, *st); });
      }
    };
    const Block& w = W.layers[l];
    Block& g = G.layers[l];
    const int64_t B = dy.size(0), T = dy.size(1), Hq = c.n_head, Hkv = c.n_kv_head, D = c.head_dim();
    const auto rt = tables(T);
    need({"mlp.proj_in"});
    at::Tensor d = linear_backward(dy, std::exchange(s.down, {}), w.w_down, g.w_down, nullptr);
    need({"mlp.act_in"});
    auto sg = swiglu_backward(d, std::exchange(s.act, {}));
    need({"mlp.fc_in"});
    const LinearSaved gu = std::exchange(s.gate_up_in, {});
    d = linear_backward(sg.dgate, gu, w.w_gate, g.w_gate, nullptr) + linear_backward(sg.dup, gu, w.w_up, g.w_up, nullptr);
    sg = {};
    need({"mlp.norm"});
    at::Tensor dx1 = dy + rmsnorm_backward(d, std::exchange(s.n2, {}), w.post_norm, g.post_norm);
    need({"attn.proj_in"});
    d = linear_backward(dx1, std::exchange(s.o, {}), w.wo, g.wo, nullptr);
    need({"attn.qkv", "attn.probs", "attn.dropout"});
    auto ag = attention_backward(d.view({B, T, Hq, D}), std::exchange(s.attn, {}));
    at::Tensor dq = rope_backward(ag.dq, {}, rt).reshape({B, T, Hq * D});
    at::Tensor dk = rope_backward(ag.dk, {}, rt).reshape({B, T, Hkv * D});
    at::Tensor dv = ag.dv.reshape({B, T, Hkv * D});
    ag = {};
    need({"attn.qkv_in"});
    const LinearSaved in = std::exchange(s.qkv_in, {});
    d = linear_backward(dq, in, w.wq, g.wq, nullptr) + linear_backward(dk, in, w.wk, g.wk, nullptr) +
        linear_backward(dv, in, w.wv, g.wv, nullptr);
    need({"attn.norm"});
    return dx1 + rmsnorm_backward(d, std::exchange(s.n1, {}), w.in_norm, g.in_norm);
  }

  Fwd<RMSNormSaved> final_norm_forward(const Weights& w, const at::Tensor& x) const {
    return rmsnorm_forward(x, w.norm, c.norm_eps);
  }
  at::Tensor final_norm_backward(const at::Tensor& dy, const RMSNormSaved& s, const Weights& w, Weights& g) const {
    return rmsnorm_backward(dy, s, w.norm, g.norm);
  }

  double forward_flops(int64_t T) const {
    const int64_t C = c.d_model, F = c.d_ff, V = c.vocab_size, KV = c.n_kv_head * c.head_dim();
    const AttentionShape a{1, T, c.n_head, c.n_kv_head, c.head_dim()};
    double block = 2 * rmsnorm_flops(T, C) + linear_flops(T, C, C, false) + 2 * linear_flops(T, C, KV, false) +
                   rope_flops(T * (C + KV)) + attention_flops(a, c.dropout) + linear_flops(T, C, C, false) +
                   2 * residual_flops(T * C) + 2 * linear_flops(T, C, F, false) + swiglu_flops(T * F) +
                   linear_flops(T, F, C, false);
    return c.n_layer * block + rmsnorm_flops(T, C) + cross_entropy_flops(T, C, V);
  }

  ModelConfig c;
  RopeTables rope;
};

}  // namespace

std::unique_ptr<Model> make_llama(const ModelConfig& cfg, at::Device device, at::ScalarType dtype, uint64_t seed) {
  return std::make_unique<TransformerModel<LlamaArch>>(cfg, device, dtype, seed);
}

}  // namespace remat::detail
