#include "remat/ops/embedding.h"

#include "remat/trace.h"

namespace remat::ops {

Fwd<EmbeddingSaved> embedding_forward(const at::Tensor& ids, const at::Tensor& w) {
  const trace::Scope trace_scope("embedding", trace::Category::forward);
  TORCH_CHECK(w.dim() == 2, "[embedding] weight must be [vocab, channels], got ", w.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "[embedding] token ids must be int64, got ",
              ids.scalar_type());
  const int64_t V = w.size(0);
  if (ids.numel() > 0) {
    auto [lo, hi] = at::aminmax(ids);
    const int64_t lo_v = lo.item<int64_t>(), hi_v = hi.item<int64_t>();
    TORCH_CHECK(lo_v >= 0 && hi_v < V, "[embedding] token ids must lie in [0, ", V,
                ") for a vocabulary of ", V, ", got ids in [", lo_v, ", ", hi_v, "]");
  }
  std::vector<int64_t> out_sizes = ids.sizes().vec();
  out_sizes.push_back(w.size(1));
  at::Tensor y = w.index_select(0, ids.reshape({-1})).view(out_sizes);
  return {y, EmbeddingSaved{ids}};
}

void embedding_backward(const at::Tensor& dy, const EmbeddingSaved& saved, at::Tensor& dw) {
  const trace::Scope trace_scope("embedding", trace::Category::backward);
  const int64_t C = dw.size(1);
  TORCH_CHECK(dy.dim() == saved.ids.dim() + 1 && dy.size(-1) == C &&
                  dy.sizes().slice(0, saved.ids.dim()) == saved.ids.sizes(),
              "[embedding] gradient must be ids' shape plus [", C, "], got dy ", dy.sizes(),
              " for ids ", saved.ids.sizes());
  // Scatter-add straight into the accumulator: no [V, C] temporary.
  dw.index_add_(0, saved.ids.reshape({-1}), dy.reshape({-1, C}).to(dw.scalar_type()));
}

int64_t embedding_saved_bytes(int64_t tokens) { return nbytes(tokens, at::kLong); }

Fwd<PositionEmbeddingSaved> position_embedding_forward(int64_t seq_len, const at::Tensor& w) {
  const trace::Scope trace_scope("position_embedding", trace::Category::forward);
  TORCH_CHECK(w.dim() == 2, "[position_embedding] weight must be [max_positions, channels], got ",
              w.sizes());
  TORCH_CHECK(seq_len >= 1 && seq_len <= w.size(0), "[position_embedding] sequence length ", seq_len,
              " does not fit the model's context length of ", w.size(0),
              " positions; use sequences of at most ", w.size(0), " tokens");
  return {w.narrow(0, 0, seq_len), PositionEmbeddingSaved{seq_len}};
}

void position_embedding_backward(const at::Tensor& dy, const PositionEmbeddingSaved& saved,
                                 at::Tensor& dw) {
  const trace::Scope trace_scope("position_embedding", trace::Category::backward);
  const int64_t T = saved.seq_len, C = dw.size(1);
  TORCH_CHECK(dy.dim() >= 2 && dy.size(-2) == T && dy.size(-1) == C,
              "[position_embedding] gradient must be [..., ", T, ", ", C, "], got ", dy.sizes());
  at::Tensor rows = dw.narrow(0, 0, T);
  accumulate(rows, dy.reshape({-1, T, C}).sum(0));
}

}  // namespace remat::ops
