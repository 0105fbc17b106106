#include "remat/ops/sdpa_attention.h"

#include "ops/op_def.h"

#include "remat/trace.h"
#include "util/openblas.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace remat::ops {

AttentionTiles sdpa_attention_blocks(int64_t seq) {
  const int64_t q = seq >= 768 ? 256 : seq >= 192 ? 64 : 32;
  return {std::min(q, seq), std::min<int64_t>(512, seq)};
}

// The kernel takes [B, H, T, D] views (it reads any strides whose last is 1) and returns
// views of [B, T, H, D] memory where q's layout allows: each transposed back here.
Fwd<SdpaAttentionSaved> sdpa_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const trace::Scope trace_scope("sdpa_attention", trace::Category::forward);
  attention_dims("sdpa_attention", q, k, v);
  TORCH_CHECK(q.device().is_cpu(), "[sdpa_attention] ", attention_refusal(Attention::sdpa, 0.0, true));
#if REMAT_SDPA_BUILT
  const util::SerialBlas serial_blas;  // the kernel multiplies its blocks inside its parallel region
  auto [kernel_out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q.transpose(1, 2), k.transpose(1, 2),
                                                                           v.transpose(1, 2), 0.0, /*is_causal=*/true);
  // The kernel lays its output out like q (at::empty_like): a strided q's is [B, H, T, D].
  at::Tensor out = kernel_out.transpose(1, 2).contiguous();
  kernel_out = at::Tensor();
  return {out, SdpaAttentionSaved{q, k, v, out, lse.transpose(1, 2)}};
#else
  TORCH_CHECK(false, "[sdpa_attention] ", attention_refusal(Attention::sdpa, 0.0, false));
#endif
}

AttentionGrads sdpa_attention_backward(const at::Tensor& dout, const SdpaAttentionSaved& saved) {
  const trace::Scope trace_scope("sdpa_attention", trace::Category::backward);
  const AttentionDims d = attention_dims("sdpa_attention", saved.q, saved.k, saved.v);
  TORCH_CHECK(dout.sizes() == saved.q.sizes(), "[sdpa_attention] output gradient must match q's shape ",
              saved.q.sizes(), ", got ", dout.sizes());
  TORCH_CHECK(saved.out.sizes() == saved.q.sizes() && saved.lse.sizes() == at::IntArrayRef({d.B, d.T, d.Hq}) &&
                  saved.lse.scalar_type() == stats_dtype(saved.q.scalar_type()),
              "[sdpa_attention] the saved output must be [B, T, Hq, D] and the log-sum-exp [B, T, Hq] ",
              stats_dtype(saved.q.scalar_type()), ", got ", saved.out.sizes(), " and ", saved.lse.sizes(), " ",
              saved.lse.scalar_type());
#if REMAT_SDPA_BUILT
  const auto heads_second = [](const at::Tensor& x) { return x.transpose(1, 2); };
  const util::SerialBlas serial_blas;
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      heads_second(dout), heads_second(saved.q), heads_second(saved.k), heads_second(saved.v), heads_second(saved.out),
      heads_second(saved.lse), 0.0, /*is_causal=*/true);
  return {heads_second(dq), heads_second(dk), heads_second(dv)};
#else
  TORCH_CHECK(false, "[sdpa_attention] ", attention_refusal(Attention::sdpa, 0.0, false));
#endif
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::flags;

// Inputs {q, k, v} ([B, T, H, D], possibly strided; sharded: the rank's heads); outputs
// {out, lse}. Its backward reads q, k, v, out and lse: no [T x T] value exists.
class SdpaAttentionDef final : public OpDef {
 public:
  const char* kind() const override { return "attention"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::share_wise; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    TORCH_CHECK(in.size() == 3 && in[0].sizes.size() == 4 && in[1].sizes == in[2].sizes && in[1].sizes.size() == 4 &&
                    in[0].sizes[2] % in[1].sizes[2] == 0,
                "[sdpa_attention] needs q [B, T, Hq, D] and k, v [B, T, Hkv, D]");
    TORCH_CHECK(a.p == 0, "[sdpa_attention] ", attention_refusal(Attention::sdpa, a.p, false));
    const auto& q = in[0].sizes;
    return {in[0].with_sizes(q), TensorInfo{{q[0], q[1], q[2]}, ops::stats_dtype(in[0].dtype), {}}};
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs&) const override {
    const auto& q = in[0].sizes;
    return ops::tiled_attention_flops({q[0], q[1], q[2], in[1].sizes[2], q[3]}, 0.0, ops::sdpa_attention_blocks(q[1]));
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0, 1, 2}); }
  std::vector<bool> saves_outputs(const Attrs&, size_t n) const override { return flags(n, {0, 1}); }
  const char* output_name(size_t i) const override {
    static const char* const names[] = {"out", "lse"};
    return names[i];
  }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs&,
                                  const RunContext&) const override {
    auto r = ops::sdpa_attention_forward(in[0], in[1], in[2]);
    return {r.out, r.saved.lse};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext&) const override {
    auto g = ops::sdpa_attention_backward(dy[0], {in[0], in[1], in[2], out[0], out[1]});
    return {g.dq, g.dk, g.dv};
  }
  // Mirrors ATen's forward: the output (laid out like q, so a strided q's is copied to
  // [B, T, H, D] at the end) and the log-sum-exp, then each thread's block of scores,
  // row maxima and sums and output rows in the accumulation dtype (and of 16-bit scores).
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>& out, const Attrs&) const override {
    const Sizes z(in);
    const bool copied = output_copied(in[0]);
    const int64_t kernel_out = copied ? e.temp(out[0].bytes()) : -1;
    if (!copied) e.out(0);
    e.out(1);
    const int64_t buf = e.temp(z.threads * (z.q * z.k + 2 * z.q + z.q * z.D) * z.acc);
    const int64_t reduced = e.temp(z.threads * z.q * z.k * z.reduced);
    e.release(buf);
    e.release(reduced);
    if (copied) {
      e.out(0);
      e.release(kernel_out);
    }
  }
  // Mirrors ATen's backward: dq, dk, dv (zeroed, accumulated into), each thread's blocks of
  // probabilities and their gradient (and their 16-bit copies), and one block of row sums
  // per thread that takes a share of the B x Hkv heads.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    const Sizes z(in);
    e.out(0);
    e.out(1);
    e.out(2);
    const int64_t buf = e.temp(z.threads * 2 * z.q * z.k * z.acc);
    const int64_t reduced = e.temp(z.threads * 2 * z.q * z.k * z.reduced);
    std::vector<int64_t> sums;
    for (int64_t t = 0; t < std::min(z.threads, z.B * z.Hkv); ++t) sums.push_back(e.temp(z.q * z.acc));
    for (int64_t s : sums) e.release(s);
    e.release(buf);
    e.release(reduced);
  }

 private:
  // The kernel's block sizes and threads, and the bytes of an element it accumulates in and
  // of a 16-bit copy (0 for float32 and float64, which it does not copy).
  struct Sizes {
    int64_t B, Hkv, D, q, k, threads, acc, reduced;
    explicit Sizes(const std::vector<TensorInfo>& in)
        : B(in[0].sizes[0]),
          Hkv(in[1].sizes[2]),
          D(in[0].sizes[3]),
          q(ops::sdpa_attention_blocks(in[0].sizes[1]).q),
          k(ops::sdpa_attention_blocks(in[0].sizes[1]).k),
          threads(at::get_num_threads()),
          acc(detail::bytes_of(1, ops::stats_dtype(in[0].dtype))),
          reduced(c10::elementSize(in[0].dtype) == 2 ? detail::bytes_of(1, in[0].dtype) : 0) {}
  };
  // Whether the kernel's output, which at::empty_like lays out like q seen as [B, H, T, D],
  // is not [B, T, H, D] contiguous (q a strided view): decided by ATen on a meta tensor.
  static bool output_copied(const TensorInfo& q) {
    const at::Tensor meta =
        at::empty_strided(q.sizes, detail::strides_of(q), at::TensorOptions(at::kMeta).dtype(q.dtype));
    return !at::empty_like(meta.transpose(1, 2)).transpose(1, 2).is_contiguous();
  }
};

}  // namespace

const OpDef& op::sdpa_attention() {
  static const SdpaAttentionDef def;
  return def;
}

}  // namespace remat::graph
