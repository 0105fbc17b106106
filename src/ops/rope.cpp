#include "remat/ops/rope.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <cmath>

namespace remat::ops {
namespace {

// Rotates each (x1, x2) = (x[..., :D/2], x[..., D/2:]) pair by `sign` times the table angle:
//   out1 = x1 cos - sign x2 sin,  out2 = x2 cos + sign x1 sin.
at::Tensor rotate(const at::Tensor& x, const RopeTables& tables, double sign) {
  const int64_t T = x.size(1), half = x.size(3) / 2;
  const at::Tensor c = tables.cos.narrow(0, 0, T).view({1, T, 1, half});
  const at::Tensor s = tables.sin.narrow(0, 0, T).view({1, T, 1, half});
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor o1 = out.narrow(-1, 0, half), o2 = out.narrow(-1, half, half);
  at::mul_out(o1, x1, c).addcmul_(x2, s, -sign);
  at::mul_out(o2, x2, c).addcmul_(x1, s, sign);
  return out;
}

void check(const at::Tensor& x, const RopeTables& tables, const char* what) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "[rope] ", what, " must be [B, T, H, D] with D even, got ",
              x.sizes());
  TORCH_CHECK(tables.cos.dim() == 2 && tables.cos.sizes() == tables.sin.sizes() &&
                  tables.cos.size(1) * 2 == x.size(3) && tables.cos.size(0) >= x.size(1),
              "[rope] tables must be [>= T, D/2] for ", what, " ", x.sizes(), ", got cos ", tables.cos.sizes(),
              " and sin ", tables.sin.sizes());
}

// Llama 3's stretch of the frequencies: by `factor` where a wavelength exceeds
// original_max_seq / low_freq_factor, none below original_max_seq / high_freq_factor,
// blended linearly in original_max_seq / wavelength between.
at::Tensor scale_frequencies(const at::Tensor& inv_freq, const RopeScaling& s) {
  // original_max_seq / wavelength, with wavelength = 2 pi / inv_freq.
  const at::Tensor turns = inv_freq * (static_cast<double>(s.original_max_seq) / (2 * M_PI));
  const at::Tensor smooth = (turns - s.low_freq_factor).div_(s.high_freq_factor - s.low_freq_factor).clamp_(0.0, 1.0);
  return inv_freq * ((1.0 - smooth) / s.factor + smooth);
}

}  // namespace

RopeTables rope_tables(int64_t seq_len, int64_t head_dim, double theta, const RopeScaling& scaling,
                       at::ScalarType dtype, at::Device device) {
  TORCH_CHECK(seq_len >= 1 && head_dim >= 2 && head_dim % 2 == 0,
              "[rope] tables need seq_len >= 1 and an even head_dim, got seq_len ", seq_len, " and head_dim ",
              head_dim);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  // inv_freq[i] = theta^(-2i/D); angle[t, i] = t * inv_freq[i].
  at::Tensor inv_freq = at::pow(theta, at::arange(0, head_dim, 2, f64).div_(head_dim)).reciprocal_();
  if (scaling.scaled()) inv_freq = scale_frequencies(inv_freq, scaling);
  const at::Tensor angle = at::outer(at::arange(seq_len, f64), inv_freq);
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  return {angle.cos().to(opts), angle.sin().to(opts)};
}

int64_t rope_tables_bytes(int64_t seq_len, int64_t head_dim, at::ScalarType dtype) {
  return 2 * nbytes(seq_len * (head_dim / 2), dtype);
}

Fwd<RopeSaved> rope_forward(const at::Tensor& x, const RopeTables& tables) {
  const trace::Scope trace_scope("rope", trace::Category::forward);
  check(x, tables, "input");
  return {rotate(x, tables, 1.0), RopeSaved{}};
}

at::Tensor rope_backward(const at::Tensor& dy, const RopeSaved&, const RopeTables& tables) {
  const trace::Scope trace_scope("rope", trace::Category::backward);
  check(dy, tables, "gradient");
  // A rotation's transpose is the rotation by the opposite angle.
  return rotate(dy, tables, -1.0);
}

double rope_flops(int64_t numel) { return 3.0 * numel; }

}  // namespace remat::ops

namespace remat::graph {
namespace {

// Inputs {x [B, T, H, D]}; outputs {rotated x}; the tables come from the run context.
class RopeDef final : public detail::Elementwise {
 public:
  RopeDef() : Elementwise("rope", 1) {}
  TensorParallel tensor_parallel() const override { return TensorParallel::share_wise; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs& a) const override {
    TORCH_CHECK(in.size() == 1 && in[0].sizes.size() == 4 && in[0].sizes[3] % 2 == 0,
                "[rope] needs x [B, T, H, D] with D even");
    return Elementwise::infer(in, p, a);
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    return ops::rope_flops(in[0].numel());
  }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs&,
                                  const RunContext& ctx) const override {
    TORCH_INTERNAL_ASSERT(ctx.rope != nullptr, "rope needs the rotation tables");
    return {ops::rope_forward(in[0], *ctx.rope).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext& ctx) const override {
    return {ops::rope_backward(dy[0], {}, *ctx.rope)};
  }
};

}  // namespace

const OpDef& op::rope() {
  static const RopeDef def;
  return def;
}

}  // namespace remat::graph
