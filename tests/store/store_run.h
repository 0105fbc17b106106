// A model trained for one step of two microbatches under a plan, as the store's bitwise
// tests compare them: shared by the recompute and offload suites.
#pragma once

#include "remat/model.h"

#include <ATen/Parallel.h>

#include <vector>

namespace remat::testing {

struct StoreOutcome {
  std::vector<double> losses;
  std::vector<at::Tensor> grads;
  StoreCounters counters;
  memory::HostPool::Counts host;  ///< the offloaded slots' pool (zeros without a store)
};

/// Two microbatches of B x T tokens accumulated into one gradient, as the trainer does.
inline StoreOutcome run_two_microbatches(const ModelConfig& cfg, const ActivationPlan& plan, int64_t B, int64_t T,
                                         StoreOptions opt = {}) {
  at::set_num_threads(1);
  auto model = Model::create(cfg, at::kCPU, at::kFloat, 3);
  model->set_activation_plan(plan, opt);
  auto gen = at::detail::createCPUGenerator(9);
  StoreOutcome r;
  model->zero_grad();
  for (uint64_t micro = 0; micro < 2; ++micro) {
    auto tok = at::randint(cfg.vocab_size, {B, T}, gen, at::kLong);
    auto tgt = at::randint(cfg.vocab_size, {B, T}, gen, at::kLong);
    r.losses.push_back(model->forward_backward(tok, tgt, {5, 2, micro}, 0.5, 7));
  }
  for (const auto& p : model->params()) r.grads.push_back(p.grad.clone());
  if (model->store() != nullptr) {
    r.counters = model->store()->counters();
    r.host = model->store()->host().counts();
  }
  return r;
}

}  // namespace remat::testing
