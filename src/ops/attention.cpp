#include "remat/ops/attention.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace remat::ops {
namespace {

// Softmax cost per score: max, subtract, exp, sum, divide.
constexpr double kSoftmaxFlopsPerScore = 5.0;

// [B, T, Hq, D] viewed as [B, Hkv, T, G, D]: each key/value head's query rows ordered by
// position, then query head, so the rows of positions [t0, t1) are the contiguous range
// [t0 G, t1 G) and one batched matmul against that group's K and V serves all G heads
// without repeating K or V.
at::Tensor grouped_view(const at::Tensor& x, const AttentionDims& d) {
  return x.reshape({d.B, d.T, d.Hkv, d.G, d.D}).permute({0, 2, 1, 3, 4});
}

// scale * x for x [B, T, Hq, D], as contiguous rows [B*Hkv, T*G, D] (one pass: copy and scale).
at::Tensor query_rows(const at::Tensor& x, const AttentionDims& d, double scale) {
  at::Tensor rows = at::empty({d.B, d.Hkv, d.T, d.G, d.D}, x.options());
  at::mul_out(rows, grouped_view(x, d), at::scalar_tensor(scale, at::kDouble));
  return rows.view({d.BK(), d.T * d.G, d.D});
}

// [B, T, Hkv, D] -> [B*Hkv, T, D] (a copy unless the layout already allows a view).
at::Tensor heads_first(const at::Tensor& x, const AttentionDims& d) {
  return x.transpose(1, 2).reshape({d.BK(), d.T, d.D});
}

// Positions [t0, t0 + n) of the sequence: a block of queries or keys.
struct Span {
  int64_t t0, n;
  int64_t end() const { return t0 + n; }
};

template <class F>
void for_each_block(int64_t T, int64_t block, F&& f) {
  for (int64_t t0 = 0; t0 < T; t0 += block) f(Span{t0, std::min(block, T - t0)});
}

void check_block(int64_t block) {
  TORCH_CHECK(block >= 1, "[attention] a block must hold at least one position, got ", block);
}

}  // namespace

AttentionDims attention_dims(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "[", op,
              "] q, k and v must be [B, T, heads, head_dim], got q ", q.sizes(), ", k ", k.sizes(), " and v ",
              v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "[", op, "] k and v must have the same shape, got k ", k.sizes(), " and v ",
              v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3), "[", op,
              "] q [B, T, Hq, D] and k, v [B, T, Hkv, D] must agree on B, T and D, got q ", q.sizes(), " and k ",
              k.sizes());
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "[", op,
              "] query heads must be a multiple of key/value heads, got q ", q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "[", op,
              "] q, k and v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(), " and ",
              v.scalar_type());
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), q.size(2) / k.size(2)};
}

// The causal mask zeroes every score of a key after its query, so each block of queries
// [t0, t1) multiplies against keys [0, t1) only: the products skip the blocks above the
// diagonal, and the softmax and its backward run over those keys alone. probs keeps its
// whole [T x T] rows (zeros above the diagonal), so the dropout mask and the saved bytes
// are the unblocked op's.
Fwd<AttentionSaved> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double p,
                                      const DropoutKey& key, int64_t block) {
  const trace::Scope trace_scope("attention", trace::Category::forward);
  const AttentionDims d = attention_dims("attention", q, k, v);
  check_block(block);
  const int64_t G = d.G, T = d.T;
  const at::Tensor kr = heads_first(k, d), vr = heads_first(v, d);
  // The 1/sqrt(D) scale is folded into the copy of q the matmul needs anyway.
  const at::Tensor qr = query_rows(q, d, 1.0 / std::sqrt(static_cast<double>(d.D)));
  at::Tensor probs = at::empty({d.B, d.Hkv, T, G, T}, q.options());
  const at::Tensor pr = probs.view({d.BK(), T * G, T});
  const int64_t first = std::min(block, T);
  at::Tensor future = at::ones({first, first}, q.options().dtype(at::kBool)).triu_(1);
  for_each_block(T, block, [&](Span b) {
    at::Tensor s = at::bmm(qr.narrow(1, b.t0 * G, b.n * G), kr.narrow(1, 0, b.end()).transpose(1, 2));
    s.view({d.BK(), b.n, G, b.end()})
        .narrow(3, b.t0, b.n)
        .masked_fill_(future.narrow(0, 0, b.n).narrow(1, 0, b.n).unsqueeze(1),
                      -std::numeric_limits<double>::infinity());
    const at::Tensor block_probs = at::_softmax(s, -1, false);
    s = at::Tensor();
    const at::Tensor rows = pr.narrow(1, b.t0 * G, b.n * G);
    rows.narrow(2, 0, b.end()).copy_(block_probs);
    if (b.end() < T) rows.narrow(2, b.end(), T - b.end()).zero_();
  });
  future = at::Tensor();
  // The mask is drawn in the [B, Hq, T, T] order of the heads, whatever the rows' order.
  at::Tensor mask = p > 0.0 ? dropout_mask({d.B, d.Hq, T, T}, p, key, q.device()) : at::Tensor();
  Fwd<DropoutSaved> drop = p > 0.0 ? dropout_apply(probs, mask.view({d.B, d.Hkv, G, T, T}).permute({0, 1, 3, 2, 4}), p)
                                   : Fwd<DropoutSaved>{probs, DropoutSaved{}};
  const at::Tensor pd = drop.out.view({d.BK(), T * G, T});
  at::Tensor out = at::empty({d.B, T, d.Hq, d.D}, q.options());
  const at::Tensor out_rows = grouped_view(out, d);  // a view: out is contiguous
  for_each_block(T, block, [&](Span b) {
    const at::Tensor o = at::bmm(pd.narrow(1, b.t0 * G, b.n * G).narrow(2, 0, b.end()), vr.narrow(1, 0, b.end()));
    out_rows.narrow(2, b.t0, b.n).copy_(o.view({d.B, d.Hkv, b.n, G, d.D}));
  });
  at::Tensor probs_d = p > 0.0 ? drop.out : at::Tensor();
  return {out, AttentionSaved{q, k, v, probs, mask, probs_d, p}};
}

AttentionGrads attention_backward(const at::Tensor& dout, const AttentionSaved& saved, int64_t block) {
  const trace::Scope trace_scope("attention", trace::Category::backward);
  const AttentionDims d = attention_dims("attention", saved.q, saved.k, saved.v);
  check_block(block);
  TORCH_CHECK(dout.sizes() == saved.q.sizes(), "[attention] output gradient must match q's shape ", saved.q.sizes(),
              ", got ", dout.sizes());
  TORCH_CHECK(saved.p == 0.0 || (saved.mask.defined() && saved.probs_d.defined()), "[attention] dropout p=", saved.p,
              " needs the saved mask and probs_d");
  const int64_t G = d.G, T = d.T;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
  const bool drop = saved.p > 0.0;
  const at::Tensor pr = saved.probs.view({d.BK(), T * G, T});
  const at::Tensor pd = drop ? saved.probs_d.view({d.BK(), T * G, T}) : pr;
  const at::Tensor mask = drop ? saved.mask.view({d.B, d.Hkv, G, T, T}).permute({0, 1, 3, 2, 4}) : at::Tensor();
  const at::Tensor dout_rows = query_rows(dout, d, 1.0);
  const at::Tensor vr = heads_first(saved.v, d), kr = heads_first(saved.k, d);

  // By query blocks: the scores' gradient (kept whole for the key blocks below) and dq.
  at::Tensor dscores = at::empty({d.BK(), T * G, T}, dout.options());
  at::Tensor dq = at::empty({d.B, T, d.Hq, d.D}, dout.options());
  const at::Tensor dq_rows = grouped_view(dq, d);
  for_each_block(T, block, [&](Span b) {
    at::Tensor dp = at::bmm(dout_rows.narrow(1, b.t0 * G, b.n * G), vr.narrow(1, 0, b.end()).transpose(1, 2));
    if (drop) {
      dp.view({d.B, d.Hkv, b.n, G, b.end()})
          .mul_(mask.narrow(2, b.t0, b.n).narrow(4, 0, b.end()))
          .mul_(1.0 / (1.0 - saved.p));
    }
    // The softmax backward, dscores = probs (dp - rowsum(dp probs)), written in place into
    // the block's rows of dscores: no block-sized temporary beyond dp.
    at::Tensor ds = dscores.narrow(1, b.t0 * G, b.n * G).narrow(2, 0, b.end());
    const at::Tensor probs = pr.narrow(1, b.t0 * G, b.n * G).narrow(2, 0, b.end());
    at::mul_out(ds, dp, probs);
    dp = at::Tensor();
    ds.addcmul_(probs, at::sum(ds, -1, true), -1.0);
    const at::Tensor dq_block = at::bmm(ds, kr.narrow(1, 0, b.end()));
    // scores = (scale q) k^T, so dq = scale (dscores k).
    at::Tensor dq_block_rows = dq_rows.narrow(2, b.t0, b.n);
    at::mul_out(dq_block_rows, dq_block.view({d.B, d.Hkv, b.n, G, d.D}), at::scalar_tensor(scale, at::kDouble));
  });

  // By key blocks: each key's gradient sums over the queries at or after it, every query
  // head of its group included (the rows), so dk and dv need no accumulation across blocks.
  at::Tensor dk = at::empty({d.B, T, d.Hkv, d.D}, dout.options());
  at::Tensor dv = at::empty({d.B, T, d.Hkv, d.D}, dout.options());
  const at::Tensor qr = query_rows(saved.q, d, scale);
  for_each_block(T, block, [&](Span c) {
    const int64_t rows = (T - c.t0) * G;
    // Each block's product is written out and freed before the next one is made.
    const auto put = [&](at::Tensor& to, const at::Tensor& grad_rows) {
      to.narrow(1, c.t0, c.n).copy_(grad_rows.view({d.B, d.Hkv, c.n, d.D}).transpose(1, 2));
    };
    put(dv, at::bmm(pd.narrow(1, c.t0 * G, rows).narrow(2, c.t0, c.n).transpose(1, 2),
                    dout_rows.narrow(1, c.t0 * G, rows)));
    // dk = dscores^T (scale q).
    put(dk,
        at::bmm(dscores.narrow(1, c.t0 * G, rows).narrow(2, c.t0, c.n).transpose(1, 2), qr.narrow(1, c.t0 * G, rows)));
  });
  return {dq, dk, dv};
}

int64_t attention_saved_bytes(const AttentionShape& s, double p, at::ScalarType dtype) {
  const int64_t scores = s.batch * s.q_heads * s.seq * s.seq;
  int64_t bytes = nbytes(s.batch * s.seq * (s.q_heads + 2 * s.kv_heads) * s.head_dim, dtype) + nbytes(scores, dtype);
  if (p > 0.0) bytes += dropout_saved_bytes(scores, p) + nbytes(scores, dtype);
  return bytes;
}

double attention_causal_scores(const AttentionShape& s, int64_t block) {
  check_block(block);
  double scores = 0;  // per head: each query block's rows times the keys up to its end
  for_each_block(s.seq, block, [&](Span b) { scores += static_cast<double>(b.n) * static_cast<double>(b.end()); });
  return scores * static_cast<double>(s.batch) * static_cast<double>(s.q_heads);
}

double attention_flops(const AttentionShape& s, double p, int64_t block) {
  return attention_flops_over(attention_causal_scores(s, block), s.head_dim, p);
}

double attention_flops_over(double scores, int64_t head_dim, double p) {
  return 4.0 * scores * static_cast<double>(head_dim) + kSoftmaxFlopsPerScore * scores +
         dropout_flops(static_cast<int64_t>(scores), p);
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::flags;

// Whether heads_first() of a [B, T, H, D] tensor copies (a view needs a compatible layout).
bool heads_first_copies(const TensorInfo& t) {
  auto s = t.sizes;
  auto st = detail::strides_of(t);
  std::swap(s[1], s[2]);
  std::swap(st[1], st[2]);
  const std::vector<int64_t> rows = {s[0] * s[1], s[2], s[3]};
  return !at::detail::computeStride(at::IntArrayRef(s), at::IntArrayRef(st), at::IntArrayRef(rows)).has_value();
}

// Inputs {q, k, v} ([B, T, H, D], possibly strided); outputs {out, probs} and, with
// dropout, {mask, probs_d}. Sharded: q, k, v hold the rank's heads. The backward reads the
// saved mask, so only the forward (and its recompute) draws one.
class AttentionDef final : public OpDef {
 public:
  const char* kind() const override { return "attention"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::share_wise; }
  // A rank holds a block of the heads, so its dropout mask is that window (attention_key).
  Attrs on_share(const Attrs& a, const std::vector<TensorInfo>&, int64_t, const std::string&) const override {
    return detail::sharded(a);
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    TORCH_CHECK(in.size() == 3 && in[0].sizes.size() == 4 && in[1].sizes == in[2].sizes && in[1].sizes.size() == 4 &&
                    in[0].sizes[2] % in[1].sizes[2] == 0,
                "[attention] needs q [B, T, Hq, D] and k, v [B, T, Hkv, D]");
    const auto& q = in[0].sizes;
    const int64_t Hkv = in[1].sizes[2];
    // probs (and probs_d) in the rows' order [B, Hkv, T, G, T]; the mask in the heads' [B, Hq, T, T].
    const TensorInfo probs{{q[0], Hkv, q[1], q[2] / Hkv, q[1]}, in[0].dtype, {}};
    std::vector<TensorInfo> out = {in[0].with_sizes(q), probs};
    if (a.p > 0) out.insert(out.end(), {TensorInfo{{q[0], q[2], q[1], q[1]}, at::kBool, {}}, probs});
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
    auto r = ops::attention_forward(in[0], in[1], in[2], ctx.train ? a.p : 0.0, detail::attention_key(in[0], a, ctx));
    std::vector<at::Tensor> out = {r.out, r.saved.probs};
    if (a.p > 0) out.insert(out.end(), {r.saved.mask, r.saved.probs_d});
    return out;
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs& a, const RunContext&) const override {
    const bool drop = a.p > 0;
    const ops::AttentionSaved s{in[0], in[1], in[2], out[1], drop ? out[2] : at::Tensor(), drop ? out[3] : at::Tensor(),
                                a.p};
    auto g = ops::attention_backward(dy[0], s);
    return {g.dq, g.dk, g.dv};
  }
  // Mirrors attention_forward: key and value rows (copied unless a view serves), the scaled
  // query rows, probs, the diagonal block's causal mask, each query block's scores and
  // probabilities, dropout (the bool mask is copied to the compute dtype for the product),
  // the output and each block's rows of it. The 8-byte temporaries are the scale scalars.
  // CUDA kernels take the scale as an argument and cast the mask as they read it
  // (TensorIteratorBase::compute_types copies operands for the CPU only): neither is made.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>& out, const Attrs& a) const override {
    const Shape s(in, e);
    const int64_t k = heads_first_copies(in[1]) ? e.temp(s.K) : -1;
    const int64_t v = heads_first_copies(in[2]) ? e.temp(s.K) : -1;
    const int64_t q = e.temp(s.Q);
    s.scalar(e);
    e.out(1);
    const int64_t first = std::min(ops::kAttentionBlock, s.T);
    const int64_t future = e.temp(first * first);
    s.each_block([&](ops::Span b) {
      const int64_t n = b.n, end = b.end();
      const int64_t scores = e.temp(s.rows(n) * end * s.elt);
      const int64_t probs = e.temp(s.rows(n) * end * s.elt);
      e.release(scores);
      e.release(probs);
    });
    e.release(future);
    if (a.p > 0) {
      e.out(2);
      const int64_t maskf = s.cuda ? -1 : e.temp(out[1].bytes());
      e.out(3);
      if (maskf >= 0) e.release(maskf);
    }
    e.out(0);
    s.each_block([&](ops::Span b) { e.release(e.temp(s.rows(b.n) * s.D * s.elt)); });
    e.release(q);
    if (v >= 0) e.release(v);
    if (k >= 0) e.release(k);
  }
  // Mirrors attention_backward: the output gradient's rows, value and key rows, the scores'
  // gradient, dq; per query block the probabilities' gradient (and the dropout mask in the
  // compute dtype), the row sums of the softmax backward and dq's rows; then dk, dv, the
  // scaled query rows and per key block dv's and dk's rows. On CUDA no scalar nor mask copy
  // is made, as in the forward.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs& a) const override {
    const Shape s(in, e);
    const int64_t dout = e.temp(s.Q);
    s.scalar(e);
    const int64_t v = heads_first_copies(in[2]) ? e.temp(s.K) : -1;
    const int64_t k = heads_first_copies(in[1]) ? e.temp(s.K) : -1;
    const int64_t dscores = e.temp(s.rows(s.T) * s.T * s.elt);
    e.out(0);
    s.each_block([&](ops::Span b) {
      const int64_t n = b.n, end = b.end();
      const int64_t block = s.rows(n) * end * s.elt;
      const int64_t dp = e.temp(block);
      if (a.p > 0 && !s.cuda) e.release(e.temp(block));
      e.release(dp);
      e.release(e.temp(s.rows(n) * s.elt));  // the row sums
      const int64_t dq = e.temp(s.rows(n) * s.D * s.elt);
      s.scalar(e);
      e.release(dq);
    });
    e.out(1);
    e.out(2);
    const int64_t q = e.temp(s.Q);
    s.scalar(e);
    s.each_block([&](ops::Span c) {
      e.release(e.temp(s.kv_rows(c.n) * s.D * s.elt));
      e.release(e.temp(s.kv_rows(c.n) * s.D * s.elt));
    });
    e.release(q);
    e.release(dscores);
    if (k >= 0) e.release(k);
    if (v >= 0) e.release(v);
    e.release(dout);
  }

 private:
  // The sizes the events count, from the inputs q [B, T, Hq, D] and k, v [B, T, Hkv, D].
  struct Shape {
    int64_t B, T, Hq, Hkv, D, elt, Q, K;
    at::ScalarType dtype;
    bool cuda;  ///< CUDA kernels' events (Events::device)
    Shape(const std::vector<TensorInfo>& in, const Events& e)
        : B(in[0].sizes[0]),
          T(in[0].sizes[1]),
          Hq(in[0].sizes[2]),
          Hkv(in[1].sizes[2]),
          D(in[0].sizes[3]),
          elt(detail::bytes_of(1, in[0].dtype)),
          Q(B * T * Hq * D * elt),
          K(B * T * Hkv * D * elt),
          dtype(in[0].dtype),
          cuda(e.device() == at::kCUDA) {}
    int64_t rows(int64_t n) const { return B * Hq * n; }      ///< query rows of n positions, every batch row
    int64_t kv_rows(int64_t n) const { return B * Hkv * n; }  ///< key rows of n positions
    /// A scale's double scalar tensor multiplied in: copied on the CPU, an argument on CUDA.
    void scalar(Events& e) const {
      if (!cuda) detail::scalar_operand(e, dtype);
    }
    /// f(block) for each block of positions the op's loops visit.
    template <class F>
    void each_block(F&& f) const {
      ops::for_each_block(T, ops::kAttentionBlock, f);
    }
  };
};

}  // namespace

const OpDef& op::attention() {
  static const AttentionDef def;
  return def;
}

}  // namespace remat::graph
