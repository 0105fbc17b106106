// Llama: RMSNorm, rotary positions, grouped-query attention, fused SwiGLU MLP, untied
// head; dropout (model.dropout) on the attention probabilities only.
#include "model/transformer.h"


namespace remat::detail {
namespace {

using namespace remat::ops;

struct LlamaArch {
  // One block, in the order of its forward. Parameters are declared in Hugging Face order.
  static graph::BlockGraph block(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype) {
    using namespace graph;
    const int64_t C = c.d_model, F = c.d_ff, Hq = c.n_head, Hkv = c.n_kv_head, D = c.head_dim(), KV = Hkv * D;
    Builder b({{B, T, C}, dtype, {}});
    const int n1_w = b.param("input_layernorm.weight", {C});
    const int wq = b.param("self_attn.q_proj.weight", {C, C}), wk = b.param("self_attn.k_proj.weight", {KV, C});
    const int wv = b.param("self_attn.v_proj.weight", {KV, C}), wo = b.param("self_attn.o_proj.weight", {C, C});
    const int n2_w = b.param("post_attention_layernorm.weight", {C});
    const int w_gate = b.param("mlp.gate_proj.weight", {F, C}), w_up = b.param("mlp.up_proj.weight", {F, C});
    const int w_down = b.param("mlp.down_proj.weight", {C, F});
    Attrs norm, core;
    norm.eps = c.norm_eps;
    core.p = c.dropout;
    core.site = ops::DropoutSite::attn_probs;
    core.tiles = {c.attention_tile, c.attention_tile};

    const auto n1 = b.add("input_layernorm", op::rmsnorm(), {b.input()}, {n1_w}, norm);
    const int q = b.add1("q_proj", op::linear(), {n1[0]}, {wq});
    const int k = b.add1("k_proj", op::linear(), {n1[0]}, {wk});
    const int v = b.add1("v_proj", op::linear(), {n1[0]}, {wv});
    const int qh = b.view("q_heads", q, {B, T, Hq, D});
    const int kh = b.view("k_heads", k, {B, T, Hkv, D});
    const int vh = b.view("v_heads", v, {B, T, Hkv, D});
    const int qr = b.add1("q_rope", op::rope(), {qh});
    const int kr = b.add1("k_rope", op::rope(), {kh});
    const auto attn = b.add("attention", op::attention(c.attention), {qr, kr, vh}, {}, core);
    const int merged = b.view("attn_merge", attn[0], {B, T, C});
    const int o = b.add1("o_proj", op::linear(), {merged}, {wo});
    const int x1 = b.add1("attn_residual", op::residual(), {b.input(), o});
    const auto n2 = b.add("post_attention_layernorm", op::rmsnorm(), {x1}, {n2_w}, norm);
    const int gate = b.add1("gate_proj", op::linear(), {n2[0]}, {w_gate});
    const int up = b.add1("up_proj", op::linear(), {n2[0]}, {w_up});
    const int act = b.add1("swiglu", op::swiglu(), {gate, up});
    const int down = b.add1("down_proj", op::linear(), {act}, {w_down});
    const int out = b.add1("mlp_residual", op::residual(), {x1, down});

    b.slot(Slot::input, {b.input()});
    b.slot(Slot::attn_norm, {n1[1]});
    b.slot(Slot::attn_qkv_in, {n1[0]});
    b.slot(Slot::attn_qkv, {qr, kr, vh});
    b.slot(Slot::attn_probs, {attn[1]});
    b.slot(Slot::attn_dropout, {attn.begin() + 2, attn.end()});
    b.slot(Slot::attn_proj_in, {merged, attn[0]});
    b.slot(Slot::mlp_norm, {x1, n2[1]});
    b.slot(Slot::mlp_fc_in, {n2[0]});
    b.slot(Slot::mlp_act_in, {gate, up});
    b.slot(Slot::mlp_proj_in, {act});
    return b.finish(out);
  }

  struct Weights {
    at::Tensor embed, norm, lm_head;
    std::vector<std::vector<at::Tensor>> layers;  ///< per layer, the block graph's parameters
    std::vector<graph::Param> block_params;
    template <class F>
    void visit(F&& f) {
      f("model.embed_tokens.weight", embed);
      for (size_t l = 0; l < layers.size(); ++l) {
        for (size_t i = 0; i < block_params.size(); ++i) {
          f("model.layers." + std::to_string(l) + "." + block_params[i].name, layers[l][i]);
        }
      }
      f("model.norm.weight", norm);
      f("lm_head.weight", lm_head);
    }
    static Weights make(const ModelConfig& c, const at::TensorOptions& o, const std::vector<graph::Param>& bp) {
      const int64_t C = c.d_model;
      Weights w;
      w.embed = at::empty({c.vocab_size, C}, o);
      w.norm = at::empty({C}, o);
      w.lm_head = at::empty({c.vocab_size, C}, o);
      w.block_params = bp;
      w.layers.resize(static_cast<size_t>(c.n_layer));
      for (auto& layer : w.layers) {
        for (const auto& p : bp) layer.push_back(at::empty(p.sizes, o));
      }
      return w;
    }
  };

  struct EmbedSaved {
    EmbeddingSaved tok;
    std::vector<at::Tensor> tensors() const { return tok.tensors(); }
  };

  LlamaArch(const ModelConfig& c, at::Device device, at::ScalarType dtype)
      : c(c), rope(rope_tables(c.max_seq, c.head_dim(), c.rope_theta, dtype, device)) {}

  static const at::Tensor& head(const Weights& w) { return w.lm_head; }
  static at::Tensor& head(Weights& w) { return w.lm_head; }
  static bool hf_transposed(const std::string&) { return false; }
  static bool ignorable(const std::string& name) { return ends_with(name, ".rotary_emb.inv_freq"); }

  Fwd<EmbedSaved> embed_forward(const Weights& w, const at::Tensor& ids, const StepContext&, bool) const {
    auto tok = embedding_forward(ids, w.embed);
    return {tok.out, EmbedSaved{std::move(tok.saved)}};
  }
  void embed_backward(const at::Tensor& dy, EmbedSaved& s, const Weights&, Weights& g) const {
    embedding_backward(dy, s.tok, g.embed);
  }

  int64_t embed_bytes(int64_t B, int64_t T) const { return embedding_saved_bytes(B * T); }
  int64_t head_bytes(int64_t B, int64_t T, at::ScalarType f) const {
    return rmsnorm_saved_bytes(B * T, c.d_model, f) + cross_entropy_saved_bytes(B * T, c.d_model, f);
  }

  Fwd<RMSNormSaved> final_norm_forward(const Weights& w, const at::Tensor& x) const {
    return rmsnorm_forward(x, w.norm, c.norm_eps);
  }
  at::Tensor final_norm_backward(const at::Tensor& dy, const RMSNormSaved& s, const Weights& w, Weights& g) const {
    return rmsnorm_backward(dy, s, w.norm, g.norm);
  }

  // Forward FLOPs of one sequence outside the blocks: final norm, loss head.
  double outside_flops(int64_t T) const {
    return rmsnorm_flops(T, c.d_model) + cross_entropy_flops(T, c.d_model, c.vocab_size);
  }
  const RopeTables* tables() const { return &rope; }

  ModelConfig c;
  RopeTables rope;
};

}  // namespace

std::unique_ptr<Model> make_llama(const ModelConfig& cfg, at::Device device, at::ScalarType dtype, uint64_t seed) {
  return std::make_unique<TransformerModel<LlamaArch>>(cfg, device, dtype, seed);
}

graph::BlockGraph llama_block(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype) {
  return LlamaArch::block(cfg, batch, seq, dtype);
}

}  // namespace remat::detail
