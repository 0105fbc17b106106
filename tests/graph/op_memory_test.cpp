// Every op definition's declared allocations equal what its kernels allocate: for forward
// and backward, several shapes, float32 and bfloat16, with and without dropout, contiguous
// and strided inputs, sharded over a tensor-parallel group or not, the peak above the start
// and the bytes retained that the tracking allocator measures equal the replay of the op's
// events. The cost model is exact because each op is; an op without cases here fails the
// coverage check. Where a GPU is, the same cases run on it against the bytes requested from
// the caching allocator: what the CUDA kernels allocate otherwise than the declared events,
// op by op (scripts/gpu-check.sh).
#include "remat/graph.h"
#include "remat/memory.h"
#include "remat/ops/sdpa_attention.h"
#include "util/local_group.h"
#include "util/sdpa.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <array>
#include <cmath>
#include <map>
#include <optional>
#include <set>

namespace remat::graph {
namespace {

using testing::AbsentPeers;

struct Case {
  std::string name;
  const OpDef* op;
  std::vector<TensorInfo> in;
  std::vector<std::vector<int64_t>> params;
  Attrs attrs;
  std::optional<at::ScalarType> dtype = {};  ///< parameters'; default: the first input's
  dist::Group* tp = nullptr;                 ///< RunContext::tp (sharded ops)
};

// Peak above the start and bytes left at the end of a replay of `e`; results not views
// take the given bytes, and every allocation rounds up to a multiple of `block` (1: none).
std::pair<int64_t, int64_t> replay(const Events& e, const std::vector<int64_t>& result_bytes, int64_t block = 1) {
  const auto rounded = [block](int64_t b) { return (b + block - 1) / block * block; };
  int64_t current = 0, peak = 0;
  std::map<int64_t, int64_t> temps;
  for (const auto& ev : e.list()) {
    using K = Events::Event::Kind;
    if (ev.kind == K::out) current += rounded(result_bytes.at(ev.index));
    if (ev.kind == K::temp) {
      temps[ev.handle] = rounded(ev.bytes);
      current += temps[ev.handle];
    }
    if (ev.kind == K::release) current -= temps.at(ev.handle);
    peak = std::max(peak, current);
  }
  return {peak, current};
}

// Ids and targets are drawn below this (every vocabulary in the cases is larger).
constexpr int64_t kIds = 7;

// A tensor of `info`'s shape, dtype and strides on `device`, drawn on the CPU (a strided
// one is a slice of a wider one).
at::Tensor make(const TensorInfo& info, at::Generator& gen, at::Device device) {
  if (info.dtype == at::kBool) return (at::rand(info.sizes, gen) > 0.3).to(device);
  if (info.dtype == at::kLong) return at::randint(0, kIds, info.sizes, gen).to(device);  // token ids, targets
  if (info.contiguous()) return at::randn(info.sizes, gen).to(device, info.dtype);
  // Strides of a split view: [B, T, ...] inside [B, T, W] rows.
  const int64_t W = info.strides[1];
  at::Tensor wide = at::randn({info.sizes[0], info.sizes[1], W}, gen).to(device, info.dtype);
  return wide.narrow(-1, 0, info.numel() / (info.sizes[0] * info.sizes[1])).view(info.sizes);
}

struct Measured {
  int64_t peak = 0, retained = 0;
};

// The caching allocator hands out blocks of multiples of 512 bytes.
constexpr int64_t kCudaBlock = 512;

// Bytes in use on `device` and their peak since memory::reset_peak. On CUDA, the bytes
// requested: the caching allocator rounds each request up to its blocks and hands out a
// whole block whose rest it would not split off (at most 1 MiB of a large one), rules of
// the allocator that the cost model applies (memory::CachingAllocator), not the op's.
memory::Stats in_use(at::Device device) {
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda()) {
    const auto requested = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).requested_bytes[0];
    memory::Stats s;
    s.current = requested.current;
    s.peak = requested.peak;
    return s;
  }
#endif
  return memory::stats(device);
}

void check(const Case& c, at::Device device = at::kCPU) {
  SCOPED_TRACE(c.name);
  const bool cuda = device.is_cuda();
  if (!cuda) {
    memory::install_cpu_tracking();
    at::set_num_threads(1);
  }
  auto gen = at::detail::createCPUGenerator(17);
  const at::ScalarType dtype = c.dtype ? *c.dtype : c.in.empty() ? at::kFloat : c.in[0].dtype;
  std::vector<TensorInfo> pinfo;
  std::vector<at::Tensor> params, grads;
  for (const auto& s : c.params) {
    pinfo.push_back({s, dtype, {}});
    params.push_back(at::randn(s, gen).to(device, dtype));
    grads.push_back(at::zeros(s, at::TensorOptions(device).dtype(at::kFloat)));
  }
  const auto out_info = c.op->infer(c.in, pinfo, c.attrs);
  std::vector<at::Tensor> in;
  for (const auto& i : c.in) in.push_back(make(i, gen, device));
  RunContext ctx;
  ctx.layer = 1;
  ctx.tp = c.tp;
  ctx.device = device;
  // Tables for the rotation's head size (only the rope op reads them).
  const ops::RopeTables tables =
      ops::rope_tables(64, c.op == &op::rope() ? c.in[0].sizes.back() : 2, 10000.0, {}, dtype, device);
  ctx.rope = &tables;

  // Forward.
  std::vector<int64_t> out_bytes;
  int64_t new_bytes = 0;
  for (size_t j = 0; j < out_info.size(); ++j) {
    out_bytes.push_back(out_info[j].bytes());
    if (c.op->view_of(j) < 0) new_bytes += out_info[j].bytes();
  }
  Events fe(device.type());
  c.op->forward_events(fe, c.in, pinfo, out_info, c.attrs);
  int64_t before = in_use(device).current;
  memory::reset_peak(device);
  std::vector<at::Tensor> out = c.op->forward(in, params, c.attrs, ctx);
  const Measured fwd{in_use(device).peak - before, in_use(device).current - before};
  const auto [fpeak, fleft] = replay(fe, out_bytes);
  // A bfloat16 GEMM (linear, the loss's logits) runs ATen's blocked CPU kernel, whose packing
  // buffers depend on the blocking of each shape, and so does a bfloat16 batched product of
  // strided blocks (the math attention's: oneDNN copies them where the CPU has AVX-512):
  // what the op declares is every tensor it makes itself, a lower bound of the measured
  // peak (README: what the cost model leaves out).
  const bool blocked_gemm = !cuda &&
                            (c.op == &op::linear() || c.op == &op::linears() || c.op == &op::cross_entropy() ||
                             c.op == &op::fused_cross_entropy() || c.op == &op::attention()) &&
                            c.in[0].dtype == at::kBFloat16;
  // So do the sdpa kernel's bfloat16 block products: oneDNN allocates their scratch (tens
  // of KiB) through the c10 allocator by the CPU's instruction set, in the backward, and in
  // the forward too where the CPU multiplies bfloat16 tiles (AMX).
  const bool blocked_sdpa = c.op == &op::sdpa_attention() && c.in[0].dtype == at::kBFloat16;
  const bool blocked_backward = blocked_gemm || blocked_sdpa;
  if (blocked_gemm || (blocked_sdpa && !cuda)) {
    EXPECT_GE(fwd.peak, fpeak) << "forward peak";
  } else {
    EXPECT_EQ(fwd.peak, fpeak) << "forward peak";
  }
  EXPECT_EQ(fwd.retained, fleft) << "forward retained";
  EXPECT_EQ(replay(fe, out_bytes).second, new_bytes)
      << "the forward events must allocate every output that is not a view";
  ASSERT_EQ(out.size(), out_info.size());
  for (size_t j = 0; j < out.size(); ++j) {
    EXPECT_EQ(out[j].sizes().vec(), out_info[j].sizes) << "output " << j;
    EXPECT_EQ(out[j].scalar_type(), out_info[j].dtype) << "output " << j;
  }

  // Backward, with the saved values and the output gradients live.
  std::vector<at::Tensor> dy;
  for (size_t j = 0; j < out.size(); ++j)
    dy.push_back(out_info[j].dtype == at::kBool ? at::Tensor()
                                                : make(out_info[j].with_sizes(out_info[j].sizes), gen, device));
  std::vector<int64_t> grad_bytes;
  for (const auto& i : c.in) grad_bytes.push_back(i.with_sizes(i.sizes).bytes());
  Events be(device.type());
  c.op->backward_events(be, c.in, pinfo, out_info, c.attrs);
  const auto [bpeak, bleft] = replay(be, grad_bytes);
  // Added into zeros, then (the step's first backward) written over NaN: the same gradients
  // from the same allocations, which one list of events declares.
  const bool writes = !grads.empty() && c.op->writes_grads();
  std::vector<at::Tensor> dy_again;
  for (const at::Tensor& d : dy) dy_again.push_back(writes && d.defined() ? d.clone() : d);
  std::vector<at::Tensor> written;
  for (const at::Tensor& g : grads) written.push_back(at::full_like(g, std::nan("")));
  const auto backward = [&](std::vector<at::Tensor>& dys, std::vector<at::Tensor>& into, const char* how) {
    std::vector<at::Tensor*> gp;
    for (auto& g : into) gp.push_back(&g);
    const int64_t start = in_use(device).current;
    memory::reset_peak(device);
    std::vector<at::Tensor> din = c.op->backward(dys, in, out, params, gp, c.attrs, ctx);
    const Measured bwd{in_use(device).peak - start, in_use(device).current - start};
    if (blocked_backward) {
      EXPECT_GE(bwd.peak, bpeak) << how << " backward peak";
    } else {
      EXPECT_EQ(bwd.peak, bpeak) << how << " backward peak";
    }
    EXPECT_EQ(bwd.retained, bleft) << how << " backward retained";
  };
  backward(dy, grads, "adding");
  if (!writes) return;
  ctx.grads = ops::GradInto::write;
  backward(dy_again, written, "writing");
  for (size_t k = 0; k < grads.size(); ++k) {
    EXPECT_TRUE(at::equal(written[k], grads[k]))
        << "parameter " << k << ": written " << (written[k] - grads[k]).abs().max().item<double>() << " away";
  }
}

// The cuBLAS handle's workspace comes from the caching allocator on a process's first product
// and stays, cuBLASLt's on its first bias epilogue: both made before any GPU measurement, by
// products of the kinds the ops run (each dtype; plain, transposed, accumulating into a 2-D
// operand, batched, and with a 1-D bias).
void warm_up_gemms(at::Device gpu) {
  for (const at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    const at::Tensor a = at::ones({64, 64}, at::TensorOptions(gpu).dtype(t));
    at::mm(a, a.t());
    at::addmm(a, a.t(), a);
    at::bmm(a.unsqueeze(0), a.unsqueeze(0));
    at::linear(a, a, a[0]);
  }
}

std::vector<Case> cases() {
  // Both ranks of two: the first holds every id and target the cases draw (below kIds), the
  // second none; what is allocated depends on the shapes alone.
  static AbsentPeers first(0, 2), second(1, 2);
  Attrs sharded;
  sharded.sharded = true;
  std::vector<Case> out;
  for (at::ScalarType f : {at::kFloat, at::kBFloat16}) {
    const std::string dt = f == at::kFloat ? "f32" : "bf16";
    for (auto [B, T] : {std::pair<int64_t, int64_t>{2, 8}, {1, 5}, {3, 1}}) {
      const int64_t C = 32, F = 48;
      const TensorInfo x{{B, T, C}, f, {}};
      const std::string shape = fmt::format("{} B{} T{}", dt, B, T);
      Attrs norm;
      norm.eps = 1e-5;
      out.push_back({"layernorm " + shape, &op::layernorm(), {x}, {{C}, {C}}, norm});
      out.push_back({"rmsnorm " + shape, &op::rmsnorm(), {x}, {{C}}, norm});
      out.push_back({"linear+bias " + shape, &op::linear(), {x}, {{F, C}, {F}}, {}});
      out.push_back({"linear " + shape, &op::linear(), {x}, {{F, C}}, {}});
      out.push_back({"linears " + shape, &op::linears(), {x}, {{C, C}, {F, C}, {8, C}}, {}});
      out.push_back({"gelu " + shape, &op::gelu(), {x}, {}, {}});
      out.push_back({"swiglu " + shape, &op::swiglu(), {x, x}, {}, {}});
      out.push_back({"residual " + shape, &op::residual(), {x, x}, {}, {}});
      out.push_back({"tp_copy " + shape, &op::tp_copy(), {x}, {}, {}, {}, &first});
      out.push_back({"tp_reduce " + shape, &op::tp_reduce(), {x}, {}, {}, {}, &first});
      out.push_back({"tp_reduce+bias " + shape, &op::tp_reduce(), {x}, {{C}}, {}, {}, &first});
      // Sequence parallelism over two ranks: x is a rank's positions, x2 all of them.
      const TensorInfo x2{{B, 2 * T, C}, f, {}};
      Attrs gathered, scattered;
      gathered.sizes = x2.sizes;
      scattered.sizes = x.sizes;
      out.push_back({"sp_gather " + shape, &op::sp_gather(), {x}, {}, gathered, {}, &first});
      out.push_back({"sp_scatter " + shape, &op::sp_scatter(), {x2}, {}, scattered, {}, &second});
      out.push_back({"sp_scatter+bias " + shape, &op::sp_scatter(), {x2}, {{C}}, scattered, {}, &second});
      Attrs mask;
      mask.p = 0.1;
      mask.sizes = x.sizes;
      out.push_back({"dropout_mask " + shape, &op::dropout_mask(), {}, {}, mask});
      Attrs positions = mask;  // a sequence-parallel rank's positions
      positions.sharded = true;
      out.push_back({"dropout_mask sharded " + shape, &op::dropout_mask(), {}, {}, positions, {}, &second});
      out.push_back({"dropout " + shape, &op::dropout(), {x, {x.sizes, at::kBool, {}}}, {}, mask});
      Attrs view;
      view.sizes = {B, T, 4, 8};
      view.from = x.sizes;
      out.push_back({"view " + shape, &op::view(), {x}, {}, view});
      out.push_back({"rope " + shape, &op::rope(), {{{B, T, 4, 8}, f, {}}}, {}, {}});
      const TensorInfo ids{{B, T}, at::kLong, {}};
      out.push_back({"embedding " + shape, &op::embedding(), {ids}, {{kIds + 4, C}}, {}, f});
      for (AbsentPeers* rank : {&first, &second}) {
        out.push_back({fmt::format("embedding sharded rank {} {}", rank->rank(), shape),
                       &op::embedding(),
                       {ids},
                       {{kIds + 4, C}},
                       sharded,
                       f,
                       rank});
      }
      out.push_back({"position_embedding " + shape, &op::position_embedding(), {x}, {{T + 3, C}}, {}});
      out.push_back({"position_embedding sharded " + shape,
                     &op::position_embedding(),
                     {x},
                     {{2 * T + 3, C}},
                     sharded,
                     {},
                     &second});
      for (int64_t chunk : {int64_t{3}, int64_t{64}}) {
        Attrs loss;
        loss.chunk = chunk;
        const TensorInfo rows{{B * T, C}, f, {}}, targets{{B * T}, at::kLong, {}};
        for (const OpDef* head : {&op::cross_entropy(), &op::fused_cross_entropy()}) {
          out.push_back({fmt::format("{} {} chunk {}", head->kind(), shape, chunk),
                         head,
                         {rows, targets},
                         {{kIds + 10, C}},
                         loss});
          Attrs split = loss;
          split.sharded = true;
          for (AbsentPeers* rank : {&first, &second}) {
            out.push_back({fmt::format("{} sharded rank {} {} chunk {}", head->kind(), rank->rank(), shape, chunk),
                           head,
                           {rows, targets},
                           {{kIds + 10, C}},
                           split,
                           {},
                           rank});
          }
        }
      }
      for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 4}, {4, 2}, {2, 1}}) {
        const int64_t D = 8, W = (Hq + 2 * Hkv) * D;
        Attrs split;
        split.split_heads = {Hq, Hkv, Hkv};
        split.head_dim = D;
        out.push_back(
            {fmt::format("split {} Hq{} Hkv{}", shape, Hq, Hkv), &op::split(), {{{B, T, W}, f, {}}}, {}, split});
        for (double p : {0.0, 0.2}) {
          Attrs core;
          core.p = p;
          core.site = ops::DropoutSite::attn_probs;
          const std::string name = fmt::format("attention {} Hq{} Hkv{} p{}", shape, Hq, Hkv, p);
          const TensorInfo q{{B, T, Hq, D}, f, {}}, k{{B, T, Hkv, D}, f, {}};
          out.push_back({name, &op::attention(), {q, k, k}, {}, core});
          // Strided: the views a fused projection's split gives.
          const TensorInfo qs{q.sizes, f, {T * W, W, D, 1}}, ks{k.sizes, f, {T * W, W, D, 1}};
          out.push_back({name + " strided", &op::attention(), {qs, ks, ks}, {}, core});
          for (auto tiles : {ops::AttentionTiles{3, 2}, ops::AttentionTiles{16, 16}}) {
            Attrs tiled = core;
            tiled.tiles = tiles;
            const std::string tname = fmt::format("tiled_{} tiles {}x{}", name, tiles.q, tiles.k);
            out.push_back({tname, &op::tiled_attention(), {q, k, k}, {}, tiled});
            out.push_back({tname + " strided", &op::tiled_attention(), {qs, ks, ks}, {}, tiled});
          }
          if (kSdpaBuilt && p == 0) {
            out.push_back({"sdpa_" + name, &op::sdpa_attention(), {q, k, k}, {}, core});
            out.push_back({"sdpa_" + name + " strided", &op::sdpa_attention(), {qs, ks, ks}, {}, core});
          }
          out.push_back(
              {name + " strided linear", &op::linear(), {{{B, T, Hq * D}, f, {T * W, W, 1}}}, {{F, Hq * D}}, {}});
          out.push_back({name + " strided linears",
                         &op::linears(),
                         {{{B, T, Hq * D}, f, {T * W, W, 1}}},
                         {{F, Hq * D}, {8, Hq * D}},
                         {}});
        }
      }
    }
    // The math attention runs by blocks of positions: three here, the last one short.
    const int64_t T = 2 * ops::kAttentionBlock + 3, D = 8;
    for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}}) {
      for (double p : {0.0, 0.2}) {
        Attrs core;
        core.p = p;
        core.site = ops::DropoutSite::attn_probs;
        const std::string name = fmt::format("attention {} B1 T{} Hq{} Hkv{} p{}", dt, T, Hq, Hkv, p);
        const int64_t W = (Hq + 2 * Hkv) * D;
        const TensorInfo q{{1, T, Hq, D}, f, {}}, k{{1, T, Hkv, D}, f, {}};
        const TensorInfo qs{q.sizes, f, {T * W, W, D, 1}}, ks{k.sizes, f, {T * W, W, D, 1}};
        out.push_back({name, &op::attention(), {q, k, k}, {}, core});
        out.push_back({name + " strided", &op::attention(), {qs, ks, ks}, {}, core});
      }
    }
    // The sdpa kernel's query blocks: 32 positions below 192, 64 below 768, 256 from there;
    // its key blocks 512.
    for (const int64_t T : {2 * ops::kAttentionBlock + 3, int64_t{200}, int64_t{800}}) {
      for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}}) {
        if (!kSdpaBuilt) break;
        const int64_t D = 8, W = (Hq + 2 * Hkv) * D;
        const std::string name = fmt::format("sdpa_attention {} B1 T{} Hq{} Hkv{}", dt, T, Hq, Hkv);
        const TensorInfo q{{1, T, Hq, D}, f, {}}, k{{1, T, Hkv, D}, f, {}};
        const TensorInfo qs{q.sizes, f, {T * W, W, D, 1}}, ks{k.sizes, f, {T * W, W, D, 1}};
        out.push_back({name, &op::sdpa_attention(), {q, k, k}, {}, {}});
        out.push_back({name + " strided", &op::sdpa_attention(), {qs, ks, ks}, {}, {}});
      }
    }
  }
  return out;
}

TEST(OpMemory, DeclaredEventsEqualTheMeasuredAllocations) {
  std::set<const OpDef*> covered;
  for (const Case& c : cases()) {
    check(c);
    covered.insert(c.op);
  }
  for (const OpDef* op : op::all()) {
    if (op == &op::sdpa_attention() && !kSdpaBuilt) continue;  // no kernel to measure in this build
    EXPECT_TRUE(covered.count(op)) << "no memory case for op " << op->kind();
  }
}

TEST(OpMemory, OnAGpuDeclaredEventsEqualTheBytesRequested) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU here; scripts/gpu-check.sh runs this where one is";
  const at::Device gpu(at::kCUDA, 0);
  warm_up_gemms(gpu);
  for (const Case& c : cases()) {
    // Sharded cases run over CPU groups; the tiled op runs on the CPU only, and the sdpa op's
    // flash kernel takes 16-bit inputs.
    if (c.tp != nullptr || c.op == &op::tiled_attention() ||
        (c.op == &op::sdpa_attention() && c.in[0].dtype != at::kBFloat16)) {
      continue;
    }
    check(c, gpu);
  }
}

// Forward and backward peaks of `c`'s CUDA events, in the caching allocator's blocks.
std::pair<int64_t, int64_t> cuda_peaks(const Case& c) {
  std::vector<TensorInfo> pinfo;
  for (const auto& s : c.params) pinfo.push_back({s, c.dtype ? *c.dtype : c.in[0].dtype, {}});
  const auto out = c.op->infer(c.in, pinfo, c.attrs);
  std::vector<int64_t> out_bytes, grad_bytes;
  for (const auto& o : out) out_bytes.push_back(o.bytes());
  for (const auto& i : c.in) grad_bytes.push_back(i.with_sizes(i.sizes).bytes());
  Events fe(at::kCUDA), be(at::kCUDA);
  c.op->forward_events(fe, c.in, pinfo, out, c.attrs);
  c.op->backward_events(be, c.in, pinfo, out, c.attrs);
  return {replay(fe, out_bytes, kCudaBlock).first, replay(be, grad_bytes, kCudaBlock).first};
}

TEST(OpMemory, CudaEventsReplayWhatAnH200Measured) {
  // Forward and backward peaks in 512-byte blocks as PyTorch 2.11 allocated them on an H200
  // (scripts/gpu-check.sh), where the CPU's events declare casts, scalar copies and per-thread
  // partial sums that the CUDA kernels do not make.
  const std::map<std::string, std::pair<int64_t, int64_t>> measured = {
      {"layernorm f32 B2 T8", {3072, 3072}},
      {"layernorm bf16 B2 T8", {2048, 2560}},
      {"rmsnorm bf16 B2 T8", {3584, 8704}},
      {"rmsnorm bf16 B1 T5", {2048, 4608}},
      {"dropout bf16 B2 T8", {1024, 1024}},
      {"cross_entropy f32 B2 T8 chunk 3", {4608, 4608}},
      {"fused_cross_entropy bf16 B1 T5 chunk 3", {7680, 512}},
      {"attention f32 B1 T131 Hq2 Hkv2 p0.2", {331776, 220672}},
      {"attention bf16 B1 T131 Hq4 Hkv2 p0.2 strided", {366080, 220672}},
  };
  size_t found = 0;
  for (const Case& c : cases()) {
    const auto it = measured.find(c.name);
    if (it == measured.end()) continue;
    SCOPED_TRACE(c.name);
    ++found;
    EXPECT_EQ(cuda_peaks(c), it->second);
  }
  EXPECT_EQ(found, measured.size()) << "a case named above is gone from cases()";

  // At model shapes (OnAGpuModelShapesAreExact), where the weight gradient's
  // sum splits its rows over as many thread blocks as fill the H200's 132 multiprocessors:
  // not on a device with another count.
  if (ops::cuda_multiprocessors() != 132) return;
  Attrs norm;
  norm.eps = 1e-5;
  const auto rmsnorm = [&](int64_t B, int64_t T, int64_t C) {
    return Case{fmt::format("rmsnorm bf16 B{} T{} C{}", B, T, C),
                &op::rmsnorm(),
                {{{B, T, C}, at::kBFloat16, {}}},
                {{C}},
                norm};
  };
  const std::pair<Case, std::pair<int64_t, int64_t>> at_model_shapes[] = {
      {rmsnorm(4, 1024, 2048), {50348032, 167780864}},
      {rmsnorm(1, 8192, 4096), {201359360, 541082112}},
  };
  for (const auto& [c, peaks] : at_model_shapes) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(cuda_peaks(c), peaks);
  }
}

TEST(OpMemory, OnAGpuModelShapesAreExact) {
  // At a 1B and an 8B Llama's rows and widths, where CUDA reductions may split rows over
  // thread blocks (and the layer norm's weight gradient sums partial rows) as the small
  // cases never do; GPT-2's biased projection in float32 at 8 x 1024 tokens (its bias
  // gradient sums 8192 rows); the loss at the 1B's rows, width and 128,256-token vocabulary.
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU here; scripts/gpu-check.sh runs this where one is";
  const at::Device gpu(at::kCUDA, 0);
  warm_up_gemms(gpu);
  Attrs norm;
  norm.eps = 1e-5;
  for (auto [B, T, C] : {std::array<int64_t, 3>{4, 1024, 2048}, {1, 8192, 4096}}) {
    const TensorInfo x{{B, T, C}, at::kBFloat16, {}};
    const std::string shape = fmt::format("bf16 B{} T{} C{}", B, T, C);
    check({"rmsnorm " + shape, &op::rmsnorm(), {x}, {{C}}, norm}, gpu);
    check({"layernorm " + shape, &op::layernorm(), {x}, {{C}, {C}}, norm}, gpu);
  }
  const TensorInfo gpt2_rows{{8, 1024, 768}, at::kFloat, {}};
  check({"linear f32 B8 T1024 C768 bias", &op::linear(), {gpt2_rows}, {{768, 768}, {768}}, {}}, gpu);
  Attrs loss;
  loss.chunk = 1024;
  const TensorInfo rows{{4096, 2048}, at::kBFloat16, {}}, targets{{4096}, at::kLong, {}};
  for (const OpDef* head : {&op::cross_entropy(), &op::fused_cross_entropy()}) {
    check({fmt::format("{} bf16 N4096 C2048 V128256 chunk 1024", head->kind()),
           head,
           {rows, targets},
           {{128256, 2048}},
           loss},
          gpu);
  }
}

TEST(OpMemory, OnAGpuTheFlashKernelsEventsAreExact) {
  // At the head sizes and lengths models have, grouped-query heads too, and lengths whose
  // forward splits its keys (remat::ops::flash_key_splits).
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU here; scripts/gpu-check.sh runs this where one is";
  const at::Device gpu(at::kCUDA, 0);
  warm_up_gemms(gpu);
  for (auto [B, T, Hq, Hkv, D] :
       {std::array<int64_t, 5>{2, 256, 8, 2, 64}, {1, 1024, 16, 4, 128}, {4, 512, 12, 12, 64}, {1, 2048, 32, 8, 128}}) {
    if (!kSdpaBuilt) break;
    const int64_t W = (Hq + 2 * Hkv) * D;
    const TensorInfo q{{B, T, Hq, D}, at::kBFloat16, {}}, k{{B, T, Hkv, D}, at::kBFloat16, {}};
    const TensorInfo qs{q.sizes, at::kBFloat16, {T * W, W, D, 1}}, ks{k.sizes, at::kBFloat16, {T * W, W, D, 1}};
    const std::string name = fmt::format("sdpa_attention bf16 B{} T{} Hq{} Hkv{} D{}", B, T, Hq, Hkv, D);
    check({name, &op::sdpa_attention(), {q, k, k}, {}, {}}, gpu);
    check({name + " strided", &op::sdpa_attention(), {qs, ks, ks}, {}, {}}, gpu);
  }
}

}  // namespace
}  // namespace remat::graph
