#include "train/step.h"

#include "remat/memory.h"
#include "remat/trace.h"
#include "remat/trainer.h"
#include "train/device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

namespace remat {
namespace {

// Scales gradients so their global L2 norm is at most max_norm; returns the norm before.
double clip_gradients(Model& model, double max_norm) {
  const trace::Scope scope("clip gradients", trace::Category::step);
  // One reduction and one host read for all parameters (a sync per parameter on CUDA).
  std::vector<at::Tensor> squares;
  for (const auto& p : model.params()) squares.push_back(p.grad.pow(2).sum());
  const double norm = std::sqrt(at::stack(squares).to(at::kDouble).sum().item<double>());
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (auto& p : model.params()) p.grad.mul_(scale);
  }
  return norm;
}

std::vector<torch::optim::OptimizerParamGroup> adamw_groups(Model& model, const TrainConfig& t) {
  std::vector<at::Tensor> decay, no_decay;
  for (auto& p : model.params()) {
    p.value.mutable_grad() = p.grad;  // the optimizer reads the accumulators we fill
    (p.decay ? decay : no_decay).push_back(p.value);
  }
  using torch::optim::AdamWOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<AdamWOptions>(AdamWOptions(t.lr).betas({t.beta1, t.beta2}).weight_decay(t.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<AdamWOptions>(AdamWOptions(t.lr).betas({t.beta1, t.beta2}).weight_decay(0.0)));
  return groups;
}

}  // namespace

void apply_plan(Model& model, const ActivationPlan& plan, const AcConfig& ac) {
  StoreOptions options;
  options.check = parse_determinism_check(ac.check);
  options.early_stop = ac.early_stop;
  options.preserve_rng = ac.preserve_rng_state;
  options.pool = ac.pool;
  model.set_activation_plan(plan, options);
}

TrainStep::TrainStep(Model& model, const TrainConfig& train, uint64_t seed)
    : model_(model),
      train_(train),
      seed_(seed),
      optimizer_(adamw_groups(model, train), torch::optim::AdamWOptions(train.lr)) {}

StepResult TrainStep::run(int64_t step, const data::TokenDataset& data, std::mt19937_64& rng, bool traced) {
  const TrainConfig& t = train_;
  const at::Device device = model_.device();
  StepResult r;
  r.lr = learning_rate(t, step);
  for (auto& g : optimizer_.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(r.lr);
  memory::reset_peak(device);
  synchronize(device);
  if (traced) trace::start(device);
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<trace::Scope> step_scope(std::in_place, "step", trace::Category::step);

  model_.zero_grad();
  if (model_.store() != nullptr) model_.store()->reset_counters();
  for (int64_t micro = 0; micro < t.grad_accum; ++micro) {
    auto b = data.sample(t.batch, t.seq, rng);
    const StepContext ctx{seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(micro)};
    r.loss += model_.forward_backward(b.tokens.to(device), b.targets.to(device), ctx, 1.0 / t.grad_accum,
                                      t.ce_chunk, micro == 0 ? &r.activations : nullptr) /
              static_cast<double>(t.grad_accum);
  }
  r.grad_norm = clip_gradients(model_, t.grad_clip);
  {
    const trace::Scope scope("optimizer step", trace::Category::step);
    optimizer_.step();
  }
  synchronize(device);
  step_scope.reset();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (traced) r.trace = trace::stop();
  const auto mem = memory::stats(device);
  r.current_bytes = mem.current;
  r.peak_bytes = mem.peak;

  TORCH_CHECK(std::isfinite(r.loss), "The training loss became ", r.loss, " at step ", step + 1,
              "; lower train.lr (now ", t.lr, ") or raise train.warmup.");
  if (model_.store() != nullptr) r.counters = model_.store()->counters();
  return r;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace remat
