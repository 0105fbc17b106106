#include "remat/ops/dropout.h"

#include "ops/op_def.h"

#include "remat/trace.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <mutex>

namespace remat::ops {
namespace {

void check_p(double p) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "[dropout] drop probability must be in [0, 1), got ", p);
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

DropoutDraw::DropoutDraw(const DropoutKey& key, double p, int64_t row_numel)
    : base_(key.hash()),
      threshold_(static_cast<uint64_t>(std::ldexp(1.0 - p, 53))),  // exact: p is a double
      offset_(key.first_row * row_numel) {
  check_p(p);
}

at::Tensor dropout_mask(at::IntArrayRef sizes, double p, const DropoutKey& key, at::Device device) {
  const trace::Scope trace_scope("dropout_mask", trace::Category::forward);
  check_p(p);
  const auto bool_on = [](at::Device d) { return at::TensorOptions().dtype(at::kBool).device(d); };
  if (!device.is_cpu()) {
    at::Tensor mask = at::empty(sizes, bool_on(device));
    // A generator draws no element by index, so each rank's rows get a seed of their own.
    const uint64_t seed = key.first_row == 0 ? key.hash()
                                             : DropoutDraw::mix64(key.hash() ^ static_cast<uint64_t>(key.first_row));
    mask.bernoulli_(1.0 - p, keyed_generator(seed, device));
    return mask;
  }
  // On the CPU each element is drawn from its own counter (DropoutDraw): no generator state,
  // so the mask does not depend on how parallel_for splits the range (thread count).
  at::Tensor mask = at::empty(sizes, bool_on(device));
  const DropoutDraw draw(key, p, sizes.empty() || sizes[0] == 0 ? 0 : mask.numel() / sizes[0]);
  bool* out = mask.data_ptr<bool>();
  at::parallel_for(0, mask.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = draw.keep(i);
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
  TORCH_CHECK(dy.sizes() == saved.mask.sizes(), "[dropout] gradient shape must match the mask, got dy ",
              dy.sizes(), " and mask ", saved.mask.sizes());
  return at::mul(dy, saved.mask).mul_(1.0 / (1.0 - saved.p));
}

int64_t dropout_saved_bytes(int64_t numel, double p) {
  return p > 0.0 ? nbytes(numel, at::kBool) : 0;
}

double dropout_flops(int64_t numel, double p) { return p > 0.0 ? static_cast<double>(numel) : 0.0; }

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::flags;

// No inputs; attributes p, site and sizes; outputs {mask}. The mask is a function of the
// key alone, so recomputing it needs nothing kept.
class DropoutMaskDef final : public OpDef {
 public:
  const char* kind() const override { return "dropout_mask"; }
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
    return {ops::dropout_mask(a.sizes, a.p, ctx.key(a.site), ctx.device)};
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
// mask to x's dtype (TensorIterator promotes inputs by copies).
class DropoutDef final : public detail::Elementwise {
 public:
  DropoutDef() : Elementwise("dropout", 2) {}
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
