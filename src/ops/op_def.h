// Helpers shared by the op definitions (the graph's view of each op, remat/ops/op.h) and
// the tensor-parallel transform.
#pragma once

#include "remat/ops/op.h"
#include "remat/ops/common.h"
#include "remat/ops/vocab_shard.h"

#include <algorithm>
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

/// What ATen's CUDA sum over the rows of a contiguous [rows, cols] float32 (float64) tensor
/// allocates besides its result (Reduce.cuh): where each thread of a block would still sum
/// 256 rows or more and the blocks of columns leave the resident threads (taken as 2048 a
/// multiprocessor, as on the V100 to the H200) unfilled, setReduceConfig splits each column's
/// rows over ctas_per_output blocks, and gpu_reduce_kernel holds their partial sums
/// (global_memory_size) and a semaphore per block of columns through the launch. Inputs past
/// 2 GiB are summed by halves of the rows, one launch at a time (with_32bit_indexing); a
/// single column, a whole-tensor sum, is not modelled.
struct ReduceScratch {
  int64_t buffer = 0, semaphores = 0;
};
inline ReduceScratch cuda_column_sum_scratch(int64_t rows, int64_t cols, at::ScalarType dtype,
                                             int64_t multiprocessors) {
  const int64_t size = bytes_of(1, dtype);
  while (rows > 1 && rows * cols * size > (int64_t{1} << 31)) rows -= rows / 2;
  if (cols < 2) return {};
  const auto div_up = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const auto pow2_below = [](int64_t n) {
    int64_t p = 1;
    while (2 * p <= n) p *= 2;
    return p;
  };
  // get_output_vec_size, then set_block_dimension: a thread reads up to 4 adjacent columns.
  const int64_t vec = cols % 4 == 0 ? 4 : cols % 2 == 0 ? 2 : 1, threads = 512 / vec;
  const int64_t dim0 = std::min(pow2_below(cols / vec), threads), dim1 = std::min(pow2_below(rows), threads);
  int64_t width = std::min<int64_t>(dim0, 32);
  const int64_t height = std::min(dim1, threads / width);
  width = std::min(dim0, threads / height);
  if (rows < 16 * height && rows < 256) return {};  // each warp sums its own columns
  const int64_t per_thread = div_up(rows, height), grid = div_up(cols / vec, width);
  const int64_t target = multiprocessors * (2048 / (width * height));
  if (per_thread < 256 || grid > target) return {};
  const int64_t ctas = std::max(std::min(div_up(target, grid), div_up(per_thread, 16)), div_up(per_thread, 256));
  if (ctas < 2) return {};
  return {size * cols * ctas * width * vec, 4 * grid};
}

/// On CUDA: the scratch of such a sum, made and freed within its launch (nothing
/// elsewhere).
inline void cuda_column_sum_events(Events& e, int64_t rows, int64_t cols, at::ScalarType dtype) {
  if (e.device() != at::kCUDA) return;
  const ReduceScratch s = cuda_column_sum_scratch(rows, cols, dtype, ops::cuda_multiprocessors());
  if (s.buffer == 0) return;
  const int64_t buffer = e.temp(s.buffer), semaphores = e.temp(s.semaphores);
  e.release(semaphores);
  e.release(buffer);
}

/// A bias gradient: the row sum of `dy` (the linear's and the tensor-parallel ops'), cast
/// when the accumulator is wider. On CUDA a float32 (float64) sum is the column sum above;
/// narrower rows ATen vectorizes and accumulates otherwise, which is not modelled.
inline void bias_grad_events(Events& e, const TensorInfo& dy, const TensorInfo& bias) {
  const at::ScalarType acc = stats_of(dy.dtype);
  const int64_t sum = e.temp(bytes_of(bias.numel(), dy.dtype));
  if (acc == dy.dtype) cuda_column_sum_events(e, dy.numel() / dy.sizes.back(), bias.numel(), acc);
  if (acc != dy.dtype) e.release(e.temp(bytes_of(bias.numel(), acc)));
  e.release(sum);
}

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
