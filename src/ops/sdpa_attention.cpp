#include "remat/ops/sdpa_attention.h"

#include "ops/op_def.h"

#include "remat/trace.h"
#include "util/openblas.h"

#include <ATen/Parallel.h>

#ifdef REMAT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace remat::ops {

AttentionTiles sdpa_attention_blocks(int64_t seq) {
  const int64_t q = seq >= 768 ? 256 : seq >= 192 ? 64 : 32;
  return {std::min(q, seq), std::min<int64_t>(512, seq)};
}

int64_t cuda_multiprocessors() {
  // Read once: the cost model prices the sdpa node's events many times a plan.
  static const int64_t count = [] {
#ifdef REMAT_WITH_CUDA
    int device = 0, n = 0;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
      return static_cast<int64_t>(n);
    }
    (void)cudaGetLastError();  // no device: not a sticky error
#endif
    return int64_t{132};
  }();
  return count;
}

int64_t flash_key_splits(int64_t B, int64_t T, int64_t Hq, int64_t D, int64_t multiprocessors) {
  const int64_t key_block = D <= 64 ? 256 : D <= 128 ? 128 : 64;
  const int64_t key_blocks = (T + key_block - 1) / key_block, tiles = B * Hq * ((T + 63) / 64);
  const int64_t waves = kFlashStateOnDevice ? 2 * multiprocessors : multiprocessors;
  // In ATen's float arithmetic, so that the choice at the thresholds is its.
  if (static_cast<float>(tiles) >= 0.8f * static_cast<float>(waves)) return 1;
  const int64_t most = std::min({int64_t{128}, waves, key_blocks});
  const auto eligible = [&](int64_t s) { return s == 1 || (key_blocks + s - 1) / s != (key_blocks + s - 2) / (s - 1); };
  std::vector<float> efficiency(static_cast<size_t>(most), 0.f);
  float best = 0.f;
  for (int64_t s = 1; s <= most; ++s) {
    if (!eligible(s)) continue;
    const float n_waves = static_cast<float>(tiles * s) / static_cast<float>(waves);
    efficiency[s - 1] = n_waves / std::ceil(n_waves);
    best = std::max(best, efficiency[s - 1]);
  }
  for (int64_t s = 1; s <= most; ++s) {
    if (eligible(s) && efficiency[s - 1] >= 0.85 * best) return s;
  }
  return 1;
}

namespace {

#if REMAT_SDPA_BUILT
// ATen's kernels take [B, H, T, D] views of remat's [B, T, H, D] tensors.
at::Tensor heads_second(const at::Tensor& x) { return x.transpose(1, 2); }
#endif

void check_runs(const at::Tensor& q) {
  const std::string why = attention_refusal(Attention::sdpa, 0.0, q.is_cuda(), q.scalar_type(), q.size(-1));
  TORCH_CHECK(why.empty() && (q.is_cpu() || q.is_cuda()), "[sdpa_attention] ",
              why.empty() ? "runs on the CPU or CUDA, got " + q.device().str() : why);
}

}  // namespace

// The kernels read any strides whose last is 1, and return views of [B, T, H, D] memory
// where q's layout allows: each transposed back here.
Fwd<SdpaAttentionSaved> sdpa_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const trace::Scope trace_scope("sdpa_attention", trace::Category::forward);
  attention_dims("sdpa_attention", q, k, v);
  check_runs(q);
#if REMAT_SDPA_BUILT
  at::Tensor kernel_out, lse;
  if (q.is_cuda()) {
    // The flash kernel: grouped-query heads as they are, the log-sum-exp in float32.
    auto r = at::_scaled_dot_product_flash_attention(heads_second(q), heads_second(k), heads_second(v), 0.0,
                                                     /*is_causal=*/true);
    kernel_out = std::get<0>(r);
    lse = std::get<1>(r);
  } else {
    const util::SerialBlas serial_blas;  // the kernel multiplies its blocks inside its parallel region
    std::tie(kernel_out, lse) =
        at::_scaled_dot_product_flash_attention_for_cpu(heads_second(q), heads_second(k), heads_second(v), 0.0,
                                                        /*is_causal=*/true);
  }
  // The CPU kernel lays its output out like q (at::empty_like): a strided q's is [B, H, T, D].
  at::Tensor out = heads_second(kernel_out).contiguous();
  kernel_out = at::Tensor();
  return {out, SdpaAttentionSaved{q, k, v, out, heads_second(lse)}};
#else
  TORCH_CHECK(false, "[sdpa_attention] unreachable: check_runs refuses this build");
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
  check_runs(saved.q);
#if REMAT_SDPA_BUILT
  at::Tensor dq, dk, dv;
  if (saved.q.is_cuda()) {
    // Dense batches (no cumulative lengths) of T positions; without dropout the kernel reads
    // no random state, so the seed and offset are empty placeholders.
    const at::Tensor no_seed = at::empty({}, at::kLong), no_offset = at::empty({}, at::kLong);
    std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_backward(
        heads_second(dout), heads_second(saved.q), heads_second(saved.k), heads_second(saved.v),
        heads_second(saved.out), heads_second(saved.lse), at::Tensor(), at::Tensor(), d.T, d.T, 0.0,
        /*is_causal=*/true, no_seed, no_offset);
  } else {
    const util::SerialBlas serial_blas;
    std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        heads_second(dout), heads_second(saved.q), heads_second(saved.k), heads_second(saved.v),
        heads_second(saved.out), heads_second(saved.lse), 0.0, /*is_causal=*/true);
  }
  return {heads_second(dq), heads_second(dk), heads_second(dv)};
#else
  TORCH_CHECK(false, "[sdpa_attention] unreachable: check_runs refuses this build");
#endif
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::flags;
using ops::attention_refusal;

int64_t round_up(int64_t n, int64_t unit) { return (n + unit - 1) / unit * unit; }

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
    TORCH_CHECK(a.p == 0, "[sdpa_attention] ",
                attention_refusal(Attention::sdpa, a.p, false, in[0].dtype, in[0].sizes[3]));
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
    if (e.device() == at::kCUDA) return flash_forward_events(e, Flash(in));
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
    if (e.device() == at::kCUDA) return flash_backward_events(e, Flash(in));
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
  // The CUDA flash kernel's shapes: its head size rounded for its accumulators, its query
  // positions rounded to its 128-row blocks, and the key splits of its forward.
  struct Flash {
    int64_t B, T, Hq, Hkv, D, elem, rounded_D, rounded_T, splits;
    explicit Flash(const std::vector<TensorInfo>& in)
        : B(in[0].sizes[0]),
          T(in[0].sizes[1]),
          Hq(in[0].sizes[2]),
          Hkv(in[1].sizes[2]),
          D(in[0].sizes[3]),
          elem(detail::bytes_of(1, in[0].dtype)),
          rounded_D(round_up(D, D <= 128 ? 32 : 64)),
          rounded_T(round_up(T, 128)),
          splits(ops::flash_key_splits(B, T, Hq, D)) {}
  };
  // ATen's flash forward (mha_fwd): the output, laid out [B, T, H, D] whatever q's strides,
  // the float32 log-sum-exp, the split keys' partial results, then its random state (on the
  // device from LibTorch 2.10), all but the results freed on return.
  static void flash_forward_events(Events& e, const Flash& f) {
    e.out(0);
    e.out(1);
    std::vector<int64_t> temps;
    if (f.splits > 1) {
      temps.push_back(e.temp(f.splits * f.B * f.Hq * f.T * 4));
      temps.push_back(e.temp(f.splits * f.B * f.Hq * f.T * f.rounded_D * 4));
    }
    if (ops::kFlashStateOnDevice) {
      temps.push_back(e.temp(16));
      temps.push_back(e.temp(8));
    }
    for (int64_t t : temps) e.release(t);
  }
  // ATen's flash backward (mha_bwd, deterministic algorithms off; dO contiguous, as the
  // block's output projection gives it): dq, dk, dv, the row sums
  // of dO * O and dq's float32 accumulator at rounded sizes, and with grouped-query heads dk
  // and dv for every query head before their sum.
  static void flash_backward_events(Events& e, const Flash& f) {
    e.out(0);
    e.out(1);
    e.out(2);
    std::vector<int64_t> temps{e.temp(f.B * f.Hq * f.rounded_T * 4),
                               e.temp(f.B * f.rounded_T * f.Hq * f.rounded_D * 4)};
    if (f.Hkv != f.Hq) {
      temps.push_back(e.temp(f.B * f.T * f.Hq * f.D * f.elem));
      temps.push_back(e.temp(f.B * f.T * f.Hq * f.D * f.elem));
    }
    for (int64_t t : temps) e.release(t);
  }
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
