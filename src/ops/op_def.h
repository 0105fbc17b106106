// Helpers shared by the op definitions (the graph's view of each op, remat/graph.h) and
// the tensor-parallel transform.
#pragma once

#include "remat/graph.h"
#include "remat/ops/vocab_shard.h"

#include <optional>

namespace remat::graph::detail {

/// n flags, true at the listed positions.
inline std::vector<bool> flags(size_t n, std::initializer_list<size_t> on) {
  std::vector<bool> f(n, false);
  for (size_t i : on) {
    if (i < n) f[i] = true;
  }
  return f;
}

/// Bytes of `numel` elements of `dtype`.
inline int64_t bytes_of(int64_t numel, at::ScalarType dtype) {
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

/// The element strides of `t` (a contiguous one's computed from its sizes).
inline std::vector<int64_t> strides_of(const TensorInfo& t) {
  if (!t.contiguous()) return t.strides;
  std::vector<int64_t> s(t.sizes.size(), 1);
  for (size_t i = s.size() - 1; i-- > 0;) s[i] = s[i + 1] * t.sizes[i + 1];
  return s;
}

/// Rows of a [..., C] tensor.
inline int64_t rows(const TensorInfo& t) { return t.numel() / t.sizes.back(); }

/// A double scalar tensor multiplied into a tensor of `dtype`: 8 bytes and their cast copy
/// (TensorIterator casts a 0-dim CPU operand like any other input).
inline void scalar_operand(Events& e, at::ScalarType dtype) {
  const int64_t s = e.temp(8), c = e.temp(bytes_of(1, dtype));
  e.release(c);
  e.release(s);
}

/// The dropout key of an attention node whose queries `q` are [B, T, Hq, D]. Sharded, this
/// rank holds query heads [rank Hq, (rank + 1) Hq) of the group's, so its mask is that
/// window of the one-process [B, Hq * ranks, T, T] mask.
inline ops::DropoutKey attention_key(const at::Tensor& q, const Attrs& a, const RunContext& ctx) {
  ops::DropoutKey k = ctx.key(a.site);
  if (a.sharded) {
    const int64_t Hq = q.size(2);
    k.first_in_dim1 = ctx.tp_rank() * Hq;
    k.dim1_global = Hq * ctx.tp_size();
  }
  return k;
}

/// The vocabulary rows a node's weight of `rows` rows holds: this rank's share of the
/// tensor-parallel group when the transform split it (Attrs::sharded), else none (it holds
/// the whole vocabulary).
inline std::optional<ops::VocabShard> vocab_shard(const Attrs& a, const RunContext& ctx, int64_t rows) {
  if (!a.sharded) return std::nullopt;
  return ops::VocabShard::of_rank(ctx.tp_rank(), ctx.tp_size(), rows);
}

/// What ops::shard_ids allocates for `n` ids: the shifted ids and the mask of foreign ones,
/// live until released, each made with its 8-byte scalar operand, and the second mask
/// the first is or-ed with.
struct ShardIdsEvents {
  int64_t rows, foreign;
};
inline ShardIdsEvents shard_ids_events(Events& e, int64_t n) {
  int64_t operand = e.temp(8);
  const int64_t rows = e.temp(bytes_of(n, at::kLong));
  e.release(operand);
  operand = e.temp(8);
  const int64_t foreign = e.temp(bytes_of(n, at::kBool));
  e.release(operand);
  operand = e.temp(8);
  const int64_t upper = e.temp(bytes_of(n, at::kBool));
  e.release(operand);
  e.release(upper);
  return {rows, foreign};
}
inline void release_shard_ids(Events& e, const ShardIdsEvents& s) {
  e.release(s.foreign);
  e.release(s.rows);
}

/// A rank's share of `size` split over `tp` ranks (the tensor-parallel transform), refused
/// with the node's name and `what` it splits when it does not divide.
inline int64_t tp_share(int64_t size, int64_t tp, const std::string& node, const char* what) {
  TORCH_CHECK(size % tp == 0, "Tensor parallelism over ", tp, " ranks splits the ", what, " of ", node, " (", size,
              ") into equal shares, but ", size, " is not a multiple of ", tp, "; choose parallel.tp dividing it.");
  return size / tp;
}

/// `a` marked Attrs::sharded: the on_share of an op told that it holds a rank's share.
inline Attrs sharded(Attrs a) {
  a.sharded = true;
  return a;
}

/// The dtype norms and losses compute statistics in (float32, float64 for float64).
inline at::ScalarType stats_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

/// An op whose output has its inputs' shape (they all share one) and the first input's
/// dtype, and whose forward and backward allocate just their results: each elementwise
/// op. Subclasses give the kernels and FLOPs, and override what differs.
class Elementwise : public OpDef {
 public:
  Elementwise(const char* kind, size_t inputs) : kind_(kind), inputs_(inputs) {}
  const char* kind() const override { return kind_; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == inputs_, "[", kind_, "] needs ", inputs_, " inputs, got ", in.size());
    for (const auto& i : in) TORCH_CHECK(i.sizes == in[0].sizes, "[", kind_, "] needs inputs of one shape");
    return {in[0].with_sizes(in[0].sizes)};
  }
  void forward_events(Events& e, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    e.out(0);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    for (size_t i = 0; i < in.size(); ++i) {
      if (differentiable(i) && grad_alias(i) < 0) e.out(static_cast<int64_t>(i));
    }
  }

 private:
  const char* kind_;
  size_t inputs_;
};

}  // namespace remat::graph::detail
