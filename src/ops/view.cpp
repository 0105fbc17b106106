// Views: ops that move no data. `view` reshapes a contiguous tensor; `split` cuts the last
// dimension of a fused projection into per-head views ([B, T, heads, D]) without copying.
// Their backward reshapes the gradient back (view) or concatenates the parts (split).
#include "ops/op_def.h"

#include <ATen/TensorUtils.h>

#include <numeric>

namespace remat::graph {
namespace {

int64_t product(const std::vector<int64_t>& s, size_t n) {
  return std::accumulate(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n), int64_t{1}, std::multiplies<>());
}

// The sizes of a view whose input `from` lost a factor tp in one dimension (`split_from`
// its sizes now): the view's dimension that starts where that one starts (the last such,
// when dimensions of size 1 make several start there). Heads are the outer factor of the
// features they merge into, so a rank's heads are a block of them.
std::vector<int64_t> view_share(const std::vector<int64_t>& from, const std::vector<int64_t>& split_from,
                                std::vector<int64_t> to, int64_t tp, const std::string& node) {
  size_t k = 0;
  while (k < from.size() && from[k] == split_from[k]) ++k;
  TORCH_INTERNAL_ASSERT(k < from.size(), "[tensor_parallel] ", node, " reads a split value of unchanged shape");
  const int64_t before = product(from, k);
  for (size_t m = to.size(); m-- > 0;) {
    if (product(to, m) == before) {
      to[m] = detail::tp_share(to[m], tp, node, "viewed dimension");
      return to;
    }
  }
  TORCH_CHECK(false, "[tensor_parallel] the view ", node, " mixes the split dimension with the ones before it");
}

// Inputs {x}; attributes sizes and from (x's sizes); outputs {x viewed as sizes}.
class ViewDef final : public OpDef {
 public:
  const char* kind() const override { return ""; }
  TensorParallel tensor_parallel() const override { return TensorParallel::view; }
  Attrs on_share(const Attrs& a, const std::vector<TensorInfo>& in, int64_t tp,
                 const std::string& node) const override {
    Attrs s = a;
    s.from = in[0].sizes;
    s.sizes = view_share(a.from, s.from, a.sizes, tp, node);
    return s;
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    TORCH_CHECK(in.size() == 1 && in[0].with_sizes(a.sizes).numel() == in[0].numel() && in[0].contiguous() &&
                    a.from == in[0].sizes,
                "[view] needs a contiguous input of as many elements as the view");
    return {in[0].with_sizes(a.sizes)};
  }
  double flops(const std::vector<TensorInfo>&, const std::vector<TensorInfo>&, const Attrs&) const override {
    return 0.0;
  }
  int view_of(size_t) const override { return 0; }
  int grad_alias(size_t) const override { return 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs& a,
                                  const RunContext&) const override {
    return {in[0].view(a.sizes)};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs& a, const RunContext&) const override {
    return {dy[0].view(a.from)};
  }
  void forward_events(Events&, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {}
  void backward_events(Events&, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {}
};

// Inputs {x [B, T, (H1 + H2 + ...) D]}; attributes split_heads {H1, H2, ...} and head_dim;
// outputs {[B, T, Hi, D] strided views}.
class SplitDef final : public OpDef {
 public:
  const char* kind() const override { return ""; }
  TensorParallel tensor_parallel() const override { return TensorParallel::share_wise; }
  // A rank holds its share of each part's heads.
  Attrs on_share(const Attrs& a, const std::vector<TensorInfo>&, int64_t tp, const std::string& node) const override {
    Attrs s = a;
    for (auto& h : s.split_heads) h = detail::tp_share(h, tp, node, "heads");
    return s;
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    int64_t heads = 0;
    for (int64_t h : a.split_heads) heads += h;
    TORCH_CHECK(in.size() == 1 && in[0].sizes.size() == 3 && in[0].contiguous() && in[0].sizes[2] == heads * a.head_dim,
                "[split] needs a contiguous [B, T, heads x head_dim] input");
    const int64_t B = in[0].sizes[0], T = in[0].sizes[1], W = in[0].sizes[2];
    std::vector<TensorInfo> out;
    for (int64_t h : a.split_heads) out.push_back({{B, T, h, a.head_dim}, in[0].dtype, {T * W, W, a.head_dim, 1}});
    return out;
  }
  double flops(const std::vector<TensorInfo>&, const std::vector<TensorInfo>&, const Attrs&) const override {
    return 0.0;
  }
  int view_of(size_t) const override { return 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs& a,
                                  const RunContext&) const override {
    const int64_t B = in[0].size(0), T = in[0].size(1);
    std::vector<at::Tensor> out;
    int64_t offset = 0;
    for (int64_t h : a.split_heads) {
      out.push_back(in[0].narrow(-1, offset, h * a.head_dim).view({B, T, h, a.head_dim}));
      offset += h * a.head_dim;
    }
    return out;
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs& a, const RunContext&) const override {
    std::vector<at::Tensor> parts;
    for (const auto& d : dy) parts.push_back(d.reshape({d.size(0), d.size(1), -1}));
    return {at::cat(parts, -1)};
  }
  void forward_events(Events&, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {}
  void backward_events(Events& e, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    e.out(0);
  }
};

}  // namespace

const OpDef& op::view() {
  static const ViewDef def;
  return def;
}

const OpDef& op::split() {
  static const SplitDef def;
  return def;
}

}  // namespace remat::graph
