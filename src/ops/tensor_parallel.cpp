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

at::Tensor tp_reduce_backward(const at::Tensor& dy, const TpSaved&, at::Tensor* db, GradInto into) {
  if (db != nullptr && db->defined()) accumulate(*db, dy.reshape({-1, dy.size(-1)}).sum(0), into);
  return dy;
}

at::Tensor gather_positions(const at::Tensor& x, dist::Group& group, const std::string& what) {
  TORCH_CHECK(x.dim() >= 2 && x.is_contiguous(), "[sp_gather] needs a contiguous tensor of 2 dimensions or more, got ",
              x.sizes());
  // Bytes: Gloo gathers no bfloat16, and the bytes of every dtype arrive unchanged.
  return group.all_gather(x.view(at::kByte), 1, what).view(x.scalar_type());
}

at::Tensor reduce_scatter_positions(at::Tensor x, dist::Group& group, const std::string& what) {
  TORCH_CHECK(x.dim() >= 2 && x.size(1) % group.size() == 0, "[sp_scatter] needs dimension 1 of ", x.sizes(),
              " divisible by the ", group.size(), " ranks");
  all_reduce_in_place(x, group, what);
  const int64_t n = x.size(1) / group.size();
  // A copy even where the slice is contiguous (one sequence): a view would hold on to the
  // whole sum.
  return x.narrow(1, group.rank() * n, n).clone();
}

at::Tensor share_of_elements(const at::Tensor& x, dist::Group& group) {
  const int64_t n = x.numel() / group.size();
  TORCH_CHECK(x.is_contiguous() && n * group.size() == x.numel(),
              "[share_of_elements] needs a contiguous tensor whose ", x.numel(), " elements divide over ", group.size(),
              " ranks, got ", x.sizes());
  return x.view({1, -1}).narrow(1, group.rank() * n, n).clone();
}

at::Tensor gather_elements(const at::Tensor& share, at::IntArrayRef sizes, dist::Group& group,
                           const std::string& what) {
  // A [1, n] row gathered along its positions is the ranks' runs in rank order.
  return gather_positions(share, group, what).view(sizes);
}

Fwd<TpSaved> sp_gather_forward(const at::Tensor& x, dist::Group& group, const std::string& what) {
  const trace::Scope trace_scope("all_gather", trace::Category::forward);
  return {gather_positions(x, group, what), TpSaved{}};
}

at::Tensor sp_gather_backward(at::Tensor dy, const TpSaved&, dist::Group& group, const std::string& what) {
  const trace::Scope trace_scope("reduce_scatter", trace::Category::backward);
  return reduce_scatter_positions(std::move(dy), group, what);
}

Fwd<TpSaved> sp_scatter_forward(at::Tensor x, const at::Tensor& bias, dist::Group& group, const std::string& what) {
  const trace::Scope trace_scope("reduce_scatter", trace::Category::forward);
  at::Tensor y = reduce_scatter_positions(std::move(x), group, what);
  if (bias.defined()) y.add_(bias);
  return {y, TpSaved{}};
}

at::Tensor sp_scatter_backward(const at::Tensor& dy, const TpSaved&, at::Tensor* db, dist::Group& group,
                               const std::string& what, GradInto into) {
  if (db != nullptr && db->defined()) accumulate(*db, dy.reshape({-1, dy.size(-1)}).sum(0), into);
  const trace::Scope trace_scope("all_gather", trace::Category::backward);
  return gather_positions(dy, group, what);
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

// What a sum of `t` over the ranks sends, as all_reduce_in_place runs it over Gloo: an
// all-reduce in float32 (float64 for float64), a reduce-scatter too (Gloo in 1.13 has none).
LinkTraffic sum_link(const TensorInfo& t, int64_t tp) {
  return LinkTraffic::all_reduce(bytes_of(t.numel(), detail::stats_of(t.dtype)), tp);
}

// reduce_scatter_positions of `whole` into result `index`: the reduction, then the copy.
void scatter_events(Events& e, const TensorInfo& whole, int64_t index) {
  reduce_events(e, whole);
  e.out(index);
}

// The shapes of the sequence-parallel collectives: the output's sizes are the attribute
// `sizes` (the transform knows the group's size; the op does not until it runs), equal to
// the input's but in dimension 1, which `gathers` (or scatters) by a whole factor.
std::vector<TensorInfo> positions_infer(const char* kind, const std::vector<TensorInfo>& in, const Attrs& a,
                                        bool gathers) {
  TORCH_CHECK(in.size() == 1 && in[0].sizes.size() >= 2 && a.sizes.size() == in[0].sizes.size(), "[", kind,
              "] needs one input of 2 dimensions or more and its output's sizes, got ", in.size(), " inputs");
  const int64_t from = in[0].sizes[1], to = a.sizes[1];
  bool same = true;
  for (size_t d = 0; d < a.sizes.size(); ++d) same = same && (d == 1 || a.sizes[d] == in[0].sizes[d]);
  TORCH_CHECK(same && from > 0 && to > 0 && (gathers ? to % from : from % to) == 0, "[", kind, "] cannot ",
              gathers ? "gather " : "scatter ", in[0].sizes, " to ", a.sizes);
  return {in[0].with_sizes(a.sizes)};
}

// Inputs {x}; outputs {x itself}. Its input gradient is the output gradient summed over
// the ranks, in place: each column-parallel consumer returns a new gradient (or the walk
// sums several into one), so no other reader shares that memory.
class TpCopyDef final : public detail::Elementwise {
 public:
  TpCopyDef() : Elementwise("tp_copy", 1) {}
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  LinkTraffic backward_link(const std::vector<TensorInfo>&, const std::vector<TensorInfo>& out, const Attrs&,
                            int64_t tp) const override {
    return sum_link(out[0], tp);
  }
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
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  LinkTraffic forward_link(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&,
                           int64_t tp) const override {
    return sum_link(in[0], tp);
  }
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
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext& ctx) const override {
    return {ops::tp_reduce_backward(dy[0], {}, g.empty() ? nullptr : g[0], ctx.grads)};
  }
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    reduce_events(e, in[0]);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    if (!p.empty()) detail::bias_grad_events(e, in[0], p[0]);
  }
};

// Inputs {x, a rank's positions}; attribute sizes (the output's); outputs {every rank's
// positions}. Its backward sums the output gradient over the ranks and keeps the rank's
// positions: each column-parallel consumer returns a new gradient no one else reads.
class SpGatherDef final : public OpDef {
 public:
  const char* kind() const override { return "sp_gather"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  LinkTraffic forward_link(const std::vector<TensorInfo>&, const std::vector<TensorInfo>& out, const Attrs&,
                           int64_t tp) const override {
    return LinkTraffic::gather(out[0].bytes(), tp);
  }
  LinkTraffic backward_link(const std::vector<TensorInfo>&, const std::vector<TensorInfo>& out, const Attrs&,
                            int64_t tp) const override {
    return sum_link(out[0], tp);
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    return positions_infer(kind(), in, a, true);
  }
  double flops(const std::vector<TensorInfo>&, const std::vector<TensorInfo>&, const Attrs&) const override {
    return 0.0;
  }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs&,
                                  const RunContext& ctx) const override {
    return {ops::sp_gather_forward(in[0], group_of(ctx, kind()), what_of("all-gather", ctx)).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext& ctx) const override {
    return {ops::sp_gather_backward(dy[0], {}, group_of(ctx, kind()), what_of("gradient reduce-scatter", ctx))};
  }
  void forward_events(Events& e, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>& out, const Attrs&) const override {
    all_gather_events(e, out[0].bytes(), 0);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>& out, const Attrs&) const override {
    scatter_events(e, out[0], 0);
  }
};

// Inputs {x, a partial product of every position}, parameters {} or {bias}; attribute
// sizes (the output's); outputs {the sum over the ranks at this rank's positions (+ bias)}.
class SpScatterDef final : public OpDef {
 public:
  const char* kind() const override { return "sp_scatter"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  LinkTraffic forward_link(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&,
                           int64_t tp) const override {
    return sum_link(in[0], tp);
  }
  LinkTraffic backward_link(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&,
                            int64_t tp) const override {
    return LinkTraffic::gather(in[0].bytes(), tp);
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    return positions_infer(kind(), in, a, false);
  }
  double flops(const std::vector<TensorInfo>&, const std::vector<TensorInfo>& p, const Attrs& a) const override {
    return p.empty() ? 0.0 : static_cast<double>(TensorInfo{a.sizes, at::kFloat, {}}.numel());
  }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs&,
                                  const RunContext& ctx) const override {
    return {ops::sp_scatter_forward(in[0], p.empty() ? at::Tensor() : p[0], group_of(ctx, kind()),
                                    what_of("reduce-scatter", ctx))
                .out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext& ctx) const override {
    return {ops::sp_scatter_backward(dy[0], {}, g.empty() ? nullptr : g[0], group_of(ctx, kind()),
                                     what_of("gradient all-gather", ctx), ctx.grads)};
  }
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    scatter_events(e, in[0], 0);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>& out, const Attrs&) const override {
    if (!p.empty()) detail::bias_grad_events(e, out[0], p[0]);
    all_gather_events(e, in[0].bytes(), 0);
  }
};

}  // namespace

void all_gather_events(Events& e, int64_t whole, int64_t index) {
  const int64_t parts = e.temp(whole);
  e.release(e.temp(whole));
  e.out(index);
  e.release(parts);
}

const OpDef& op::tp_copy() {
  static const TpCopyDef def;
  return def;
}

const OpDef& op::tp_reduce() {
  static const TpReduceDef def;
  return def;
}

const OpDef& op::sp_gather() {
  static const SpGatherDef def;
  return def;
}

const OpDef& op::sp_scatter() {
  static const SpScatterDef def;
  return def;
}

}  // namespace remat::graph
