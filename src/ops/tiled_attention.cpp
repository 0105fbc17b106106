#include "remat/ops/tiled_attention.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace remat::ops {
namespace {

void check_tiles(const AttentionTiles& t) {
  TORCH_CHECK(t.q >= 1 && t.k >= 1, "[tiled_attention] tiles must hold at least one query and one key, got ", t.q,
              " x ", t.k);
}

// The tiles run in loops over raw CPU memory: a CUDA tensor would be read from the host.
void check_cpu(const at::Tensor& q) {
  TORCH_CHECK(q.is_cpu(), "[tiled_attention] ",
              attention_refusal(Attention::tiled, 0.0, true, q.scalar_type(), q.size(-1)), " Got inputs on ",
              q.device(), ".");
}

// [B, T, Hq, D] seen as [B, Hkv, T, G, D] (a view): each key/value head's query rows ordered
// by position, then query head, so the rows of a query tile [i0, i1) are the contiguous
// range [i0 G, i1 G) and one matmul against the group's key tile serves all G heads.
at::Tensor grouped(const at::Tensor& x, const AttentionDims& d) {
  return x.reshape({d.B, d.T, d.Hkv, d.G, d.D}).permute({0, 2, 1, 3, 4});
}

// [B, T, Hkv, D] seen as [B, Hkv, T, D] (a view).
at::Tensor heads_first(const at::Tensor& x) { return x.permute({0, 2, 1, 3}); }

// Contiguous working copies in the arithmetic dtype: query-like rows [B*Hkv, T*G, D] and
// key-like rows [B*Hkv, T, D].
at::Tensor query_rows(const at::Tensor& x, const AttentionDims& d, at::ScalarType acc) {
  at::Tensor rows = at::empty({d.B, d.Hkv, d.T, d.G, d.D}, x.options().dtype(acc));
  rows.copy_(grouped(x, d));
  return rows.view({d.BK(), d.T * d.G, d.D});
}
at::Tensor key_rows(const at::Tensor& x, const AttentionDims& d, at::ScalarType acc) {
  at::Tensor rows = at::empty({d.B, d.Hkv, d.T, d.D}, x.options().dtype(acc));
  rows.copy_(heads_first(x));
  return rows.view({d.BK(), d.T, d.D});
}

// The first elements of a flat workspace as a contiguous [a, b, c] tensor (tiles at the
// sequence's end are smaller than the workspace).
at::Tensor front(const at::Tensor& buf, int64_t a, int64_t b, int64_t c) {
  return buf.narrow(0, 0, a * b * c).view({a, b, c});
}

// One (query tile, key tile) pair: query positions [i0, i1), keys [j0, j1).
struct Tile {
  int64_t i0, i1, j0, j1;
  int64_t rows(const AttentionDims& d) const { return (i1 - i0) * d.G; }
  int64_t cols() const { return j1 - j0; }
};

// Where row `row` of a tile's [B*Hkv, R, C] block sits: its query position, its index in
// the [B, Hq, T] log-sum-exp, and, with a draw, the index DropoutDraw::keep takes for its
// first key: its element of the math op's [B, Hq, T, T] mask (which dropout draws are
// keyed by), placed in the global mask by the draw's offset (0 without a draw).
struct RowAt {
  int64_t i, lse, mask;
  int64_t valid;  // keys of the tile at or before the query (causal)
};
RowAt row_at(int64_t row, const Tile& t, const AttentionDims& d, const DropoutDraw* draw) {
  const int64_t R = t.rows(d), bk = row / R, r = row % R;
  const int64_t i = t.i0 + r / d.G, b = bk / d.Hkv;
  const int64_t head = b * d.Hq + (bk % d.Hkv) * d.G + r % d.G;  // b Hq + h
  const int64_t mask = draw == nullptr ? 0 : draw->offset(b) + (head * d.T + i) * d.T + t.j0;
  return {i, head * d.T + i, mask, std::clamp<int64_t>(i + 1 - t.j0, 0, t.cols())};
}

// Rows per parallel_for task: enough scores per task to amortise the dispatch.
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// Online softmax of one tile, in place. s [rows, C] holds q k^T (unscaled) and becomes the
// dropped-out, unnormalised probabilities exp(scale s - m); the running maximum m, sum l
// and output rows o [rows, D] are rescaled to the new maximum (initialised on the first
// key tile). The sum l is taken before dropout: dropout does not change the normaliser.
template <class scalar_t>
void online_softmax(scalar_t* s, scalar_t* o, scalar_t* m, scalar_t* l, const Tile& t, const AttentionDims& d,
                    scalar_t scale, const DropoutDraw* draw, scalar_t keep_scale) {
  const int64_t C = t.cols(), n = d.BK() * t.rows(d);
  const bool first = t.j0 == 0;
  at::parallel_for(0, n, grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const RowAt at_ = row_at(row, t, d, draw);
      scalar_t* sr = s + row * C;
      scalar_t mx = -std::numeric_limits<scalar_t>::infinity();
      for (int64_t j = 0; j < at_.valid; ++j) {
        sr[j] *= scale;
        mx = std::max(mx, sr[j]);
      }
      // The first key tile holds key 0, which every query sees: m is finite from then on.
      const scalar_t m_new = first ? mx : std::max(m[row], mx);
      const scalar_t alpha = first ? scalar_t(0) : std::exp(m[row] - m_new);
      scalar_t sum = 0;
      for (int64_t j = 0; j < at_.valid; ++j) {
        const scalar_t e = std::exp(sr[j] - m_new);
        sum += e;
        sr[j] = draw == nullptr ? e : draw->keep(at_.mask + j) ? e * keep_scale : scalar_t(0);
      }
      std::fill(sr + at_.valid, sr + C, scalar_t(0));
      m[row] = m_new;
      l[row] = first ? sum : alpha * l[row] + sum;
      scalar_t* orow = o + row * d.D;
      for (int64_t c = 0; c < d.D; ++c) orow[c] = first ? scalar_t(0) : orow[c] * alpha;
    }
  });
}

// After a query tile's last key tile: o /= l and lse = m + log l.
template <class scalar_t>
void finish_rows(scalar_t* o, const scalar_t* m, const scalar_t* l, scalar_t* lse, const Tile& t,
                 const AttentionDims& d) {
  at::parallel_for(0, d.BK() * t.rows(d), grain(d.D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t inv = scalar_t(1) / l[row];
      for (int64_t c = 0; c < d.D; ++c) o[row * d.D + c] *= inv;
      lse[row_at(row, t, d, nullptr).lse] = m[row] + std::log(l[row]);
    }
  });
}

// The backward's recompute of a tile's probabilities from q k^T (in s, unscaled) and the
// log-sum-exp: s becomes P (masked keys 0); with dropout, pd the dropped-out P.
template <class scalar_t>
void recompute_probs(scalar_t* s, scalar_t* pd, const scalar_t* lse, const Tile& t, const AttentionDims& d,
                     scalar_t scale, const DropoutDraw* draw, scalar_t keep_scale) {
  const int64_t C = t.cols();
  at::parallel_for(0, d.BK() * t.rows(d), grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const RowAt at_ = row_at(row, t, d, draw);
      scalar_t* sr = s + row * C;
      const scalar_t z = lse[at_.lse];
      for (int64_t j = 0; j < at_.valid; ++j) sr[j] = std::exp(sr[j] * scale - z);
      std::fill(sr + at_.valid, sr + C, scalar_t(0));
      if (draw == nullptr) continue;
      scalar_t* pr = pd + row * C;
      for (int64_t j = 0; j < at_.valid; ++j) pr[j] = draw->keep(at_.mask + j) ? sr[j] * keep_scale : scalar_t(0);
      std::fill(pr + at_.valid, pr + C, scalar_t(0));
    }
  });
}

// dp [rows, C] holds dO v^T (the gradient of the dropped-out probabilities) and becomes the
// gradient of the scaled scores' input, scale P (dropout'(dp) - delta): the softmax backward
// with delta = rowsum(dO o) = rowsum(P dropout'(dp)), and the 1/sqrt(D) folded in.
template <class scalar_t>
void score_grads(scalar_t* dp, const scalar_t* p, const scalar_t* delta, const Tile& t, const AttentionDims& d,
                 scalar_t scale, const DropoutDraw* draw, scalar_t keep_scale) {
  const int64_t C = t.cols();
  at::parallel_for(0, d.BK() * t.rows(d), grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const RowAt at_ = row_at(row, t, d, draw);
      const int64_t bk = row / t.rows(d), r = row % t.rows(d);
      const scalar_t dl = delta[bk * d.T * d.G + t.i0 * d.G + r];
      scalar_t* gr = dp + row * C;
      const scalar_t* pr = p + row * C;
      for (int64_t j = 0; j < at_.valid; ++j) {
        const scalar_t g = draw == nullptr ? gr[j] : draw->keep(at_.mask + j) ? gr[j] * keep_scale : scalar_t(0);
        gr[j] = scale * pr[j] * (g - dl);
      }
      std::fill(gr + at_.valid, gr + C, scalar_t(0));
    }
  });
}

// delta[row] = sum_c a[row, c] b[row, c] over rows of D.
template <class scalar_t>
void row_dots(const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t n, int64_t D) {
  at::parallel_for(0, n, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      scalar_t acc = 0;
      for (int64_t c = 0; c < D; ++c) acc += a[row * D + c] * b[row * D + c];
      out[row] = acc;
    }
  });
}

}  // namespace

Fwd<TiledAttentionSaved> tiled_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 double p, const DropoutKey& key, AttentionTiles tiles) {
  const trace::Scope trace_scope("tiled_attention", trace::Category::forward);
  const AttentionDims d = attention_dims("tiled_attention", q, k, v);
  check_tiles(tiles);
  check_cpu(q);
  const DropoutDraw draw(key, p, {d.B, d.Hq, d.T, d.T});  // the math op's mask
  const at::ScalarType acc = stats_dtype(q.scalar_type());
  const at::TensorOptions fa = q.options().dtype(acc);
  const int64_t tq = std::min(tiles.q, d.T), tk = std::min(tiles.k, d.T), BK = d.BK();

  at::Tensor out = at::empty({d.B, d.T, d.Hq, d.D}, q.options());
  at::Tensor lse = at::empty({d.B, d.Hq, d.T}, fa);
  const at::Tensor qr = query_rows(q, d, acc), kr = key_rows(k, d, acc), vr = key_rows(v, d, acc);
  // Workspaces of one tile, reused by every tile: no allocation inside the loops.
  at::Tensor s = at::empty({BK * tq * d.G * tk}, fa), o = at::empty({BK * tq * d.G * d.D}, fa);
  at::Tensor m = at::empty({BK * tq * d.G}, fa), l = at::empty({BK * tq * d.G}, fa);
  AT_DISPATCH_FLOATING_TYPES(acc, "tiled_attention_forward", [&] {
    const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(d.D)));
    const auto keep_scale = static_cast<scalar_t>(p > 0.0 ? 1.0 / (1.0 - p) : 1.0);
    for (int64_t i0 = 0; i0 < d.T; i0 += tq) {
      const int64_t i1 = std::min(i0 + tq, d.T), R = (i1 - i0) * d.G;
      const at::Tensor qt = qr.narrow(1, i0 * d.G, R), ot = front(o, BK, R, d.D);
      // Key tiles from the first up to the one holding key i1 - 1; the rest are masked whole.
      for (int64_t j0 = 0; j0 < i1; j0 += tk) {
        const Tile t{i0, i1, j0, std::min(j0 + tk, d.T)};
        at::Tensor st = front(s, BK, R, t.cols());
        at::bmm_out(st, qt, kr.narrow(1, j0, t.cols()).transpose(1, 2));
        online_softmax<scalar_t>(st.data_ptr<scalar_t>(), ot.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                                 l.data_ptr<scalar_t>(), t, d, scale, p > 0.0 ? &draw : nullptr, keep_scale);
        ot.baddbmm_(st, vr.narrow(1, j0, t.cols()));
      }
      finish_rows<scalar_t>(ot.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(), l.data_ptr<scalar_t>(),
                            lse.data_ptr<scalar_t>(), Tile{i0, i1, 0, 0}, d);
      grouped(out, d).narrow(2, i0, i1 - i0).copy_(ot.view({d.B, d.Hkv, i1 - i0, d.G, d.D}));
    }
  });
  return {out, TiledAttentionSaved{q, k, v, out, lse, p, key, tiles}};
}

AttentionGrads tiled_attention_backward(const at::Tensor& dout, const TiledAttentionSaved& saved) {
  const trace::Scope trace_scope("tiled_attention", trace::Category::backward);
  const AttentionDims d = attention_dims("tiled_attention", saved.q, saved.k, saved.v);
  check_tiles(saved.tiles);
  check_cpu(saved.q);
  TORCH_CHECK(dout.sizes() == saved.q.sizes(), "[tiled_attention] output gradient must match q's shape ",
              saved.q.sizes(), ", got ", dout.sizes());
  const at::ScalarType acc = stats_dtype(saved.q.scalar_type());
  TORCH_CHECK(saved.out.sizes() == saved.q.sizes() && saved.lse.sizes() == at::IntArrayRef({d.B, d.Hq, d.T}) &&
                  saved.lse.scalar_type() == acc && saved.lse.is_contiguous(),
              "[tiled_attention] the saved output must be [B, T, Hq, D] and the log-sum-exp contiguous [B, Hq, T] ",
              acc, ", got ", saved.out.sizes(), " and ", saved.lse.sizes(), " ", saved.lse.scalar_type());
  const double p = saved.p;
  const DropoutDraw draw(saved.key, p, {d.B, d.Hq, d.T, d.T});
  const at::TensorOptions fa = saved.q.options().dtype(acc);
  const int64_t tq = std::min(saved.tiles.q, d.T), tk = std::min(saved.tiles.k, d.T), BK = d.BK();

  at::Tensor dq = at::empty(saved.q.sizes(), saved.q.options());
  at::Tensor dk = at::empty(saved.k.sizes(), saved.k.options()), dv = at::empty(saved.v.sizes(), saved.v.options());
  const at::Tensor qr = query_rows(saved.q, d, acc), kr = key_rows(saved.k, d, acc), vr = key_rows(saved.v, d, acc);
  const at::Tensor dor = query_rows(dout, d, acc);
  // Holds the output until delta is taken from it, then accumulates dq over the key tiles.
  at::Tensor dqr = query_rows(saved.out, d, acc);
  at::Tensor delta = at::empty({BK * d.T * d.G}, fa);
  at::Tensor s = at::empty({BK * tq * d.G * tk}, fa);
  at::Tensor pd = p > 0.0 ? at::empty({BK * tq * d.G * tk}, fa) : at::Tensor();
  at::Tensor dp = at::empty({BK * tq * d.G * tk}, fa), dqt = at::empty({BK * tq * d.G * d.D}, fa);
  at::Tensor dka = at::empty({BK * tk * d.D}, fa), dva = at::empty({BK * tk * d.D}, fa);
  AT_DISPATCH_FLOATING_TYPES(acc, "tiled_attention_backward", [&] {
    const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(d.D)));
    const auto keep_scale = static_cast<scalar_t>(p > 0.0 ? 1.0 / (1.0 - p) : 1.0);
    const DropoutDraw* dr = p > 0.0 ? &draw : nullptr;
    row_dots<scalar_t>(dor.data_ptr<scalar_t>(), dqr.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), BK * d.T * d.G,
                       d.D);
    dqr.zero_();
    // FlashAttention-2's order: each key tile's dk and dv accumulate over the query tiles
    // that see it (from the one holding its first key), dq over the key tiles.
    for (int64_t j0 = 0; j0 < d.T; j0 += tk) {
      const int64_t C = std::min(j0 + tk, d.T) - j0;
      const at::Tensor kt = kr.narrow(1, j0, C), vt = vr.narrow(1, j0, C);
      const at::Tensor dkt = front(dka, BK, C, d.D).zero_(), dvt = front(dva, BK, C, d.D).zero_();
      for (int64_t i0 = j0 / tq * tq; i0 < d.T; i0 += tq) {
        const Tile t{i0, std::min(i0 + tq, d.T), j0, j0 + C};
        const int64_t R = t.rows(d);
        const at::Tensor qt = qr.narrow(1, i0 * d.G, R), dot = dor.narrow(1, i0 * d.G, R);
        at::Tensor st = front(s, BK, R, C), dpt = front(dp, BK, R, C);
        at::bmm_out(st, qt, kt.transpose(1, 2));
        const at::Tensor pdt = p > 0.0 ? front(pd, BK, R, C) : st;
        recompute_probs<scalar_t>(st.data_ptr<scalar_t>(), p > 0.0 ? pdt.data_ptr<scalar_t>() : nullptr,
                                  saved.lse.data_ptr<scalar_t>(), t, d, scale, dr, keep_scale);
        dvt.baddbmm_(pdt.transpose(1, 2), dot);
        at::bmm_out(dpt, dot, vt.transpose(1, 2));
        score_grads<scalar_t>(dpt.data_ptr<scalar_t>(), st.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), t, d,
                              scale, dr, keep_scale);
        dkt.baddbmm_(dpt.transpose(1, 2), qt);
        at::Tensor dqtt = front(dqt, BK, R, d.D);
        at::bmm_out(dqtt, dpt, kt);
        dqr.narrow(1, i0 * d.G, R).add_(dqtt);
      }
      heads_first(dk).narrow(2, j0, C).copy_(dkt.view({d.B, d.Hkv, C, d.D}));
      heads_first(dv).narrow(2, j0, C).copy_(dvt.view({d.B, d.Hkv, C, d.D}));
    }
  });
  grouped(dq, d).copy_(dqr.view({d.B, d.Hkv, d.T, d.G, d.D}));
  return {dq, dk, dv};
}

int64_t tiled_attention_saved_bytes(const AttentionShape& s, at::ScalarType dtype) {
  return nbytes(s.batch * s.seq * (2 * s.q_heads + 2 * s.kv_heads) * s.head_dim, dtype) +
         nbytes(s.batch * s.q_heads * s.seq, stats_dtype(dtype));
}

double tiled_attention_flops(const AttentionShape& s, double p, AttentionTiles tiles) {
  check_tiles(tiles);
  const int64_t tq = std::min(tiles.q, s.seq), tk = std::min(tiles.k, s.seq);
  double scores = 0;  // per head: each query tile's rows times the keys of its tiles up to the diagonal
  for (int64_t i0 = 0; i0 < s.seq; i0 += tq) {
    const int64_t i1 = std::min(i0 + tq, s.seq);
    scores += static_cast<double>(i1 - i0) * std::min((i1 + tk - 1) / tk * tk, s.seq);
  }
  scores *= static_cast<double>(s.batch) * s.q_heads;
  return attention_flops_over(scores, s.head_dim, p);
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::flags;

// Inputs {q, k, v} ([B, T, H, D], possibly strided; sharded: the rank's heads); attributes
// p, site, tiles; outputs {out, lse}. Its backward reads q, k, v, out and lse: no [T x T]
// value exists.
class TiledAttentionDef final : public OpDef {
 public:
  const char* kind() const override { return "attention"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::share_wise; }
  // A rank holds a block of the heads, so its dropout mask is that window (attention_key).
  Attrs on_share(const Attrs& a, const std::vector<TensorInfo>&, int64_t, const std::string&) const override {
    return detail::sharded(a);
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == 3 && in[0].sizes.size() == 4 && in[1].sizes == in[2].sizes && in[1].sizes.size() == 4 &&
                    in[0].sizes[2] % in[1].sizes[2] == 0,
                "[tiled_attention] needs q [B, T, Hq, D] and k, v [B, T, Hkv, D]");
    const auto& q = in[0].sizes;
    return {in[0].with_sizes(q), TensorInfo{{q[0], q[2], q[1]}, ops::stats_dtype(in[0].dtype), {}}};
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs& a) const override {
    const auto& q = in[0].sizes;
    return ops::tiled_attention_flops({q[0], q[1], q[2], in[1].sizes[2], q[3]}, a.p, a.tiles);
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0, 1, 2}); }
  std::vector<bool> saves_outputs(const Attrs&, size_t n) const override { return flags(n, {0, 1}); }
  const char* output_name(size_t i) const override {
    static const char* const names[] = {"out", "lse"};
    return names[i];
  }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs& a,
                                  const RunContext& ctx) const override {
    auto r = ops::tiled_attention_forward(in[0], in[1], in[2], ctx.train ? a.p : 0.0,
                                          detail::attention_key(in[0], a, ctx), a.tiles);
    return {r.out, r.saved.lse};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs& a, const RunContext& ctx) const override {
    const ops::TiledAttentionSaved s{in[0],  in[1], in[2], out[0], out[1], a.p, detail::attention_key(in[0], a, ctx),
                                     a.tiles};
    auto g = ops::tiled_attention_backward(dy[0], s);
    return {g.dq, g.dk, g.dv};
  }
  // Mirrors tiled_attention_forward: the outputs, the working copies of q, k, v in the
  // arithmetic dtype, then one tile's scores, output rows, maxima and sums.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>& out, const Attrs& a) const override {
    const Sizes z(in, out[1].dtype, a.tiles);
    e.out(0);
    e.out(1);
    const int64_t held[] = {e.temp(z.q),          e.temp(z.kv),   e.temp(z.kv),  e.temp(z.scores),
                            e.temp(z.rows * z.D), e.temp(z.rows), e.temp(z.rows)};
    for (int64_t h : held) e.release(h);
  }
  // Mirrors tiled_attention_backward: the gradients, the working copies (q, k, v, dout,
  // the output turned dq accumulator), delta, then one tile's probabilities (and dropped
  // ones), their gradient, the dq tile and the dk, dv accumulators of a key tile.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>& out, const Attrs& a) const override {
    const Sizes z(in, out[1].dtype, a.tiles);
    e.out(0);
    e.out(1);
    e.out(2);
    std::vector<int64_t> held = {e.temp(z.q), e.temp(z.kv),      e.temp(z.kv),    e.temp(z.q),
                                 e.temp(z.q), e.temp(z.q / z.D), e.temp(z.scores)};
    if (a.p > 0) held.push_back(e.temp(z.scores));
    for (int64_t b : {z.scores, z.rows * z.D, z.keys * z.D, z.keys * z.D}) held.push_back(e.temp(b));
    for (int64_t h : held) e.release(h);
  }

 private:
  // Bytes of the working tensors, in the arithmetic dtype.
  struct Sizes {
    int64_t D, q, kv, rows, keys, scores;  // rows, keys: one value per row (key) of a tile
    Sizes(const std::vector<TensorInfo>& in, at::ScalarType acc, const ops::AttentionTiles& t) {
      const auto& s = in[0].sizes;
      const int64_t B = s[0], T = s[1], Hq = s[2], Hkv = in[1].sizes[2], G = Hq / Hkv, a = c10::elementSize(acc);
      D = s[3];
      q = B * T * Hq * D * a;
      kv = B * T * Hkv * D * a;
      rows = B * Hkv * std::min(t.q, T) * G * a;
      keys = B * Hkv * std::min(t.k, T) * a;
      scores = rows * std::min(t.k, T);
    }
  };
};

}  // namespace

const OpDef& op::tiled_attention() {
  static const TiledAttentionDef def;
  return def;
}

const OpDef& op::attention(Attention kind) {
  // Every model and every plan declares its blocks through here, so an unresolved choice
  // stops before anything is built or priced.
  TORCH_CHECK(kind != Attention::automatic,
              "model.attention = auto names no attention op: the command resolves it to one of them "
              "(plan_run_auto, src/run/auto.h) before building or planning the model.");
  return kind == Attention::tiled ? tiled_attention() : kind == Attention::sdpa ? sdpa_attention() : attention();
}

}  // namespace remat::graph
