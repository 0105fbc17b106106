#include "remat/ops/dropout.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <mutex>

namespace remat::ops {
namespace {

void check_p(double p) { TORCH_CHECK(p >= 0.0 && p < 1.0, "[dropout] drop probability must be in [0, 1), got ", p); }

// A dimension-1 window must lie inside dimension 1 of the global mask: one reaching past it
// would draw the elements of the next row's window.
void check_window(const DropoutKey& key, at::IntArrayRef sizes) {
  if (key.first_in_dim1 == 0 && key.dim1_global == 0) return;
  TORCH_CHECK(sizes.size() >= 2, "[dropout] a window along dimension 1 (first_in_dim1 ", key.first_in_dim1,
              ", dim1_global ", key.dim1_global, ") needs a mask of 2 dimensions or more, got ", sizes);
  const int64_t global = key.dim1_global == 0 ? sizes[1] : key.dim1_global;
  TORCH_CHECK(key.first_in_dim1 >= 0 && key.dim1_global >= 0 && key.first_in_dim1 + sizes[1] <= global,
              "[dropout] the window [", key.first_in_dim1, ", ", key.first_in_dim1 + sizes[1],
              ") of dimension 1 must lie in [0, ", global, ") (dim1_global ", key.dim1_global, ", mask ", sizes, ")");
}

// A private accelerator generator seeded from the key: the global one's state is never consumed.
at::Generator keyed_generator(uint64_t seed, at::Device device) {
  at::Generator global = at::globalContext().defaultGenerator(device);  // shares the state
  at::Generator gen;
  {
    std::lock_guard<std::mutex> lock(global.mutex());
    gen = global.clone();
  }
  gen.set_current_seed(seed);
  return gen;
}

}  // namespace

uint64_t DropoutKey::hash() const {
  // Each field passes through a bijection after being xor-ed in, so changing any single
  // field changes the result. The golden-ratio offset keeps an all-zero key off zero.
  uint64_t h = DropoutDraw::mix64(seed + 0x9e3779b97f4a7c15ULL);
  h = DropoutDraw::mix64(h ^ step);
  h = DropoutDraw::mix64(h ^ microbatch);
  h = DropoutDraw::mix64(h ^ layer);
  return DropoutDraw::mix64(h ^ static_cast<uint64_t>(site));
}

DropoutDraw::DropoutDraw(const DropoutKey& key, double p, at::IntArrayRef sizes)
    : base_(key.hash()), threshold_(0), offset_(0), row_gap_(0) {
  check_p(p);
  check_window(key, sizes);
  threshold_ = static_cast<uint64_t>(std::ldexp(1.0 - p, 53));  // exact: p is a double
  if (sizes.empty()) return;                                    // one element and no rows: nothing to place
  const int64_t n1 = sizes.size() >= 2 ? sizes[1] : 1;
  const int64_t global = key.dim1_global == 0 ? n1 : key.dim1_global;
  int64_t inner = 1;
  for (size_t d = 2; d < sizes.size(); ++d) inner *= sizes[d];
  offset_ = (key.first_row * global + key.first_in_dim1) * inner;
  row_gap_ = (global - n1) * inner;
}

at::Tensor dropout_mask(at::IntArrayRef sizes, double p, const DropoutKey& key, at::Device device) {
  const trace::Scope trace_scope("dropout_mask", trace::Category::forward);
  check_p(p);
  const auto bool_on = [](at::Device d) { return at::TensorOptions().dtype(at::kBool).device(d); };
  if (!device.is_cpu()) {
    check_window(key, sizes);
    at::Tensor mask = at::empty(sizes, bool_on(device));
    // A generator draws no element by index, so each rank's share gets a seed of its own.
    // The dimension-1 window's start is mixed in offset by a constant, so the share from
    // row 3 and the one from head 3 get different seeds.
    uint64_t seed = key.hash();
    if (key.first_row != 0) seed = DropoutDraw::mix64(seed ^ static_cast<uint64_t>(key.first_row));
    if (key.first_in_dim1 != 0) {
      seed = DropoutDraw::mix64(seed ^ (static_cast<uint64_t>(key.first_in_dim1) + 0x9e3779b97f4a7c15ULL));
    }
    mask.bernoulli_(1.0 - p, keyed_generator(seed, device));
    return mask;
  }
  // On the CPU each element is drawn from its own counter (DropoutDraw): no generator state,
  // so the mask does not depend on how parallel_for splits the range (thread count).
  at::Tensor mask = at::empty(sizes, bool_on(device));
  const DropoutDraw draw(key, p, sizes);
  const int64_t numel = mask.numel();
  if (numel == 0) return mask;
  // Global and local indices differ by a constant along each row (dimension 0): a range
  // finds its first row by one division, then steps from row to row.
  const int64_t row = sizes.empty() ? 1 : numel / sizes[0];
  bool* out = mask.data_ptr<bool>();
  at::parallel_for(0, numel, 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i0 = begin / row;
    for (int64_t i = begin; i < end; ++i0) {
      const int64_t stop = std::min(end, (i0 + 1) * row), offset = draw.offset(i0);
      for (; i < stop; ++i) out[i] = draw.keep(offset + i);
    }
  });
  return mask;
}

Fwd<DropoutSaved> dropout_forward(const at::Tensor& x, double p, const DropoutKey& key) {
  check_p(p);
  if (p == 0.0) return {x, DropoutSaved{at::Tensor(), 0.0}};
  // Only a dropout that runs is a slice: the store counts no p = 0 dropout either.
  const trace::Scope trace_scope("dropout", trace::Category::forward);
  return dropout_apply(x, dropout_mask(x.sizes(), p, key, x.device()), p);
}

Fwd<DropoutSaved> dropout_apply(const at::Tensor& x, const at::Tensor& mask, double p) {
  check_p(p);
  if (p == 0.0) return {x, DropoutSaved{at::Tensor(), 0.0}};
  TORCH_CHECK(mask.sizes() == x.sizes() && mask.scalar_type() == at::kBool,
              "[dropout] the mask must be bool of x's shape ", x.sizes(), ", got ", mask.sizes(), " ",
              mask.scalar_type());
  at::Tensor y = at::mul(x, mask).mul_(1.0 / (1.0 - p));
  return {y, DropoutSaved{mask, p}};
}

at::Tensor dropout_backward(const at::Tensor& dy, const DropoutSaved& saved) {
  if (saved.p == 0.0) return dy;
  const trace::Scope trace_scope("dropout", trace::Category::backward);
  TORCH_CHECK(dy.sizes() == saved.mask.sizes(), "[dropout] gradient shape must match the mask, got dy ", dy.sizes(),
              " and mask ", saved.mask.sizes());
  return at::mul(dy, saved.mask).mul_(1.0 / (1.0 - saved.p));
}

int64_t dropout_saved_bytes(int64_t numel, double p) { return p > 0.0 ? nbytes(numel, at::kBool) : 0; }

double dropout_flops(int64_t numel, double p) { return p > 0.0 ? static_cast<double>(numel) : 0.0; }

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::flags;

// No inputs; attributes p, site and sizes (sharded: dimension 1 is this rank's positions
// of the sequence); outputs {mask}. The mask is a function of the key alone, so
// recomputing it needs nothing kept.
class DropoutMaskDef final : public OpDef {
 public:
  const char* kind() const override { return "dropout_mask"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::whole; }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                                const Attrs& a) const override {
    return {TensorInfo{a.sizes, at::kBool, {}}};
  }
  double flops(const std::vector<TensorInfo>&, const std::vector<TensorInfo>&, const Attrs&) const override {
    return 0.0;
  }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const Attrs& a,
                                  const RunContext& ctx) const override {
    if (!ctx.train) return {at::Tensor()};
    ops::DropoutKey key = ctx.key(a.site);
    if (a.sharded) {  // this rank's positions of the group's: that window of the one-process mask
      key.first_in_dim1 = ctx.tp_rank() * a.sizes[1];
      key.dim1_global = a.sizes[1] * ctx.tp_size();
    }
    return {ops::dropout_mask(a.sizes, a.p, key, ctx.device)};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs&, const RunContext&) const override {
    return {};
  }
  void forward_events(Events& e, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    e.out(0);
  }
  void backward_events(Events&, const std::vector<TensorInfo>&, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {}
};

// Inputs {x, mask}; attribute p; outputs {y}. On the CPU the product first copies the bool
// mask to x's dtype (TensorIterator promotes inputs by copies); a CUDA kernel casts as it
// reads, so there the result is all (TensorIteratorBase::compute_types copies for the CPU only).
class DropoutDef final : public detail::Elementwise {
 public:
  DropoutDef() : Elementwise("dropout", 2) {}
  TensorParallel tensor_parallel() const override { return TensorParallel::position_wise; }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs& a) const override {
    return ops::dropout_flops(in[0].numel(), a.p);
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {1}); }
  bool differentiable(size_t input) const override { return input == 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&, const Attrs& a,
                                  const RunContext& ctx) const override {
    if (!ctx.train) return {in[0]};
    const trace::Scope trace_scope("dropout", trace::Category::forward);
    return {ops::dropout_apply(in[0], in[1], a.p).out};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>&, const Attrs& a, const RunContext&) const override {
    return {ops::dropout_backward(dy[0], ops::DropoutSaved{in[1], a.p}), at::Tensor()};
  }
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                      const std::vector<TensorInfo>&, const Attrs&) const override {
    if (e.device() == at::kCUDA) return e.out(0);
    const int64_t maskf = e.temp(in[0].with_sizes(in[0].sizes).bytes());
    e.out(0);
    e.release(maskf);
  }
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>& out, const Attrs& a) const override {
    forward_events(e, in, p, out, a);
  }
};

}  // namespace

const OpDef& op::dropout_mask() {
  static const DropoutMaskDef def;
  return def;
}

const OpDef& op::dropout() {
  static const DropoutDef def;
  return def;
}

}  // namespace remat::graph
