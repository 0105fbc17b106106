#include "run/planning.h"

#include "remat/budget.h"
#include "remat/ops/attention.h"
#include "remat/policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace remat {

namespace {

// `plan` offloading only the slots `block` has: a slot another architecture's block has
// (llama's has no attn.resid) moves nothing, so the plan does not name it. Throws a
// sentence where the policy's offload term moves nothing at all on this block.
ActivationPlan offloading_what_exists(ActivationPlan plan, const graph::BlockGraph& block, Arch arch,
                                      const std::vector<std::string>& slots) {
  if (!plan.offloads()) return plan;
  SlotMask absent;
  for (LayerPlan& l : plan.layers) {
    for (const Slot s : l.offloaded.slots()) {
      if (!block.slot(s).empty()) continue;
      l.offloaded.remove(s);
      absent.add(s);
    }
    l.prefetch = l.prefetch && !l.offloaded.empty();
  }
  if (plan.offloads()) return plan;
  throw std::invalid_argument(fmt::format(
      "The policy \"{}\" offloads only {}, which a {} block does not have, so it would move nothing; offload "
      "some of its slots: {}.",
      plan.policy, fmt::join(absent.names(), ", "), arch_name(arch), fmt::join(slots, ", ")));
}

// A named policy's `plan` with every layer outside a uniform chunk keeping its gathered
// weights where `reshard` says never and the values are sharded; as compiled otherwise.
ActivationPlan keeping_weights(ActivationPlan plan, Reshard reshard, const Layout& layout) {
  if (reshard != Reshard::never || !layout.values_sharded()) return plan;
  for (size_t l = 0; l < plan.layers.size(); ++l) {
    plan.layers[l].weights_kept = plan.chunk_of(static_cast<int64_t>(l)) < 0;
  }
  return plan;
}

}  // namespace

bool on_cuda(const RunConfig& run) { return run.device.is_cuda(); }

cost::DeviceMemory RunPlan::device_peak() const { return cost::highest(device); }

cost::StepShape step_shape(const Config& local, at::ScalarType dtype) {
  const TrainConfig& t = local.train;
  cost::StepShape shape;
  shape.batch = t.batch;
  shape.seq = t.seq;
  shape.grad_accum = t.grad_accum;
  shape.ce_chunk = t.ce_chunk;
  shape.dtype = dtype;
  shape.device = on_cuda(local.run) ? at::kCUDA : at::kCPU;
  return shape;
}

Layout layout_of(const Config& local, int64_t stage) {
  const ParallelConfig& p = local.parallel;
  Layout l{p.dp, p.tp, p.sp, p.pp, stage, p.zero, p.schedule, {}, std::nullopt};
  // The policy's stages are stage_sizes'; the planner chooses them unless they are given.
  if (local.ac.budget.empty() || local.ac.num_layers_per_stage) l.split = stage_sizes(local.ac, local.model.n_layer);
  return l;
}

RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const Prices& prices, int64_t stage, int64_t budget_reference,
                 const SavedPlan* saved, int64_t host_budget) {
  const int64_t L = cfg.model.n_layer;
  const Layout layout = layout_of(cfg, stage);
  PlannerOptions options;
  options.early_stop = cfg.ac.early_stop;
  options.allocator.expandable_segments = cfg.run.expandable_segments;
  options.reshard = cfg.parallel.reshard_after_forward;
  auto planner = std::make_shared<const Planner>(cfg.model, step_shape(cfg, dtype), layout, prices.times, options);
  RunPlan r;
  r.planner = planner;
  r.prices = prices;
  r.resumed = saved != nullptr;
  r.stage = layout.stage;
  r.host_budget = host_budget;
  for (int s = 0; s < kSlotCount; ++s) {
    if (!planner->block().slot(static_cast<Slot>(s)).empty()) r.slots.push_back(slot_name(static_cast<Slot>(s)));
  }
  // The same step keeping everything, on the split a policy's plan runs.
  const PlanResult none = planner->predict(ActivationPlan::none(L), stage_sizes(cfg.ac, L), Ledgers::peak);
  r.none_peak = none.peak();
  r.none_step_seconds = predicted_step_seconds(prices, none, layout.stage, cfg.train.grad_accum);
  PlanResult planned;
  if (saved != nullptr) {
    planned = planner->predict(saved->plan, saved->split);
  } else if (cfg.ac.budget.empty()) {
    planned = planner->predict(keeping_weights(
        offloading_what_exists(compile_policy(cfg.ac, L, cfg.model.dropout), planner->block(), cfg.model.arch, r.slots),
        cfg.parallel.reshard_after_forward, layout));
  } else {
    r.budget = parse_budget(cfg.ac.budget, budget_reference > 0 ? budget_reference : r.none_peak);
    const Budgets budgets{r.budget, host_budget};
    auto solved = planner->plan(budgets);
    if (!solved) {
      throw BudgetTooSmall(planner->explain_infeasible(budgets, cfg.ac.budget), planner->least_budget(host_budget));
    }
    planned = std::move(*solved);
  }
  r.plan = planned.plan;
  r.split = planned.split;
  r.predicted = planned.stages[static_cast<size_t>(layout.stage)];
  for (const auto& st : planned.stages) r.stage_peaks.push_back(st.peak);
  r.device = planned.device;
  r.step_seconds = predicted_step_seconds(prices, planned, layout.stage, cfg.train.grad_accum);
  if (planned.stages.size() > 1) r.pipeline = std::move(planned);
  return r;
}

std::vector<int64_t> RunPlan::rank_peaks(int world, int64_t tp) const {
  const auto stages = static_cast<int64_t>(stage_peaks.size());
  const int64_t per_stage = world / stages;
  const std::vector<std::vector<int64_t>> by_rank = dp_rank_peaks();
  TORCH_CHECK(world == per_stage * stages && per_stage % tp == 0 &&
                  (by_rank.empty() || static_cast<int64_t>(by_rank.size()) == per_stage / tp),
              "[rank_peaks] ", world, " ranks in ", stages, " stages of ", tp, " tensor-parallel ranks, for ",
              by_rank.size(), " data-parallel ones");
  std::vector<int64_t> out;
  for (int64_t r = 0; r < world; ++r) {
    const auto stage = static_cast<size_t>(r / per_stage);
    out.push_back(by_rank.empty() ? stage_peaks[stage] : by_rank[static_cast<size_t>(r % per_stage / tp)][stage]);
  }
  return out;
}

std::optional<int64_t> least_peak_above(const Config& cfg, at::ScalarType dtype, int64_t host_budget, int64_t room) {
  // Every op and head an `auto` may choose (no op that cannot run the model: sdpa with
  // attention dropout): the least is the least of them.
  std::vector<Config> choices;
  for (const Attention a : kAttentionOps) {
    const bool may =
        cfg.model.attention == Attention::automatic &&
        ops::attention_refusal(a, cfg.model.dropout, cfg.run.device.is_cuda(), dtype, cfg.model.head_dim()).empty();
    if (cfg.model.attention != a && !may) continue;
    for (const LossHead h : {LossHead::fused, LossHead::recompute}) {
      if (cfg.model.loss_head != LossHead::automatic && h != cfg.model.loss_head) continue;
      choices.push_back(cfg);
      choices.back().model.attention = a;
      choices.back().model.loss_head = h;
    }
  }
  PlannerOptions options;
  options.allocator.expandable_segments = cfg.run.expandable_segments;
  std::optional<int64_t> least;
  for (const Config& c : choices) {
    const Planner planner(c.model, step_shape(c, dtype), layout_of(c, 0), Prices::declared(c).times, options);
    if (planner.predict(compile_policy("full", c.model.n_layer), {}, Ledgers::peak).peak() <= room) return std::nullopt;
    const int64_t bytes = planner.least_budget(host_budget);
    if (bytes <= room) return std::nullopt;
    least = std::min(least.value_or(bytes), bytes);
  }
  return least;
}

}  // namespace remat
