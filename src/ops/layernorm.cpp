#include "remat/ops/layernorm.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace remat::ops {
namespace {

// CPU kernels keep half/bfloat16 statistics in the input dtype, but the contract keeps them
// in float32, so reduced precision on CPU is normalised in float32. Elsewhere the native
// kernels already accumulate in float32 and return float32 statistics.
at::ScalarType compute_dtype(const at::Tensor& x) {
  return x.is_cpu() ? stats_dtype(x.scalar_type()) : x.scalar_type();
}

}  // namespace

Fwd<LayerNormSaved> layernorm_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  const trace::Scope trace_scope("layernorm", trace::Category::forward);
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && b.dim() == 1 && w.size(0) == x.size(-1) && b.size(0) == x.size(-1),
              "[layernorm] weight and bias must be [C] for input [..., C], got x ", x.sizes(), ", w ", w.sizes(),
              " and b ", b.sizes());
  const int64_t C = x.size(-1);
  const at::ScalarType ct = compute_dtype(x);
  auto [y, mean, rstd] = at::native_layer_norm(x.to(ct), {C}, w.to(ct), b.to(ct), eps);
  TORCH_INTERNAL_ASSERT(mean.scalar_type() == stats_dtype(x.scalar_type()), "layer norm statistics came back in ",
                        mean.scalar_type());
  // The kernel's statistics are [..., 1]; the Saved fields are documented as [...].
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  return {y.to(x.scalar_type()), LayerNormSaved{x, mean.view(rows), rstd.view(rows)}};
}

at::Tensor layernorm_backward(const at::Tensor& dy, const LayerNormSaved& saved, const at::Tensor& w, at::Tensor& dw,
                              at::Tensor& db, GradInto into) {
  const trace::Scope trace_scope("layernorm", trace::Category::backward);
  const at::Tensor& x = saved.x;
  TORCH_CHECK(dy.sizes() == x.sizes(), "[layernorm] gradient must match the input shape ", x.sizes(), ", got ",
              dy.sizes());
  const at::ScalarType ct = compute_dtype(x);
  const at::Tensor wc = w.to(ct);
  // The bias values play no part in the gradients; the kernel only needs a [C] tensor to
  // shape db, so the weight stands in for it.
  auto [dx, dw_rows, db_rows] =
      at::native_layer_norm_backward(dy.to(ct), x.to(ct), {x.size(-1)}, saved.mean.unsqueeze(-1),
                                     saved.rstd.unsqueeze(-1), wc, wc, {true, true, true});
  accumulate(dw, dw_rows, into);
  accumulate(db, db_rows, into);
  return dx.to(x.scalar_type());
}

int64_t layernorm_saved_bytes(int64_t rows, int64_t C, at::ScalarType dtype) {
  return nbytes(rows * C, dtype) + 2 * nbytes(rows, stats_dtype(dtype));
}

double layernorm_flops(int64_t rows, int64_t C) { return 8.0 * rows * C; }

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::bytes_of;
using detail::flags;
using detail::rows;
using detail::stats_of;

// The backward kernel's per-thread partial sums of the weight and bias gradients.
int64_t partials(int64_t C, at::ScalarType ct) { return bytes_of(2 * at::get_num_threads() * C, ct); }

// Rows of the CUDA backward's partial weight and bias gradients, as ATen's
// LaunchGammaBetaBackwardCUDAKernel splits them: past 64Ki rows with C / 32 below half the
// multiprocessors, one row of partial sums per 32 rows, at most 32Ki / ceil(C / 32);
// otherwise none (the kernel sums straight into dgamma and dbeta).
int64_t cuda_partial_rows(int64_t M, int64_t C, int64_t multiprocessors) {
  constexpr int64_t kBlockX = 32, kRowsPerBlock = 32;
  if (M <= 64 * 1024 || C / kBlockX >= multiprocessors / 2) return 0;
  const int64_t blocks_x = (C + kBlockX - 1) / kBlockX;
  return std::min((32 * 1024) / blocks_x, (M + kRowsPerBlock - 1) / kRowsPerBlock);
}

// Inputs {x}, parameters {weight, bias}; outputs {y, mean, rstd}.
class LayerNormDef final : public OpDef {
 public:
  const char* kind() const override { return "layernorm"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::position_wise; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs&) const override {
    TORCH_CHECK(in.size() == 1 && p.size() == 2 && p[0].sizes == std::vector<int64_t>{in[0].sizes.back()},
                "[layernorm] needs x [..., C] and weight, bias [C]");
    std::vector<int64_t> r(in[0].sizes.begin(), in[0].sizes.end() - 1);
    const TensorInfo stats{r, stats_of(in[0].dtype), {}};
    return {in[0].with_sizes(in[0].sizes), stats, stats};
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    return ops::layernorm_flops(rows(in[0]), in[0].sizes.back());
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0}); }
  std::vector<bool> saves_outputs(const Attrs&, size_t n) const override { return flags(n, {1, 2}); }
  const char* output_name(size_t i) const override { return i == 0 ? "out" : i == 1 ? "mean" : "rstd"; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs& a,
                                  const RunContext&) const override {
    auto r = ops::layernorm_forward(in[0], p[0], p[1], a.eps);
    return {r.out, r.saved.mean, r.saved.rstd};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& p,
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext& ctx) const override {
    return {ops::layernorm_backward(dy[0], ops::LayerNormSaved{in[0], out[1], out[2]}, p[0], *g[0], *g[1], ctx.grads)};
  }
  // CPU: the kernel normalises a contiguous float32 (float64) copy of a narrower or strided
  // x, with float32 copies of the parameters, and returns its output cast back. CUDA: it
  // normalises x in its own dtype (a copy only when strided), statistics in float32.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    const at::ScalarType ct = stats_of(in[0].dtype);
    const bool cast = ct != in[0].dtype && e.device() != at::kCUDA;
    const int64_t n = in[0].numel(), C = in[0].sizes.back();
    if (!cast) {
      const int64_t copy = in[0].contiguous() ? -1 : e.temp(in[0].bytes());
      e.out(0);
      e.out(1);
      e.out(2);
      if (copy >= 0) e.release(copy);
      return;
    }
    const int64_t x = e.temp(bytes_of(n, ct)), w = e.temp(bytes_of(C, ct)), b = e.temp(bytes_of(C, ct));
    const int64_t y = e.temp(bytes_of(n, ct));
    e.out(1);
    e.out(2);
    for (int64_t t : {b, w, x}) e.release(t);  // the call's argument copies
    e.out(0);
    e.release(y);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    if (e.device() == at::kCUDA) return cuda_backward_events(e, in[0]);
    const at::ScalarType ct = stats_of(in[0].dtype);
    const int64_t n = in[0].numel(), C = in[0].sizes.back();
    if (ct == in[0].dtype) {
      const int64_t copy = in[0].contiguous() ? -1 : e.temp(in[0].bytes());
      e.out(0);
      const int64_t dw = e.temp(bytes_of(C, ct)), db = e.temp(bytes_of(C, ct));
      e.release(e.temp(partials(C, ct)));
      e.release(dw);
      e.release(db);
      if (copy >= 0) e.release(copy);
      return;
    }
    const int64_t w = e.temp(bytes_of(C, ct)), dy = e.temp(bytes_of(n, ct)), x = e.temp(bytes_of(n, ct));
    const int64_t dx = e.temp(bytes_of(n, ct)), dw = e.temp(bytes_of(C, ct)), db = e.temp(bytes_of(C, ct));
    e.release(e.temp(partials(C, ct)));
    e.release(x);
    e.release(dy);
    e.release(dw);
    e.release(db);
    e.out(0);
    e.release(dx);
    e.release(w);
  }

 private:
  // ATen's CUDA backward (layer_norm_backward_cuda) in x's dtype: a contiguous copy of a
  // strided x, dx, dgamma and dbeta, the partial sums of large inputs (cuda_partial_rows)
  // summed into new dgamma and dbeta; then the float32 accumulators take widened copies of
  // a narrower dtype's dgamma and dbeta.
  static void cuda_backward_events(Events& e, const TensorInfo& x) {
    const at::ScalarType f = x.dtype, sd = stats_of(f);
    const int64_t C = x.sizes.back();
    const int64_t copy = x.contiguous() ? -1 : e.temp(x.bytes());
    e.out(0);
    int64_t dw = e.temp(bytes_of(C, f)), db = e.temp(bytes_of(C, f));
    if (const int64_t partial = cuda_partial_rows(rows(x), C, ops::cuda_multiprocessors()); partial > 0) {
      const int64_t dw_rows = e.temp(bytes_of(partial * C, f)), db_rows = e.temp(bytes_of(partial * C, f));
      for (int64_t* sum : {&dw, &db}) {  // each sum replaces the kernel's empty gradient
        const int64_t replaced = *sum;
        *sum = e.temp(bytes_of(C, f));
        e.release(replaced);
      }
      e.release(db_rows);
      e.release(dw_rows);
    }
    if (copy >= 0) e.release(copy);
    if (sd != f) {
      for (int i = 0; i < 2; ++i) e.release(e.temp(bytes_of(C, sd)));
    }
    e.release(dw);
    e.release(db);
  }
};

}  // namespace

const OpDef& op::layernorm() {
  static const LayerNormDef def;
  return def;
}

}  // namespace remat::graph
