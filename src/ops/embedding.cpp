#include "remat/ops/embedding.h"

#include "ops/op_def.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<EmbeddingSaved> embedding_forward(const at::Tensor& ids, const at::Tensor& w, std::optional<VocabShard> shard) {
  const trace::Scope trace_scope("embedding", trace::Category::forward);
  TORCH_CHECK(w.dim() == 2, "[embedding] weight must be [vocab, channels], got ", w.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "[embedding] token ids must be int64, got ", ids.scalar_type());
  if (shard) shard->check("embedding", w.size(0));
  const int64_t V = shard ? shard->vocab : w.size(0);
  if (ids.numel() > 0) {
    auto [lo, hi] = at::aminmax(ids);
    const int64_t lo_v = lo.item<int64_t>(), hi_v = hi.item<int64_t>();
    TORCH_CHECK(lo_v >= 0 && hi_v < V, "[embedding] token ids must lie in [0, ", V, ") for a vocabulary of ", V,
                ", got ids in [", lo_v, ", ", hi_v, "]");
  }
  std::vector<int64_t> out_sizes = ids.sizes().vec();
  out_sizes.push_back(w.size(1));
  // Ids another rank holds gather a clamped row of ours, zeroed after: masks keep every size
  // fixed by the shapes (no data-dependent selection), as the allocation events need.
  std::optional<ShardIds> local;
  if (shard) local = shard_ids(ids, *shard, w.size(0));
  at::Tensor y = w.index_select(0, (local ? local->rows : ids).reshape({-1})).view(out_sizes);
  if (local) y.masked_fill_(local->foreign.unsqueeze(-1), 0);
  return {y, EmbeddingSaved{ids, shard}};
}

void embedding_backward(const at::Tensor& dy, const EmbeddingSaved& saved, at::Tensor& dw) {
  const trace::Scope trace_scope("embedding", trace::Category::backward);
  const int64_t C = dw.size(1);
  TORCH_CHECK(
      dy.dim() == saved.ids.dim() + 1 && dy.size(-1) == C && dy.sizes().slice(0, saved.ids.dim()) == saved.ids.sizes(),
      "[embedding] gradient must be ids' shape plus [", C, "], got dy ", dy.sizes(), " for ids ", saved.ids.sizes());
  std::optional<ShardIds> local;
  if (saved.shard) local = shard_ids(saved.ids, *saved.shard, dw.size(0));
  // Scatter-add straight into the accumulator: no [V, C] temporary. With a share, the rows of
  // other ranks' ids are zeroed in a copy (a cast one when dw is wider) and add nothing.
  at::Tensor rows = dy.reshape({-1, C}).to(dw.scalar_type(), /*non_blocking=*/false, /*copy=*/local.has_value());
  if (local) rows.masked_fill_(local->foreign.reshape({-1, 1}), 0);
  dw.index_add_(0, (local ? local->rows : saved.ids).reshape({-1}), rows);
}

int64_t embedding_saved_bytes(int64_t tokens) { return nbytes(tokens, at::kLong); }

Fwd<PositionEmbeddingSaved> position_embedding_forward(int64_t seq_len, const at::Tensor& w, int64_t first) {
  const trace::Scope trace_scope("position_embedding", trace::Category::forward);
  TORCH_CHECK(w.dim() == 2, "[position_embedding] weight must be [max_positions, channels], got ", w.sizes());
  TORCH_CHECK(seq_len >= 1 && first >= 0 && first + seq_len <= w.size(0), "[position_embedding] sequence length ",
              first + seq_len, " does not fit the model's context length of ", w.size(0),
              " positions; use sequences of at most ", w.size(0), " tokens");
  return {w.narrow(0, first, seq_len), PositionEmbeddingSaved{seq_len, first}};
}

void position_embedding_backward(const at::Tensor& dy, const PositionEmbeddingSaved& saved, at::Tensor& dw) {
  const trace::Scope trace_scope("position_embedding", trace::Category::backward);
  const int64_t T = saved.seq_len, C = dw.size(1);
  TORCH_CHECK(dy.dim() >= 2 && dy.size(-2) == T && dy.size(-1) == C, "[position_embedding] gradient must be [..., ", T,
              ", ", C, "], got ", dy.sizes());
  at::Tensor rows = dw.narrow(0, saved.first, T);
  accumulate(rows, dy.reshape({-1, T, C}).sum(0));
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::bytes_of;
using detail::flags;
using detail::stats_of;

// Inputs {ids [..., ] int64}; params {w [V, C]}; outputs {w's rows [..., C]}. The ids get no
// gradient; the backward scatter-adds into w's gradient. Sharded, w is this rank's
// [V/t, C] share of the tensor-parallel group's vocabulary: the output holds only its rows
// (zeros elsewhere) for the all-reduce node after it to sum.
class EmbeddingDef final : public OpDef {
 public:
  const char* kind() const override { return "embedding"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  bool writes_grads() const override { return false; }  // adds into the rows of the ids
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == 1 && in[0].dtype == at::kLong && p.size() == 1 && p[0].sizes.size() == 2,
                "[embedding] needs int64 ids and a weight [V, C]");
    std::vector<int64_t> sizes = in[0].sizes;
    sizes.push_back(p[0].sizes[1]);
    return {TensorInfo{sizes, p[0].dtype, {}}};
  }
  double flops(const std::vector<TensorInfo>&, const std::vector<TensorInfo>&, const Attrs&) const override {
    return 0.0;  // a gather
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0}); }
  bool differentiable(size_t) const override { return false; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs& a,
                                  const RunContext& ctx) const override {
    return {ops::embedding_forward(in[0], p[0], detail::vocab_shard(a, ctx, p[0].size(0))).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>& p,
                                   std::vector<at::Tensor*>& g, const Attrs& a, const RunContext& ctx) const override {
    ops::embedding_backward(dy[0], ops::EmbeddingSaved{in[0], detail::vocab_shard(a, ctx, p[0].size(0))}, *g[0]);
    return {at::Tensor()};
  }
  // The range check's two scalars die before the gathered rows are made; a share's ids
  // seen from it live until the rows are gathered and masked.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs& a) const override {
    const int64_t lo = e.temp(8), hi = e.temp(8);
    e.release(hi);
    e.release(lo);
    if (!a.sharded) {
      e.out(0);
      return;
    }
    const detail::ShardIdsEvents local = detail::shard_ids_events(e, in[0].numel());
    e.out(0);
    detail::release_shard_ids(e, local);
  }
  // Rows narrower than the gradient's dtype are cast before the scatter-add; a share's are
  // copied (and cast) to be masked, after its ids are seen from it.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>& out, const Attrs& a) const override {
    const at::ScalarType gd = stats_of(p[0].dtype);
    if (!a.sharded) {
      if (gd != p[0].dtype) e.release(e.temp(bytes_of(out[0].numel(), gd)));
      return;
    }
    const detail::ShardIdsEvents local = detail::shard_ids_events(e, in[0].numel());
    e.release(e.temp(bytes_of(out[0].numel(), gd)));
    detail::release_shard_ids(e, local);
  }
};

// Inputs {x [B, T, C]}; params {w [P, C]}; outputs {x + w[0:T]} (learned positions added
// to the token rows; sharded: x holds this rank's T of the group's T * ranks positions,
// and adds their rows). x's gradient is the output gradient itself; w's rows take its sum
// over the batch.
class PositionEmbeddingDef final : public detail::Elementwise {
  static int64_t first(int64_t T, const Attrs& a, const RunContext& ctx) { return a.sharded ? ctx.tp_rank() * T : 0; }

 public:
  PositionEmbeddingDef() : Elementwise("position_embedding", 1) {}
  TensorParallel tensor_parallel() const override { return TensorParallel::position_wise; }
  bool writes_grads() const override { return false; }  // adds into the rows of the positions
  // A rank adds the embeddings of its own positions.
  Attrs on_share(const Attrs& a, const std::vector<TensorInfo>&, int64_t, const std::string&) const override {
    return detail::sharded(a);
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs& a) const override {
    TORCH_CHECK(in.size() == 1 && in[0].sizes.size() == 3 && p.size() == 1 && p[0].sizes.size() == 2 &&
                    p[0].sizes[1] == in[0].sizes[2],
                "[position_embedding] needs x [B, T, C] and a weight [positions, C]");
    TORCH_CHECK(in[0].sizes[1] <= p[0].sizes[0], "The sequence has ", in[0].sizes[1], " tokens but the model has ",
                p[0].sizes[0], " positions (model.max_seq); use sequences of at most ", p[0].sizes[0], " tokens.");
    return Elementwise::infer(in, p, a);
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    return static_cast<double>(in[0].numel());
  }
  int grad_alias(size_t) const override { return 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs& a,
                                  const RunContext& ctx) const override {
    return {in[0] + ops::position_embedding_forward(in[0].size(1), p[0], first(in[0].size(1), a, ctx)).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>& g, const Attrs& a, const RunContext& ctx) const override {
    const int64_t T = dy[0].size(1);
    ops::position_embedding_backward(dy[0], ops::PositionEmbeddingSaved{T, first(T, a, ctx)}, *g[0]);
    return {dy[0]};
  }
  // The batch sum of the gradient [T, C], and its cast to the gradient's dtype when narrower.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    const int64_t rows = in[0].sizes[1] * in[0].sizes[2];
    const int64_t sum = e.temp(bytes_of(rows, in[0].dtype));
    if (stats_of(p[0].dtype) != in[0].dtype) e.release(e.temp(bytes_of(rows, stats_of(p[0].dtype))));
    e.release(sum);
  }
};

}  // namespace

const OpDef& op::embedding() {
  static const EmbeddingDef def;
  return def;
}

const OpDef& op::position_embedding() {
  static const PositionEmbeddingDef def;
  return def;
}

}  // namespace remat::graph
