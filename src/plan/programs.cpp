// The allocation programs of the GPT-2 and Llama blocks (see remat/cost.h).
//
// Each program mirrors src/model/{gpt2,llama}.cpp and the ops in src/ops statement by
// statement: a tensor is allocated where the code creates it and freed where its last
// reference dies (end of a full expression for temporaries, end of scope for locals).
// Two effects of LibTorch on CPU matter and are modelled: a binary op between a float
// tensor and a bool mask first copies the mask to float (TensorIterator promotes inputs
// by temporary copies on CPU), and non-contiguous head views are copied by reshape.
// tests/plan/cost_test.cpp holds these programs to the tracking allocator's measurements.
#include "remat/cost.h"
#include "remat/ops.h"

namespace remat::cost {
namespace {

using ops::nbytes;

class Program {
 public:
  explicit Program(std::vector<Event>& out) : ev_(out) {}
  void a(const std::string& name, int64_t bytes) { ev_.push_back({Event::Kind::alloc, name, bytes}); }
  void f(std::initializer_list<std::string> names) {
    for (const auto& n : names) ev_.push_back({Event::Kind::free, n, 0});
  }
  void need(std::initializer_list<std::string> slots) {
    for (const auto& s : slots) ev_.push_back({Event::Kind::need, s, 0});
  }

 private:
  std::vector<Event>& ev_;
};

// Sizes of one block at [B, T].
struct Sizes {
  int64_t D;      // [N, C] activation
  int64_t KV;     // [N, Hkv * head_dim] activation
  int64_t Df;     // [N, F] activation
  int64_t Sf;     // [B, Hq, T, T] scores in the compute dtype
  int64_t Sm;     // the same as a bool mask
  int64_t Sx;     // the same as float copy of that mask (the compute dtype)
  int64_t Dm;     // [N, C] bool mask
  int64_t Tm;     // [T, T] bool causal mask
  int64_t stats;  // one norm statistic per token
  double p;
};

Sizes sizes(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType f) {
  const int64_t N = B * T, S = B * c.n_head * T * T;
  Sizes s;
  s.D = nbytes(N * c.d_model, f);
  s.KV = nbytes(N * c.n_kv_head * c.head_dim(), f);
  s.Df = nbytes(N * c.d_ff, f);
  s.Sf = nbytes(S, f);
  s.Sm = nbytes(S, at::kBool);
  s.Sx = nbytes(S, f);
  s.Dm = nbytes(N * c.d_model, at::kBool);
  s.Tm = nbytes(T * T, at::kBool);
  s.stats = nbytes(N, ops::stats_dtype(f));
  s.p = c.dropout;
  return s;
}

// attention_forward from q, k, v (already live) to "attn.out".
void attention_forward_events(Program& P, const Sizes& s) {
  P.a("t.qrows", s.D);
  P.a("t.kcopy", s.KV);
  P.a("t.scores", s.Sf);
  P.f({"t.qrows", "t.kcopy"});
  P.a("t.future", s.Tm);
  P.a("probs", s.Sf);
  P.f({"t.scores"});
  if (s.p > 0) {
    P.a("amask", s.Sm);
    P.a("t.maskf", s.Sx);
    P.a("probs_d", s.Sf);
    P.f({"t.maskf"});
  }
  P.a("t.vcopy", s.KV);
  P.a("t.orows", s.D);
  P.f({"t.vcopy"});
  P.a("attn.out", s.D);
  P.f({"t.orows", "t.future"});
}

// attention_backward with the output gradient live, to "ag.dq", "ag.dk", "ag.dv".
void attention_backward_events(Program& P, const Sizes& s) {
  P.a("t.dout", s.D);
  P.a("t.dvrows", s.KV);
  P.a("t.vcopy", s.KV);
  P.a("t.dprobs", s.Sf);
  P.f({"t.vcopy"});
  if (s.p > 0) {
    P.a("t.maskf", s.Sx);
    P.f({"t.maskf"});
  }
  P.a("t.dscores", s.Sf);
  P.f({"t.dprobs"});
  P.a("t.qrows", s.D);
  P.a("t.dkrows", s.KV);
  P.f({"t.qrows"});
  P.a("t.kcopy", s.KV);
  P.a("t.dqrows", s.D);
  P.f({"t.kcopy"});
  P.a("ag.dq", s.D);
  P.a("ag.dk", s.KV);
  P.a("ag.dv", s.KV);
  P.f({"t.dout", "t.dvrows", "t.dscores", "t.dkrows", "t.dqrows"});
}

// dropout_forward of an [N, C] tensor: its mask (kept as `mask`) and output `out`.
void dropout_events(Program& P, const Sizes& s, const std::string& mask, const std::string& out) {
  P.a(mask, s.Dm);
  P.a("t.maskf", s.D);
  P.a(out, s.D);
  P.f({"t.maskf"});
}

double attention_node_flops(const ModelConfig& c, int64_t B, int64_t T) {
  return ops::attention_flops({B, T, c.n_head, c.n_kv_head, c.head_dim()}, c.dropout);
}

BlockProgram gpt2(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType f) {
  const Sizes s = sizes(c, B, T, f);
  const int64_t N = B * T, C = c.d_model, F = c.d_ff;
  const bool drop = s.p > 0;
  BlockProgram b;
  b.out_bytes = s.D;
  b.slots = {{"input", {{"x", s.D}}},
             {"attn.norm", {{"ln1.stats", 2 * s.stats}}},
             {"attn.qkv_in", {{"ln1.out", s.D}}},
             {"attn.qkv", {{"qkv.out", 3 * s.D}}},
             {"attn.probs", {{"probs", s.Sf}}},
             {"attn.dropout", drop ? std::vector<std::pair<std::string, int64_t>>{{"amask", s.Sm}, {"probs_d", s.Sf}}
                                   : std::vector<std::pair<std::string, int64_t>>{}},
             {"attn.proj_in", {{"attn.out", s.D}}},
             {"attn.resid", drop ? std::vector<std::pair<std::string, int64_t>>{{"d1.mask", s.Dm}}
                                 : std::vector<std::pair<std::string, int64_t>>{}},
             {"mlp.norm", {{"x1", s.D}, {"ln2.stats", 2 * s.stats}}},
             {"mlp.fc_in", {{"ln2.out", s.D}}},
             {"mlp.act_in", {{"fc.out", s.Df}}},
             {"mlp.proj_in", {{"act.out", s.Df}}},
             {"mlp.resid", drop ? std::vector<std::pair<std::string, int64_t>>{{"d2.mask", s.Dm}}
                                : std::vector<std::pair<std::string, int64_t>>{}}};

  const double ln = ops::layernorm_flops(N, C), drop_f = ops::dropout_flops(N * C, s.p);
  const double qkv_f = ops::linear_flops(N, C, 3 * C, true), proj_f = ops::linear_flops(N, C, C, true);
  const double fc_f = ops::linear_flops(N, C, F, true), mp_f = ops::linear_flops(N, F, C, true);
  const double attn_f = attention_node_flops(c, B, T), gelu_f = ops::gelu_flops(N * F);
  const double add_f = ops::residual_flops(N * C);
  b.forward_flops = 2 * ln + qkv_f + attn_f + proj_f + 2 * drop_f + 2 * add_f + fc_f + gelu_f + mp_f;
  b.backward_flops = 2 * (qkv_f + proj_f + fc_f + mp_f + attn_f) + 2 * ln + gelu_f + 2 * drop_f;
  b.forward_kinds = {"layernorm", "linear", "attention", "linear", "residual",
                     "layernorm", "linear", "gelu",      "linear", "residual"};
  if (drop) b.forward_kinds.insert(b.forward_kinds.end(), {"dropout", "dropout"});

  {
    Program P(b.forward);
    P.a("ln1.out", s.D);
    P.a("ln1.stats", 2 * s.stats);
    P.a("qkv.out", 3 * s.D);
    attention_forward_events(P, s);
    P.a("t.proj", s.D);
    if (drop) dropout_events(P, s, "d1.mask", "t.d1");
    P.a("x1", s.D);
    P.a("ln2.out", s.D);
    P.a("ln2.stats", 2 * s.stats);
    P.a("fc.out", s.Df);
    P.a("act.out", s.Df);
    P.a("t.mp", s.D);
    if (drop) dropout_events(P, s, "d2.mask", "t.d2");
    P.a("out", s.D);
    P.f({"t.proj", "t.mp"});
    if (drop) P.f({"t.d1", "t.d2"});
  }
  {
    Program P(b.backward);
    // d: the gradient flowing down; a dropout backward at p = 0 returns its input.
    P.need({"mlp.resid"});
    if (drop) {
      P.a("t.maskf", s.D);
      P.a("g.resid2", s.D);
      P.f({"t.maskf", "mlp.resid"});
    }
    P.need({"mlp.proj_in"});
    P.a("g.act", s.Df);
    P.f({"mlp.proj_in"});
    if (drop) P.f({"g.resid2"});
    P.need({"mlp.act_in"});
    P.a("g.fc", s.Df);
    P.f({"mlp.act_in", "g.act"});
    P.need({"mlp.fc_in"});
    P.a("g.ln2", s.D);
    P.f({"mlp.fc_in", "g.fc"});
    P.need({"mlp.norm"});
    P.a("t.lnb", s.D);
    P.a("dx1", s.D);
    P.f({"mlp.norm", "t.lnb"});
    P.need({"attn.resid"});
    if (drop) {
      P.a("t.maskf", s.D);
      P.a("g.resid1", s.D);
      P.f({"t.maskf", "attn.resid"});
    }
    P.f({"g.ln2"});
    P.need({"attn.proj_in"});
    P.a("g.proj", s.D);
    P.f({"attn.proj_in"});
    if (drop) P.f({"g.resid1"});
    P.need({"attn.qkv", "attn.probs", "attn.dropout"});
    attention_backward_events(P, s);
    P.f({"attn.qkv", "attn.probs", "attn.dropout"});
    P.a("dqkv", 3 * s.D);
    P.f({"ag.dq", "ag.dk", "ag.dv"});
    P.need({"attn.qkv_in"});
    P.a("g.qkv", s.D);
    P.f({"attn.qkv_in", "g.proj"});
    P.need({"attn.norm"});
    P.a("t.lnb", s.D);
    P.a("dx", s.D);
    P.f({"input", "attn.norm", "t.lnb", "g.qkv", "dqkv", "dx1"});
  }

  auto node = [&](std::string name, std::vector<std::string> in, std::vector<std::string> out, std::string only_if,
                  std::vector<std::string> kinds, double flops) -> std::vector<Event>& {
    b.nodes.push_back({std::move(name), std::move(in), std::move(out), std::move(only_if), std::move(kinds), flops, {},
                       false});
    return b.nodes.back().events;
  };
  {
    Program P(node("ln_1", {}, {"attn.norm", "attn.qkv_in"}, "", {"layernorm"}, ln));
    P.a("ln1.out", s.D);
    P.a("ln1.stats", 2 * s.stats);
  }
  Program(node("c_attn", {"attn.qkv_in"}, {"attn.qkv"}, "", {"linear"}, qkv_f)).a("qkv.out", 3 * s.D);
  {
    Program P(node("attention", {"attn.qkv"}, {"attn.probs", "attn.dropout", "attn.proj_in"}, "", {"attention"},
                   attn_f));
    attention_forward_events(P, s);
  }
  {
    Program P(node("attn_resid_mask", {}, {"attn.resid"}, "", drop ? std::vector<std::string>{"dropout"}
                                                                    : std::vector<std::string>{}, drop_f));
    if (drop) P.a("d1.mask", s.Dm);
    b.nodes.back().alternate = true;
  }
  {
    std::vector<std::string> kinds = {"linear", "residual", "layernorm"};
    if (drop) kinds.insert(kinds.begin() + 1, "dropout");
    Program P(node("attn_proj_ln_2", {"attn.proj_in"}, {"attn.resid", "mlp.norm", "mlp.fc_in"}, "mlp.norm", kinds,
                   proj_f + drop_f + add_f + ln));
    P.a("t.proj", s.D);
    if (drop) dropout_events(P, s, "d1.mask", "t.d1");
    P.a("x1", s.D);
    P.a("ln2.out", s.D);
    P.a("ln2.stats", 2 * s.stats);
  }
  {
    Program P(node("ln_2", {}, {"mlp.fc_in"}, "", {"layernorm"}, ln));
    P.a("ln2.out", s.D);
    P.a("ln2.stats", 2 * s.stats);
    b.nodes.back().alternate = true;
  }
  Program(node("c_fc", {"mlp.fc_in"}, {"mlp.act_in"}, "", {"linear"}, fc_f)).a("fc.out", s.Df);
  Program(node("gelu", {"mlp.act_in"}, {"mlp.proj_in"}, "", {"gelu"}, gelu_f)).a("act.out", s.Df);
  {
    Program P(node("mlp_resid_mask", {}, {"mlp.resid"}, "", drop ? std::vector<std::string>{"dropout"}
                                                                   : std::vector<std::string>{}, drop_f));
    if (drop) P.a("d2.mask", s.Dm);
    b.nodes.back().alternate = true;
  }
  {
    // The block's last ops feed no slot; only a whole-block re-run executes them.
    std::vector<std::string> kinds = {"linear", "residual"};
    if (drop) kinds.insert(kinds.begin() + 1, "dropout");
    Program P(node("c_proj_out", {}, {}, "", kinds, mp_f + drop_f + add_f));
    P.a("t.mp", s.D);
    if (drop) dropout_events(P, s, "d2.mask", "t.d2");
    P.a("out", s.D);
  }
  return b;
}

BlockProgram llama(const ModelConfig& c, int64_t B, int64_t T, at::ScalarType f) {
  const Sizes s = sizes(c, B, T, f);
  const int64_t N = B * T, C = c.d_model, F = c.d_ff, KVc = c.n_kv_head * c.head_dim();
  BlockProgram b;
  b.out_bytes = s.D;
  using Ts = std::vector<std::pair<std::string, int64_t>>;
  b.slots = {{"input", {{"x", s.D}}},
             {"attn.norm", {{"ln1.stats", s.stats}}},
             {"attn.qkv_in", {{"n1.out", s.D}}},
             {"attn.qkv", {{"qr", s.D}, {"kr", s.KV}, {"v.out", s.KV}}},
             {"attn.probs", {{"probs", s.Sf}}},
             {"attn.dropout", s.p > 0 ? Ts{{"amask", s.Sm}, {"probs_d", s.Sf}} : Ts{}},
             {"attn.proj_in", {{"attn.out", s.D}}},
             {"attn.resid", {}},
             {"mlp.norm", {{"x1", s.D}, {"ln2.stats", s.stats}}},
             {"mlp.fc_in", {{"n2.out", s.D}}},
             {"mlp.act_in", {{"gate", s.Df}, {"up", s.Df}}},
             {"mlp.proj_in", {{"act.out", s.Df}}},
             {"mlp.resid", {}}};

  const double rms = ops::rmsnorm_flops(N, C), add_f = ops::residual_flops(N * C);
  const double qkv_f = ops::linear_flops(N, C, C, false) + 2 * ops::linear_flops(N, C, KVc, false) +
                       ops::rope_flops(N * (C + KVc));
  const double attn_f = attention_node_flops(c, B, T), o_f = ops::linear_flops(N, C, C, false);
  const double gu_f = 2 * ops::linear_flops(N, C, F, false), act_f = ops::swiglu_flops(N * F);
  const double down_f = ops::linear_flops(N, F, C, false);
  b.forward_flops = 2 * rms + qkv_f + attn_f + o_f + 2 * add_f + gu_f + act_f + down_f;
  b.backward_flops = 2 * (qkv_f + attn_f + o_f + gu_f + down_f) + 2 * rms + act_f;
  b.forward_kinds = {"rmsnorm", "linear", "linear", "linear", "rope",   "rope",   "attention", "linear",
                     "residual", "rmsnorm", "linear", "linear", "swiglu", "linear", "residual"};

  auto rmsnorm_fwd = [&](Program& P, const std::string& stats, const std::string& out) {
    P.a(stats, s.stats);
    P.a(out, s.D);
  };
  // rmsnorm_backward with its output gradient live, to "t.rms" (x-hat, reused in place).
  auto rmsnorm_bwd = [&](Program& P) {
    P.a("t.rms", s.D);
    P.a("t.prod", s.D);
    P.f({"t.prod"});
    P.a("t.g", s.D);
    P.a("t.prod", s.D);
    P.f({"t.prod"});
    P.f({"t.g"});
  };
  {
    Program P(b.forward);
    rmsnorm_fwd(P, "ln1.stats", "n1.out");
    P.a("t.q", s.D);
    P.a("t.k", s.KV);
    P.a("v.out", s.KV);
    P.a("qr", s.D);
    P.a("kr", s.KV);
    attention_forward_events(P, s);
    P.a("t.o", s.D);
    P.a("x1", s.D);
    rmsnorm_fwd(P, "ln2.stats", "n2.out");
    P.a("gate", s.Df);
    P.a("up", s.Df);
    P.a("act.out", s.Df);
    P.a("t.down", s.D);
    P.a("out", s.D);
    P.f({"t.q", "t.k", "t.o", "t.down"});
  }
  {
    Program P(b.backward);
    P.need({"mlp.proj_in"});
    P.a("g.down", s.Df);
    P.f({"mlp.proj_in"});
    P.need({"mlp.act_in"});
    P.a("t.m", s.Df);
    P.a("g.gate", s.Df);
    P.f({"t.m"});
    P.a("g.up", s.Df);
    P.f({"mlp.act_in"});
    // The gate/up input stays referenced by a local until the block's backward returns.
    P.need({"mlp.fc_in"});
    P.a("t.a", s.D);
    P.a("t.b", s.D);
    P.a("g.fc", s.D);
    P.f({"t.a", "t.b", "g.down", "g.gate", "g.up"});
    P.need({"mlp.norm"});
    rmsnorm_bwd(P);
    P.a("dx1", s.D);
    P.f({"t.rms", "mlp.norm"});
    P.need({"attn.proj_in"});
    P.a("g.o", s.D);
    P.f({"attn.proj_in", "g.fc"});
    P.need({"attn.qkv", "attn.probs", "attn.dropout"});
    attention_backward_events(P, s);
    P.f({"attn.qkv", "attn.probs", "attn.dropout"});
    P.a("g.q", s.D);
    P.a("g.k", s.KV);
    P.f({"ag.dq", "ag.dk"});
    P.need({"attn.qkv_in"});
    P.a("t.a", s.D);
    P.a("t.b", s.D);
    P.a("t.ab", s.D);
    P.a("t.c", s.D);
    P.a("g.qkv", s.D);
    P.f({"t.a", "t.b", "t.ab", "t.c", "g.o"});
    P.need({"attn.norm"});
    rmsnorm_bwd(P);
    P.a("dx", s.D);
    P.f({"input", "attn.norm", "t.rms", "g.qkv", "g.q", "g.k", "ag.dv", "dx1", "mlp.fc_in", "attn.qkv_in"});
  }

  auto node = [&](std::string name, std::vector<std::string> in, std::vector<std::string> out, std::string only_if,
                  std::vector<std::string> kinds, double flops) -> std::vector<Event>& {
    b.nodes.push_back({std::move(name), std::move(in), std::move(out), std::move(only_if), std::move(kinds), flops, {},
                       false});
    return b.nodes.back().events;
  };
  {
    Program P(node("input_layernorm", {}, {"attn.norm", "attn.qkv_in"}, "", {"rmsnorm"}, rms));
    rmsnorm_fwd(P, "ln1.stats", "n1.out");
  }
  {
    Program P(node("qkv_rope", {"attn.qkv_in"}, {"attn.qkv"}, "", {"linear", "linear", "linear", "rope", "rope"},
                   qkv_f));
    P.a("t.q", s.D);
    P.a("t.k", s.KV);
    P.a("v.out", s.KV);
    P.a("qr", s.D);
    P.a("kr", s.KV);
  }
  {
    Program P(node("attention", {"attn.qkv"}, {"attn.probs", "attn.dropout", "attn.proj_in"}, "", {"attention"},
                   attn_f));
    attention_forward_events(P, s);
  }
  {
    Program P(node("o_proj_post_layernorm", {"attn.proj_in"}, {"mlp.norm", "mlp.fc_in"}, "mlp.norm",
                   {"linear", "residual", "rmsnorm"}, o_f + add_f + rms));
    P.a("t.o", s.D);
    P.a("x1", s.D);
    rmsnorm_fwd(P, "ln2.stats", "n2.out");
  }
  {
    Program P(node("post_attention_layernorm", {}, {"mlp.fc_in"}, "", {"rmsnorm"}, rms));
    rmsnorm_fwd(P, "ln2.stats", "n2.out");
    b.nodes.back().alternate = true;
  }
  {
    Program P(node("gate_up_proj", {"mlp.fc_in"}, {"mlp.act_in"}, "", {"linear", "linear"}, gu_f));
    P.a("gate", s.Df);
    P.a("up", s.Df);
  }
  Program(node("swiglu", {"mlp.act_in"}, {"mlp.proj_in"}, "", {"swiglu"}, act_f)).a("act.out", s.Df);
  // Llama has no residual dropout: its two residual slots hold nothing and need no op.
  node("no_resid_dropout", {}, {"attn.resid", "mlp.resid"}, "", {}, 0.0);
  {
    Program P(node("down_proj_out", {}, {}, "", {"linear", "residual"}, down_f + add_f));
    P.a("t.down", s.D);
    P.a("out", s.D);
  }
  return b;
}

}  // namespace

int64_t BlockProgram::slot_bytes(const std::string& slot) const {
  int64_t total = 0;
  for (const auto& [name, bytes] : slots.at(slot)) total += bytes;
  return total;
}

BlockProgram block_program(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype) {
  if (cfg.arch == "gpt2") return gpt2(cfg, batch, seq, dtype);
  if (cfg.arch == "llama") return llama(cfg, batch, seq, dtype);
  TORCH_CHECK(false, "Unknown model.arch \"", cfg.arch, "\"; use gpt2 or llama.");
}

}  // namespace remat::cost
