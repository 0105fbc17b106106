#include "remat/ops/tensor_parallel.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <fmt/format.h>

namespace remat::ops {

void all_reduce_in_place(at::Tensor& t, dist::Group& group, const std::string& what) {
  TORCH_CHECK(t.is_contiguous(), "[all_reduce] needs a contiguous tensor, got strides ", t.strides());
  const bool wide = t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
  std::vector<at::Tensor> one{wide ? t : t.to(at::kFloat)};
  group.all_reduce(one, dist::Reduce::sum, what);
  if (!wide) t.copy_(one[0]);
}

Fwd<TpSaved> tp_copy_forward(const at::Tensor& x) { return {x, TpSaved{}}; }

at::Tensor tp_copy_backward(at::Tensor dy, const TpSaved&, dist::Group& group, const std::string& what) {
  const trace::Scope trace_scope("all_reduce", trace::Category::backward);
  all_reduce_in_place(dy, group, what);
  return dy;
}

Fwd<TpSaved> tp_reduce_forward(at::Tensor x, const at::Tensor& bias, dist::Group& group, const std::string& what) {
  const trace::Scope trace_scope("all_reduce", trace::Category::forward);
  all_reduce_in_place(x, group, what);
  if (bias.defined()) x.add_(bias);
  return {x, TpSaved{}};
}

at::Tensor tp_reduce_backward(const at::Tensor& dy, const TpSaved&, at::Tensor* db) {
  if (db != nullptr && db->defined()) accumulate(*db, dy.reshape({-1, dy.size(-1)}).sum(0));
  return dy;
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::bytes_of;

// What a failure names: the collective, its node's layer.
std::string what_of(const char* collective, const RunContext& ctx) {
  return fmt::format("the tensor-parallel {} of layer {} (step {})", collective, ctx.layer, ctx.step + 1);
}

dist::Group& group_of(const RunContext& ctx, const char* kind) {
  TORCH_CHECK(ctx.tp != nullptr, "[", kind, "] runs in a tensor-parallel graph only, with the run's group");
  return *ctx.tp;
}

// The float32 copy a narrower tensor is reduced in (all_reduce_in_place).
void reduce_events(Events& e, const TensorInfo& t) {
  if (t.dtype == at::kFloat || t.dtype == at::kDouble) return;
  e.release(e.temp(bytes_of(t.numel(), at::kFloat)));
}

// Inputs {x}; outputs {x itself}. Its input gradient is the output gradient summed over
// the ranks, in place: each column-parallel consumer returns a new gradient (or the walk
// sums several into one), so no other reader shares that memory.
class TpCopyDef final : public detail::Elementwise {
 public:
  TpCopyDef() : Elementwise("tp_copy", 1) {}
  double flops(const std::vector<TensorInfo>&, const std::vector<TensorInfo>&, const Attrs&) const override {
    return 0.0;
  }
  int view_of(size_t) const override { return 0; }
  int grad_alias(size_t) const override { return 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs&,
                                  const RunContext&) const override {
    return {ops::tp_copy_forward(in[0]).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext& ctx) const override {
    return {ops::tp_copy_backward(dy[0], {}, group_of(ctx, kind()), what_of("gradient all-reduce", ctx))};
  }
  void forward_events(Events&, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {}
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    reduce_events(e, in[0]);
  }
};

// Inputs {x, a partial product}, parameters {} or {bias}; outputs {the sum over the ranks
// (+ bias)}, in x's memory.
class TpReduceDef final : public detail::Elementwise {
 public:
  TpReduceDef() : Elementwise("tp_reduce", 1) {}
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p, const Attrs&) const override {
    return p.empty() ? 0.0 : static_cast<double>(in[0].numel());
  }
  int view_of(size_t) const override { return 0; }
  int grad_alias(size_t) const override { return 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs&,
                                  const RunContext& ctx) const override {
    return {ops::tp_reduce_forward(in[0], p.empty() ? at::Tensor() : p[0], group_of(ctx, kind()),
                                   what_of("all-reduce", ctx))
                .out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext&) const override {
    return {ops::tp_reduce_backward(dy[0], {}, g.empty() ? nullptr : g[0])};
  }
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    reduce_events(e, in[0]);
  }
  // The bias gradient: a row sum, cast when the accumulator is wider.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    if (p.empty()) return;
    const at::ScalarType acc = detail::stats_of(in[0].dtype);
    const int64_t sum = e.temp(bytes_of(p[0].numel(), in[0].dtype));
    if (acc != in[0].dtype) e.release(e.temp(bytes_of(p[0].numel(), acc)));
    e.release(sum);
  }
};

}  // namespace

const OpDef& op::tp_copy() {
  static const TpCopyDef def;
  return def;
}

const OpDef& op::tp_reduce() {
  static const TpReduceDef def;
  return def;
}

}  // namespace remat::graph
