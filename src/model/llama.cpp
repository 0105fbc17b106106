// Llama: RMSNorm, rotary positions, grouped-query attention, fused SwiGLU MLP, a head of
// its own or the embedding's (model.tie_embeddings); dropout (model.dropout) on the
// attention probabilities only.
#include "model/transformer.h"

namespace remat::detail {
namespace {

struct LlamaArch {
  // One block, in the order of its forward. Parameters are declared in Hugging Face order.
  static graph::BlockGraph block(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype) {
    using namespace graph;
    const int64_t C = c.d_model, F = c.d_ff, Hq = c.n_head, Hkv = c.n_kv_head, D = c.head_dim(), KV = Hkv * D;
    Builder b({{B, T, C}, dtype, {}}, dtype);
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
    // One node for the three projections of one input: its backward sums their input
    // gradients in one tensor (and the MLP's two below).
    const auto qkv = b.add("qkv_proj", op::linears(), {n1[0]}, {wq, wk, wv});
    const int q = qkv[0], k = qkv[1], v = qkv[2];
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
    const auto gate_up = b.add("gate_up_proj", op::linears(), {n2[0]}, {w_gate, w_up});
    const int gate = gate_up[0], up = gate_up[1];
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

  // Token rows; positions are rotations inside each block.
  static graph::BlockGraph embed(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype) {
    using namespace graph;
    Builder b({{B, T}, at::kLong, {}}, dtype, /*external=*/true);
    const int w = b.param("model.embed_tokens.weight", {c.vocab_size, c.d_model});
    return b.finish_kept(b.add1("embed_tokens", op::embedding(), {b.input()}, {w}));
  }

  // The final RMSNorm, then the loss through the output projection: lm_head.weight, or the
  // embedding's matrix where tied (the same name makes it the same parameter).
  static graph::BlockGraph head(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType dtype, int64_t chunk) {
    using namespace graph;
    const int64_t C = c.d_model;
    Builder b({{B, T, C}, dtype, {}}, dtype);
    const int w = b.param("model.norm.weight", {C});
    Attrs norm;
    norm.eps = c.norm_eps;
    const int h = b.add("norm", op::rmsnorm(), {b.input()}, {w}, norm)[0];
    if (chunk == 0) return b.finish_kept(h);
    const char* head = c.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    return b.finish_kept(b.loss(h, b.param(head, {c.vocab_size, C}), chunk, c.loss_head));
  }

  static bool hf_transposed(const std::string&) { return false; }
  // A tied model's file may still carry the head's copy; transformers ties it on load too.
  static bool ignorable(const ModelConfig& c, const std::string& name) {
    return ends_with(name, ".rotary_emb.inv_freq") || (c.tie_embeddings && name == "lm_head.weight");
  }
};

}  // namespace

const ArchDecl& llama_decl() {
  static const ArchDecl decl{LlamaArch::embed,
                             LlamaArch::block,
                             LlamaArch::head,
                             "model.layers.",
                             LlamaArch::hf_transposed,
                             LlamaArch::ignorable,
                             {{"qkv_proj", "gate_up_proj"}, {"o_proj", "down_proj"}, {"embed_tokens", "loss"}}};
  return decl;
}

}  // namespace remat::detail
