#include "model/reference.h"

#include "remat/ops/dropout.h"

#include <cmath>

namespace remat::testing {
namespace {

using ops::DropoutSite;

at::Tensor dropout(const at::Tensor& x, double p, const StepContext& ctx, int64_t layer, DropoutSite site) {
  if (p == 0.0) return x;
  ops::DropoutKey key{ctx.seed, ctx.step, ctx.microbatch, static_cast<uint64_t>(layer), site};
  at::Tensor mask = ops::dropout_mask(x.sizes(), p, key, x.device());
  return x * mask.to(x.scalar_type()) / (1.0 - p);
}

at::Tensor layernorm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  at::Tensor mean = x.mean(-1, true);
  at::Tensor var = (x - mean).pow(2).mean(-1, true);
  return (x - mean) / at::sqrt(var + eps) * w + b;
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x / at::sqrt(x.pow(2).mean(-1, true) + eps) * w;
}

// q [B, Hq, T, D], k/v [B, Hq, T, D] (already repeated for GQA).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double p,
                            const StepContext& ctx, int64_t layer) {
  const int64_t T = q.size(2), D = q.size(3);
  at::Tensor s = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(D));
  at::Tensor future = at::ones({T, T}, at::kBool).triu(1);
  s = s.masked_fill(future, -std::numeric_limits<double>::infinity());
  at::Tensor e = at::exp(s - std::get<0>(s.max(-1, true)).detach());
  at::Tensor probs = e / e.sum(-1, true);
  return at::matmul(dropout(probs, p, ctx, layer, DropoutSite::attn_probs), v);
}

at::Tensor mean_cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  at::Tensor flat = logits.reshape({-1, logits.size(-1)});
  at::Tensor t = targets.reshape({-1});
  at::Tensor valid = t.ne(-1);
  at::Tensor logp = flat - at::logsumexp(flat, -1, true);
  at::Tensor picked = logp.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1);
  return -(picked * valid.to(picked.scalar_type())).sum() / valid.sum().to(picked.scalar_type());
}

at::Tensor gpt2_loss(const ModelConfig& c, const std::map<std::string, at::Tensor>& P, const at::Tensor& tokens,
                     const at::Tensor& targets, const StepContext& ctx) {
  const int64_t B = tokens.size(0), T = tokens.size(1), C = c.d_model, H = c.n_head, D = c.head_dim();
  auto p = [&](const std::string& n) { return P.at(n); };
  at::Tensor x =
      p("wte.weight").index_select(0, tokens.reshape({-1})).view({B, T, C}) + p("wpe.weight").narrow(0, 0, T);
  x = dropout(x, c.dropout, ctx, 0, DropoutSite::embedding);
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string pre = "h." + std::to_string(l) + ".";
    at::Tensor h = layernorm(x, p(pre + "ln_1.weight"), p(pre + "ln_1.bias"), c.norm_eps);
    at::Tensor qkv = at::matmul(h, p(pre + "attn.c_attn.weight").t()) + p(pre + "attn.c_attn.bias");
    auto heads = [&](int64_t i) { return qkv.narrow(-1, i * C, C).reshape({B, T, H, D}).transpose(1, 2); };
    at::Tensor a = causal_attention(heads(0), heads(1), heads(2), c.dropout, ctx, l).transpose(1, 2).reshape({B, T, C});
    a = at::matmul(a, p(pre + "attn.c_proj.weight").t()) + p(pre + "attn.c_proj.bias");
    x = x + dropout(a, c.dropout, ctx, l, DropoutSite::attn_resid);
    h = layernorm(x, p(pre + "ln_2.weight"), p(pre + "ln_2.bias"), c.norm_eps);
    at::Tensor f = at::matmul(h, p(pre + "mlp.c_fc.weight").t()) + p(pre + "mlp.c_fc.bias");
    at::Tensor g = 0.5 * f * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (f + 0.044715 * f.pow(3))));
    at::Tensor m = at::matmul(g, p(pre + "mlp.c_proj.weight").t()) + p(pre + "mlp.c_proj.bias");
    x = x + dropout(m, c.dropout, ctx, l, DropoutSite::mlp_resid);
  }
  x = layernorm(x, p("ln_f.weight"), p("ln_f.bias"), c.norm_eps);
  return mean_cross_entropy(at::matmul(x, p("wte.weight").t()), targets);
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  // Pairs (i, i + D/2) rotate by the same angle.
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

at::Tensor llama_loss(const ModelConfig& c, const std::map<std::string, at::Tensor>& P, const at::Tensor& tokens,
                      const at::Tensor& targets, const StepContext& ctx) {
  const int64_t B = tokens.size(0), T = tokens.size(1), C = c.d_model, Hq = c.n_head, Hkv = c.n_kv_head;
  const int64_t D = c.head_dim(), G = Hq / Hkv;
  auto p = [&](const std::string& n) { return P.at(n); };
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor inv_freq = at::pow(c.rope_theta, -at::arange(0, D / 2, f64) * 2.0 / static_cast<double>(D));
  at::Tensor angle = at::arange(0, T, f64).unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, D/2]
  at::Tensor cos = angle.cos().view({1, T, 1, D / 2}), sin = angle.sin().view({1, T, 1, D / 2});

  at::Tensor x = p("model.embed_tokens.weight").index_select(0, tokens.reshape({-1})).view({B, T, C});
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    at::Tensor h = rmsnorm(x, p(pre + "input_layernorm.weight"), c.norm_eps);
    at::Tensor q = rotate(at::matmul(h, p(pre + "self_attn.q_proj.weight").t()).view({B, T, Hq, D}), cos, sin);
    at::Tensor k = rotate(at::matmul(h, p(pre + "self_attn.k_proj.weight").t()).view({B, T, Hkv, D}), cos, sin);
    at::Tensor v = at::matmul(h, p(pre + "self_attn.v_proj.weight").t()).view({B, T, Hkv, D});
    // Query head i reads key/value head i / G.
    k = k.repeat_interleave(G, 2);
    v = v.repeat_interleave(G, 2);
    at::Tensor a = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), c.dropout, ctx, l);
    a = a.transpose(1, 2).reshape({B, T, C});
    x = x + at::matmul(a, p(pre + "self_attn.o_proj.weight").t());
    h = rmsnorm(x, p(pre + "post_attention_layernorm.weight"), c.norm_eps);
    at::Tensor gate = at::matmul(h, p(pre + "mlp.gate_proj.weight").t());
    at::Tensor up = at::matmul(h, p(pre + "mlp.up_proj.weight").t());
    at::Tensor act = gate * at::sigmoid(gate) * up;
    x = x + at::matmul(act, p(pre + "mlp.down_proj.weight").t());
  }
  x = rmsnorm(x, p("model.norm.weight"), c.norm_eps);
  return mean_cross_entropy(at::matmul(x, p("lm_head.weight").t()), targets);
}

}  // namespace

at::Tensor reference_loss(const ModelConfig& cfg, const std::map<std::string, at::Tensor>& params,
                          const at::Tensor& tokens, const at::Tensor& targets, const StepContext& ctx) {
  return cfg.arch == Arch::gpt2 ? gpt2_loss(cfg, params, tokens, targets, ctx)
                                : llama_loss(cfg, params, tokens, targets, ctx);
}

}  // namespace remat::testing
