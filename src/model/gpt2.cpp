// GPT-2: pre-LN blocks, learned positions, GELU MLP, a tied head (or its own), dropout on embeddings,
// attention probabilities and both residual branches.
#include "model/transformer.h"

namespace remat::detail {
namespace {

struct Gpt2Arch {
  // One block, in the order of its forward. Parameters are declared in Hugging Face order.
  static graph::BlockGraph block(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype) {
    using namespace graph;
    const int64_t C = c.d_model, F = c.d_ff, H = c.n_head, D = c.head_dim();
    const double p = c.dropout;
    Builder b({{B, T, C}, dtype, {}}, dtype);
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

  // Token rows plus learned positions, then dropout.
  static graph::BlockGraph embed(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype) {
    using namespace graph;
    Builder b({{B, T}, at::kLong, {}}, dtype, /*external=*/true);
    const int wte = b.param("wte.weight", {c.vocab_size, c.d_model}),
              wpe = b.param("wpe.weight", {c.max_seq, c.d_model});
    const int tok = b.add1("wte", op::embedding(), {b.input()}, {wte});
    const int pos = b.add1("wpe", op::position_embedding(), {tok}, {wpe});
    return b.finish_kept(b.dropout("embed_dropout", pos, c.dropout, ops::DropoutSite::embedding).first);
  }

  // The final LayerNorm, then the loss through the token embedding where tied (the same name
  // makes it the same parameter), else through lm_head.weight.
  static graph::BlockGraph head(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype, int64_t chunk) {
    using namespace graph;
    const int64_t C = c.d_model;
    Builder b({{B, T, C}, dtype, {}}, dtype);
    const int w = b.param("ln_f.weight", {C}), bias = b.param("ln_f.bias", {C});
    Attrs norm;
    norm.eps = c.norm_eps;
    const int h = b.add("ln_f", op::layernorm(), {b.input()}, {w, bias}, norm)[0];
    if (chunk == 0) return b.finish_kept(h);
    const char* head = c.tie_embeddings ? "wte.weight" : "lm_head.weight";
    return b.finish_kept(b.loss(h, b.param(head, {c.vocab_size, C}), chunk, c.loss_head));
  }

  static bool hf_transposed(const std::string& name) {
    return ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
           ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight");
  }

  // Causal-mask buffers of older checkpoints, and the tied head's copy.
  static bool ignorable(const ModelConfig& c, const std::string& name) {
    return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
           (c.tie_embeddings && name == "lm_head.weight");
  }
};

}  // namespace

const ArchDecl& gpt2_decl() {
  static const ArchDecl decl{Gpt2Arch::embed,
                             Gpt2Arch::block,
                             Gpt2Arch::head,
                             "h.",
                             Gpt2Arch::hf_transposed,
                             Gpt2Arch::ignorable,
                             {{"c_attn", "c_fc"}, {"attn_c_proj", "mlp_c_proj"}, {"wte", "loss"}}};
  return decl;
}

}  // namespace remat::detail
