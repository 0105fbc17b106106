// GPT-2: pre-LN blocks, learned positions, GELU MLP, tied head, dropout on embeddings,
// attention probabilities and both residual branches.
#include "model/transformer.h"


namespace remat::detail {
namespace {

using namespace remat::ops;

struct Gpt2Arch {
  // One block, in the order of its forward. Parameters are declared in Hugging Face order.
  static graph::BlockGraph block(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype) {
    using namespace graph;
    const int64_t C = c.d_model, F = c.d_ff, H = c.n_head, D = c.head_dim();
    const double p = c.dropout;
    Builder b({{B, T, C}, dtype, {}});
    const int ln1_w = b.param("ln_1.weight", {C}), ln1_b = b.param("ln_1.bias", {C});
    const int qkv_w = b.param("attn.c_attn.weight", {3 * C, C}), qkv_b = b.param("attn.c_attn.bias", {3 * C});
    const int proj_w = b.param("attn.c_proj.weight", {C, C}), proj_b = b.param("attn.c_proj.bias", {C});
    const int ln2_w = b.param("ln_2.weight", {C}), ln2_b = b.param("ln_2.bias", {C});
    const int fc_w = b.param("mlp.c_fc.weight", {F, C}), fc_b = b.param("mlp.c_fc.bias", {F});
    const int mp_w = b.param("mlp.c_proj.weight", {C, F}), mp_b = b.param("mlp.c_proj.bias", {C});
    Attrs norm, heads, core;
    norm.eps = c.norm_eps;
    heads.split_heads = {H, H, H};
    heads.head_dim = D;
    core.p = p;
    core.site = ops::DropoutSite::attn_probs;
    core.tiles = {c.attention_tile, c.attention_tile};

    const auto ln1 = b.add("ln_1", op::layernorm(), {b.input()}, {ln1_w, ln1_b}, norm);
    const int qkv = b.add1("c_attn", op::linear(), {ln1[0]}, {qkv_w, qkv_b});
    const auto q_k_v = b.add("qkv_heads", op::split(), {qkv}, {}, heads);
    const auto attn = b.add("attention", op::attention(c.attention), q_k_v, {}, core);
    const int merged = b.view("attn_merge", attn[0], {B, T, C});
    const int proj = b.add1("attn_c_proj", op::linear(), {merged}, {proj_w, proj_b});
    const auto [d1, mask1] = b.dropout("attn_resid_dropout", proj, p, ops::DropoutSite::attn_resid);
    const int x1 = b.add1("attn_residual", op::residual(), {b.input(), d1});
    const auto ln2 = b.add("ln_2", op::layernorm(), {x1}, {ln2_w, ln2_b}, norm);
    const int fc = b.add1("c_fc", op::linear(), {ln2[0]}, {fc_w, fc_b});
    const int act = b.add1("gelu", op::gelu(), {fc});
    const int mp = b.add1("mlp_c_proj", op::linear(), {act}, {mp_w, mp_b});
    const auto [d2, mask2] = b.dropout("mlp_resid_dropout", mp, p, ops::DropoutSite::mlp_resid);
    const int out = b.add1("mlp_residual", op::residual(), {x1, d2});

    const auto some = [](int v) { return v >= 0 ? std::vector<int>{v} : std::vector<int>{}; };
    b.slot(Slot::input, {b.input()});
    b.slot(Slot::attn_norm, {ln1[1], ln1[2]});
    b.slot(Slot::attn_qkv_in, {ln1[0]});
    b.slot(Slot::attn_qkv, q_k_v);
    b.slot(Slot::attn_probs, {attn[1]});
    b.slot(Slot::attn_dropout, {attn.begin() + 2, attn.end()});
    b.slot(Slot::attn_proj_in, {merged, attn[0]});
    b.slot(Slot::attn_resid, some(mask1));
    b.slot(Slot::mlp_norm, {x1, ln2[1], ln2[2]});
    b.slot(Slot::mlp_fc_in, {ln2[0]});
    b.slot(Slot::mlp_act_in, {fc});
    b.slot(Slot::mlp_proj_in, {act});
    b.slot(Slot::mlp_resid, some(mask2));
    return b.finish(out);
  }

  struct Weights {
    at::Tensor wte, wpe, lnf_w, lnf_b;
    std::vector<std::vector<at::Tensor>> layers;  ///< per layer, the block graph's parameters
    std::vector<graph::Param> block_params;
    template <class F>
    void visit(F&& f) {
      f("wte.weight", wte);
      f("wpe.weight", wpe);
      for (size_t l = 0; l < layers.size(); ++l) {
        for (size_t i = 0; i < block_params.size(); ++i) {
          f("h." + std::to_string(l) + "." + block_params[i].name, layers[l][i]);
        }
      }
      f("ln_f.weight", lnf_w);
      f("ln_f.bias", lnf_b);
    }
    // Linear weights are [out, in] here; Hugging Face's Conv1D files hold them [in, out].
    static Weights make(const ModelConfig& c, const at::TensorOptions& o, const std::vector<graph::Param>& bp) {
      const int64_t C = c.d_model;
      Weights w;
      w.wte = at::empty({c.vocab_size, C}, o);
      w.wpe = at::empty({c.max_seq, C}, o);
      w.lnf_w = at::empty({C}, o);
      w.lnf_b = at::empty({C}, o);
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
    PositionEmbeddingSaved pos;
    DropoutSaved drop;
    std::vector<at::Tensor> tensors() const { return concat({tok.tensors(), pos.tensors(), drop.tensors()}); }
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

  int64_t embed_bytes(int64_t B, int64_t T) const {
    return embedding_saved_bytes(B * T) + dropout_saved_bytes(B * T * c.d_model, c.dropout);
  }
  int64_t head_bytes(int64_t B, int64_t T, at::ScalarType f) const {
    return layernorm_saved_bytes(B * T, c.d_model, f) + cross_entropy_saved_bytes(B * T, c.d_model, f);
  }

  Fwd<LayerNormSaved> final_norm_forward(const Weights& w, const at::Tensor& x) const {
    return layernorm_forward(x, w.lnf_w, w.lnf_b, c.norm_eps);
  }
  at::Tensor final_norm_backward(const at::Tensor& dy, const LayerNormSaved& s, const Weights& w, Weights& g) const {
    return layernorm_backward(dy, s, w.lnf_w, g.lnf_w, g.lnf_b);
  }

  // Forward FLOPs of one sequence outside the blocks: embedding dropout, final norm, loss head.
  double outside_flops(int64_t T) const {
    return dropout_flops(T * c.d_model, c.dropout) + layernorm_flops(T, c.d_model) +
           cross_entropy_flops(T, c.d_model, c.vocab_size);
  }
  const RopeTables* tables() const { return nullptr; }

  ModelConfig c;
};

}  // namespace

std::unique_ptr<Model> make_gpt2(const ModelConfig& cfg, at::Device device, at::ScalarType dtype, uint64_t seed) {
  return std::make_unique<TransformerModel<Gpt2Arch>>(cfg, device, dtype, seed);
}

graph::BlockGraph gpt2_block(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype) {
  return Gpt2Arch::block(cfg, batch, seq, dtype);
}

}  // namespace remat::detail
