#include "remat/ops/attention.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <cmath>
#include <limits>

namespace remat::ops {
namespace {

// Softmax cost per score: max, subtract, exp, sum, divide.
constexpr double kSoftmaxFlopsPerScore = 5.0;

struct Dims {
  int64_t B, T, Hq, Hkv, D, G;  // G = query heads per key/value head
};

Dims check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "[attention] q, k and v must be [B, T, heads, head_dim], got q ", q.sizes(), ", k ",
              k.sizes(), " and v ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "[attention] k and v must have the same shape, got k ", k.sizes(),
              " and v ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "[attention] q [B, T, Hq, D] and k, v [B, T, Hkv, D] must agree on B, T and D, got q ",
              q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0,
              "[attention] query heads must be a multiple of key/value heads, got q ", q.sizes(),
              " and k ", k.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "[attention] q, k and v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(),
              " and ", v.scalar_type());
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), q.size(2) / k.size(2)};
}

// [B, T, Hq, D] viewed as [B, Hkv, G, T, D]: the G query heads of each key/value group
// stacked along rows, so one batched matmul against that group's K and V serves them all
// without repeating K or V.
at::Tensor grouped_view(const at::Tensor& x, const Dims& d) {
  return x.reshape({d.B, d.T, d.Hkv, d.G, d.D}).permute({0, 2, 3, 1, 4});
}

// scale * x for x [B, T, Hq, D], as a contiguous [B*Hkv, G*T, D] (one pass: copy and scale).
at::Tensor grouped_rows(const at::Tensor& x, const Dims& d, double scale) {
  at::Tensor rows = at::empty({d.B, d.Hkv, d.G, d.T, d.D}, x.options());
  at::mul_out(rows, grouped_view(x, d), at::scalar_tensor(scale, at::kDouble));
  return rows.view({d.B * d.Hkv, d.G * d.T, d.D});
}

// scale * rows for rows [B*Hkv, G*T, D], back in the [B, T, Hq, D] layout.
at::Tensor ungrouped(const at::Tensor& rows, const Dims& d, double scale) {
  at::Tensor x = at::empty({d.B, d.T, d.Hq, d.D}, rows.options());
  at::Tensor x_grouped = grouped_view(x, d);  // a view: x is contiguous
  at::mul_out(x_grouped, rows.view({d.B, d.Hkv, d.G, d.T, d.D}), at::scalar_tensor(scale, at::kDouble));
  return x;
}

// [B, T, Hkv, D] -> [B*Hkv, T, D] (a copy unless the layout already allows a view).
at::Tensor heads_first(const at::Tensor& x, const Dims& d) {
  return x.transpose(1, 2).reshape({d.B * d.Hkv, d.T, d.D});
}

// The inverse of heads_first, contiguous.
at::Tensor heads_last(const at::Tensor& rows, const Dims& d) {
  return rows.view({d.B, d.Hkv, d.T, d.D}).transpose(1, 2).contiguous();
}

}  // namespace

Fwd<AttentionSaved> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      double p, const DropoutKey& key) {
  const trace::Scope trace_scope("attention", trace::Category::forward);
  const Dims d = check_inputs(q, k, v);
  // The 1/sqrt(D) scale is folded into the copy of q the matmul needs anyway.
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
  at::Tensor scores = at::bmm(grouped_rows(q, d, scale), heads_first(k, d).transpose(1, 2));
  const at::Tensor future = at::ones({d.T, d.T}, q.options().dtype(at::kBool)).triu_(1);
  scores.view({d.B * d.Hq, d.T, d.T}).masked_fill_(future, -std::numeric_limits<double>::infinity());
  at::Tensor probs = at::_softmax(scores, -1, false).view({d.B, d.Hq, d.T, d.T});
  scores = at::Tensor();  // the scores are not kept: release them before dropout allocates
  Fwd<DropoutSaved> drop = dropout_forward(probs, p, key);
  at::Tensor out_rows = at::bmm(drop.out.view({d.B * d.Hkv, d.G * d.T, d.T}), heads_first(v, d));
  at::Tensor probs_d = p > 0.0 ? drop.out : at::Tensor();
  return {ungrouped(out_rows, d, 1.0), AttentionSaved{q, k, v, probs, drop.saved.mask, probs_d, p}};
}

AttentionGrads attention_backward(const at::Tensor& dout, const AttentionSaved& saved) {
  const trace::Scope trace_scope("attention", trace::Category::backward);
  const Dims d = check_inputs(saved.q, saved.k, saved.v);
  TORCH_CHECK(dout.sizes() == saved.q.sizes(), "[attention] output gradient must match q's shape ",
              saved.q.sizes(), ", got ", dout.sizes());
  TORCH_CHECK(saved.p == 0.0 || (saved.mask.defined() && saved.probs_d.defined()),
              "[attention] dropout p=", saved.p, " needs the saved mask and probs_d");
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
  const std::vector<int64_t> score_rows{d.B * d.Hkv, d.G * d.T, d.T};
  const at::Tensor probs = saved.probs.view(score_rows);
  const at::Tensor probs_d = saved.p > 0.0 ? saved.probs_d.view(score_rows) : probs;
  const at::Tensor dout_rows = grouped_rows(dout, d, 1.0);

  // Each kv group's rows hold all its query heads, so these products already sum dk and dv
  // over the group.
  at::Tensor dv_rows = at::bmm(probs_d.transpose(1, 2), dout_rows);
  at::Tensor dprobs = at::bmm(dout_rows, heads_first(saved.v, d).transpose(1, 2));
  if (saved.p > 0.0) dprobs.mul_(saved.mask.view(score_rows)).mul_(1.0 / (1.0 - saved.p));
  at::Tensor dscores = at::_softmax_backward_data(dprobs, probs, -1, probs.scalar_type());
  dprobs = at::Tensor();
  // scores = (scale q) k^T, so dk = dscores^T (scale q) and dq = scale (dscores k).
  at::Tensor dk_rows = at::bmm(dscores.transpose(1, 2), grouped_rows(saved.q, d, scale));
  at::Tensor dq_rows = at::bmm(dscores, heads_first(saved.k, d));
  return {ungrouped(dq_rows, d, scale), heads_last(dk_rows, d), heads_last(dv_rows, d)};
}

int64_t attention_saved_bytes(const AttentionShape& s, double p, at::ScalarType dtype) {
  const int64_t scores = s.batch * s.q_heads * s.seq * s.seq;
  int64_t bytes = nbytes(s.batch * s.seq * (s.q_heads + 2 * s.kv_heads) * s.head_dim, dtype) +
                  nbytes(scores, dtype);
  if (p > 0.0) bytes += dropout_saved_bytes(scores, p) + nbytes(scores, dtype);
  return bytes;
}

double attention_flops(const AttentionShape& s, double p) {
  return attention_flops_over(static_cast<double>(s.batch) * s.q_heads * s.seq * s.seq, s.head_dim, p);
}

double attention_flops_over(double scores, int64_t head_dim, double p) {
  return 4.0 * scores * static_cast<double>(head_dim) + kSoftmaxFlopsPerScore * scores +
         dropout_flops(static_cast<int64_t>(scores), p);
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::flags;

std::vector<int64_t> strides_of(const TensorInfo& t) {
  if (!t.contiguous()) return t.strides;
  std::vector<int64_t> s(t.sizes.size(), 1);
  for (size_t i = s.size() - 1; i-- > 0;) s[i] = s[i + 1] * t.sizes[i + 1];
  return s;
}

// Whether heads_first() of a [B, T, H, D] tensor copies (a view needs a compatible layout).
bool heads_first_copies(const TensorInfo& t) {
  auto s = t.sizes;
  auto st = strides_of(t);
  std::swap(s[1], s[2]);
  std::swap(st[1], st[2]);
  const std::vector<int64_t> rows = {s[0] * s[1], s[2], s[3]};
  return !at::detail::computeStride(at::IntArrayRef(s), at::IntArrayRef(st), at::IntArrayRef(rows)).has_value();
}

// Whether heads_last() of [B*H, T, D] rows copies: not when the transposed view is
// contiguous already (one head, or one position).
bool heads_last_copies(int64_t H, int64_t T) { return H > 1 && T > 1; }

// Inputs {q, k, v} ([B, T, H, D], possibly strided); outputs {out, probs} and, with
// dropout, {mask, probs_d}. Sharded: q, k, v hold the rank's heads. The backward reads the
// saved mask, so only the forward (and its recompute) draws one.
class AttentionDef final : public OpDef {
 public:
  const char* kind() const override { return "attention"; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    TORCH_CHECK(in.size() == 3 && in[0].sizes.size() == 4 && in[1].sizes == in[2].sizes &&
                    in[1].sizes.size() == 4 && in[0].sizes[2] % in[1].sizes[2] == 0,
                "[attention] needs q [B, T, Hq, D] and k, v [B, T, Hkv, D]");
    const auto& q = in[0].sizes;
    const TensorInfo scores{{q[0], q[2], q[1], q[1]}, in[0].dtype, {}};
    std::vector<TensorInfo> out = {in[0].with_sizes(q), scores};
    if (a.p > 0) out.insert(out.end(), {TensorInfo{scores.sizes, at::kBool, {}}, scores});
    return out;
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs& a) const override {
    const auto& q = in[0].sizes;
    return ops::attention_flops({q[0], q[1], q[2], in[1].sizes[2], q[3]}, a.p);
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0, 1, 2}); }
  std::vector<bool> saves_outputs(const Attrs&, size_t n) const override { return flags(n, {1, 2, 3}); }
  const char* output_name(size_t i) const override {
    static const char* const names[] = {"out", "probs", "mask", "probs_d"};
    return names[i];
  }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs& a,
                                  const RunContext& ctx) const override {
    auto r = ops::attention_forward(in[0], in[1], in[2], ctx.train ? a.p : 0.0,
                                    detail::attention_key(in[0], a, ctx));
    std::vector<at::Tensor> out = {r.out, r.saved.probs};
    if (a.p > 0) out.insert(out.end(), {r.saved.mask, r.saved.probs_d});
    return out;
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs& a, const RunContext&) const override {
    const bool drop = a.p > 0;
    const ops::AttentionSaved s{in[0], in[1], in[2], out[1], drop ? out[2] : at::Tensor(),
                                drop ? out[3] : at::Tensor(), a.p};
    auto g = ops::attention_backward(dy[0], s);
    return {g.dq, g.dk, g.dv};
  }
  // Mirrors attention_forward: scaled query rows, key rows (copied unless a view serves),
  // the scores, the causal mask, probabilities, dropout (the bool mask is copied to the
  // compute dtype for the product), value rows and the output rows. The 8-byte temporaries
  // are the scale scalars of the grouped copies.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>& out, const Attrs& a) const override {
    const int64_t T = in[0].sizes[1];
    const int64_t S = out[1].bytes(), Q = in[0].with_sizes(in[0].sizes).bytes(), K = in[1].with_sizes(in[1].sizes).bytes();
    const int64_t k = heads_first_copies(in[1]) ? e.temp(K) : -1;
    const int64_t q = e.temp(Q);
    detail::scalar_operand(e, in[0].dtype);
    const int64_t scores = e.temp(S);
    e.release(q);
    if (k >= 0) e.release(k);
    const int64_t future = e.temp(T * T);
    e.out(1);
    e.release(scores);
    if (a.p > 0) {
      e.out(2);
      const int64_t maskf = e.temp(S);
      e.out(3);
      e.release(maskf);
    }
    const int64_t v = heads_first_copies(in[2]) ? e.temp(K) : -1;
    const int64_t rows = e.temp(Q);
    if (v >= 0) e.release(v);
    e.out(0);
    detail::scalar_operand(e, in[0].dtype);
    e.release(rows);
    e.release(future);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>& out, const Attrs& a) const override {
    const int64_t T = in[0].sizes[1], Hkv = in[1].sizes[2];
    const int64_t S = out[1].bytes(), Q = in[0].with_sizes(in[0].sizes).bytes(), K = in[1].with_sizes(in[1].sizes).bytes();
    const int64_t dout = e.temp(Q);
    detail::scalar_operand(e, in[0].dtype);
    const int64_t dv = e.temp(K);
    const int64_t v = heads_first_copies(in[2]) ? e.temp(K) : -1;
    const int64_t dprobs = e.temp(S);
    if (v >= 0) e.release(v);
    if (a.p > 0) e.release(e.temp(S));
    const int64_t dscores = e.temp(S);
    e.release(dprobs);
    const int64_t q = e.temp(Q);
    detail::scalar_operand(e, in[0].dtype);
    const int64_t dk = e.temp(K);
    e.release(q);
    const int64_t k = heads_first_copies(in[1]) ? e.temp(K) : -1;
    const int64_t dq = e.temp(Q);
    if (k >= 0) e.release(k);
    e.out(0);
    detail::scalar_operand(e, in[0].dtype);
    const bool copies = heads_last_copies(Hkv, T);
    if (copies) {
      e.out(1);
      e.out(2);
    } else {
      e.adopt(dk, 1);
      e.adopt(dv, 2);
    }
    e.release(dout);
    if (copies) e.release(dv);
    e.release(dscores);
    if (copies) e.release(dk);
    e.release(dq);
  }
};

}  // namespace

const OpDef& op::attention() {
  static const AttentionDef def;
  return def;
}

}  // namespace remat::graph
