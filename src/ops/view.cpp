// Views: ops that move no data. `view` reshapes a contiguous tensor; `split` cuts the last
// dimension of a fused projection into per-head views ([B, T, heads, D]) without copying.
// Their backward reshapes the gradient back (view) or concatenates the parts (split).
#include "ops/op_def.h"

#include <ATen/TensorUtils.h>

namespace remat::graph {
namespace {

// Inputs {x}; attributes sizes and from (x's sizes); outputs {x viewed as sizes}.
class ViewDef final : public OpDef {
 public:
  const char* kind() const override { return ""; }
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

std::vector<const OpDef*> op::all() {
  return {&layernorm(),
          &rmsnorm(),
          &linear(),
          &linears(),
          &attention(),
          &tiled_attention(),
          &sdpa_attention(),
          &dropout_mask(),
          &dropout(),
          &residual(),
          &gelu(),
          &swiglu(),
          &rope(),
          &view(),
          &split(),
          &embedding(),
          &position_embedding(),
          &cross_entropy(),
          &fused_cross_entropy(),
          &tp_copy(),
          &tp_reduce(),
          &sp_gather(),
          &sp_scatter()};
}

}  // namespace remat::graph
