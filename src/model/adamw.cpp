#include "model/adamw.h"

#include "util/fused_adamw.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#if REMAT_FUSED_ADAMW
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#else
#include <torch/optim/adamw.h>
#endif

#include <utility>

namespace remat {

#if REMAT_FUSED_ADAMW
// One fused call per group (weight decay or none): the kernel reads and writes each
// element of the values and moments once, with no temporaries.
struct AdamW::Impl {
  std::vector<AdamWParam> params;
  AdamWSettings settings;
  int64_t updates = 0;
  std::vector<at::Tensor> exp_avg, exp_avg_sq;
  // The step count the kernel reads for the bias corrections, one scalar on the values'
  // device, given to it once per tensor.
  at::Tensor count;

  Impl(std::vector<AdamWParam> p, const AdamWSettings& s) : params(std::move(p)), settings(s) {}

  void step(double lr) {
    const c10::NoGradGuard no_grad;
    if (params.empty()) {
      ++updates;
      return;
    }
    if (exp_avg.empty()) {
      for (const AdamWParam& p : params) {
        exp_avg.push_back(at::zeros_like(p.value, at::MemoryFormat::Contiguous));
        exp_avg_sq.push_back(at::zeros_like(p.value, at::MemoryFormat::Contiguous));
      }
    }
    ++updates;
    if (!count.defined()) count = at::full({}, 0.0, params[0].value.options().dtype(at::kFloat));
    count.fill_(static_cast<double>(updates));
    for (const bool decay : {true, false}) {
      std::vector<at::Tensor> values, grads, firsts, seconds;
      for (size_t k = 0; k < params.size(); ++k) {
        if (params[k].decay != decay) continue;
        values.push_back(params[k].value);
        grads.push_back(params[k].grad);
        firsts.push_back(exp_avg[k]);
        seconds.push_back(exp_avg_sq[k]);
      }
      if (values.empty()) continue;
      const std::vector<at::Tensor> counts(values.size(), count);
      at::_fused_adamw_(values, grads, firsts, seconds, {}, counts, lr, settings.beta1, settings.beta2,
                        decay ? settings.weight_decay : 0.0, settings.eps, /*amsgrad=*/false, /*maximize=*/false);
    }
  }

  at::Tensor first(size_t k) const { return exp_avg.empty() ? at::Tensor() : exp_avg.at(k); }
  at::Tensor second(size_t k) const { return exp_avg_sq.empty() ? at::Tensor() : exp_avg_sq.at(k); }

  void restore(int64_t n, const std::vector<at::Tensor>& firsts, const std::vector<at::Tensor>& seconds) {
    exp_avg.clear();
    exp_avg_sq.clear();
    updates = n;
    if (n == 0) return;
    for (size_t k = 0; k < params.size(); ++k) {
      exp_avg.push_back(firsts.at(k).to(params[k].value.device()).contiguous().clone());
      exp_avg_sq.push_back(seconds.at(k).to(params[k].value.device()).contiguous().clone());
    }
  }
};

#else
// LibTorch's own optimizer in two groups (LibTorch 1.13 to 2.3); it keys each tensor's state
// by its TensorImpl's address, printed as a string before LibTorch 2.
struct AdamW::Impl {
  std::vector<AdamWParam> params;
  torch::optim::AdamW optimizer;
  int64_t updates = 0;

#if TORCH_VERSION_MAJOR >= 2
  static void* key(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }
#else
  static std::string key(const at::Tensor& t) { return c10::guts::to_string(t.unsafeGetTensorImpl()); }
#endif

  static torch::optim::AdamW make(std::vector<AdamWParam>& params, const AdamWSettings& s) {
    std::vector<at::Tensor> decay, no_decay;
    for (AdamWParam& p : params) {
      p.value.mutable_grad() = p.grad;  // the optimizer reads the gradients there
      (p.decay ? decay : no_decay).push_back(p.value);
    }
    using torch::optim::AdamWOptions;
    const auto options = [&](double weight_decay) {
      return std::make_unique<AdamWOptions>(
          AdamWOptions().betas({s.beta1, s.beta2}).weight_decay(weight_decay).eps(s.eps));
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, options(s.weight_decay));
    groups.emplace_back(no_decay, options(0.0));
    return torch::optim::AdamW(std::move(groups), AdamWOptions());
  }

  Impl(std::vector<AdamWParam> p, const AdamWSettings& s) : params(std::move(p)), optimizer(make(params, s)) {}

  void step(double lr) {
    for (auto& g : optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    optimizer.step();
    ++updates;
  }

  const torch::optim::AdamWParamState* state(size_t k) const {
    const auto it = optimizer.state().find(key(params.at(k).value));
    return it == optimizer.state().end() ? nullptr : &static_cast<const torch::optim::AdamWParamState&>(*it->second);
  }
  at::Tensor first(size_t k) const { return state(k) != nullptr ? state(k)->exp_avg() : at::Tensor(); }
  at::Tensor second(size_t k) const { return state(k) != nullptr ? state(k)->exp_avg_sq() : at::Tensor(); }

  void restore(int64_t n, const std::vector<at::Tensor>& firsts, const std::vector<at::Tensor>& seconds) {
    optimizer.state().clear();
    updates = n;
    if (n == 0) return;
    for (size_t k = 0; k < params.size(); ++k) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(n);
      s->exp_avg(firsts.at(k).to(params[k].value.device()).contiguous().clone());
      s->exp_avg_sq(seconds.at(k).to(params[k].value.device()).contiguous().clone());
      optimizer.state()[key(params[k].value)] = std::move(s);
    }
  }
};

#endif

AdamW::AdamW(std::vector<AdamWParam> params, const AdamWSettings& settings)
    : impl_(std::make_unique<Impl>(std::move(params), settings)) {}

AdamW::~AdamW() = default;

void AdamW::step(double lr) { impl_->step(lr); }
int64_t AdamW::updates() const { return impl_->updates; }
at::Tensor AdamW::exp_avg(size_t k) const { return impl_->first(k); }
at::Tensor AdamW::exp_avg_sq(size_t k) const { return impl_->second(k); }

void AdamW::restore(int64_t updates, const std::vector<at::Tensor>& exp_avg,
                    const std::vector<at::Tensor>& exp_avg_sq) {
  TORCH_CHECK(updates >= 0 && (updates == 0 ||
                               (exp_avg.size() == impl_->params.size() && exp_avg_sq.size() == impl_->params.size())),
              "[AdamW::restore] ", exp_avg.size(), " and ", exp_avg_sq.size(), " moments after ", updates,
              " updates, for ", impl_->params.size(), " tensors");
  impl_->restore(updates, exp_avg, exp_avg_sq);
}

}  // namespace remat
