#include "run/planning.h"

#include "remat/budget.h"
#include "remat/caching_allocator.h"
#include "remat/memory.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "train/progress.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <set>

namespace remat {

namespace {

using memory::format_bytes;

// The optimizer step of the slowest stage to update (they update at once): the measured
// step's time per parameter byte updated, times the bytes each stage updates (half its
// moments' bytes: its share under ZeRO-1).
double stages_optimizer_seconds(const TimeProfile& profile, const PipelinePlan& r) {
  if (profile.optimizer_bytes <= 0) return 0;
  int64_t most = 0;
  for (const auto& st : r.stages) most = std::max(most, st.statics.optimizer / 2);
  return profile.optimizer_seconds * static_cast<double>(most) / static_cast<double>(profile.optimizer_bytes);
}

// The sentence for a per-rank `budget` (as the user wrote it: `given`) that no plan of
// `cfg`'s pipeline `pipe` fits: the least budget that does, and what else to change.
std::string pipeline_infeasible(const Config& cfg, const Planner& planner, const PipelineShape& pipe, int64_t budget,
                                const std::string& given) {
  const int64_t m = cfg.train.grad_accum;
  return fmt::format(
      "The memory budget {} (\"{}\") fits no plan of {} on {} pipeline stages ({} schedule, {} microbatch{}): the "
      "least budget every stage fits is {}; give at least that, lower train.batch, train.seq or train.grad_accum{}, "
      "or use more stages.",
      format_bytes(budget), given, cfg.model.preset, pipe.stages, pipeline::schedule_name(pipe.schedule), m,
      m == 1 ? "" : "es", format_bytes(planner.min_pipeline_budget(pipe)),
      pipe.schedule == pipeline::Schedule::gpipe ? " (gpipe holds every microbatch; 1f1b at most one per stage)" : "");
}

// The least step, as a share of the range from the budget to the least feasible one, by
// which the cost model's budget goes down until a plan's reserved bytes fit.
constexpr int64_t kReservedSteps = 16;
// The cuBLAS workspace of one handle and stream, as PyTorch sizes it on Hopper.
const int64_t kCudaWorkspace = memory::cublas_workspace_bytes(9, 0);

memory::AllocatorRules allocator_rules(const RunConfig& run) {
  memory::AllocatorRules rules;
  rules.expandable_segments = run.expandable_segments;
  return rules;
}

// The sentence for a budget whose plans fit as the cost model counts bytes but not once
// the caching allocator's rounding and segments are counted; `reserved`: the last plan's.
std::string reserved_infeasible(const Config& cfg, int64_t budget, int64_t reserved) {
  return fmt::format(
      "The memory budget {} (\"{}\") fits no plan of {} once the CUDA caching allocator's segments are counted: the "
      "closest plan found reserves {}; give at least that, lower train.batch or train.seq, or set "
      "run.expandable_segments = true (segments that grow instead of being rounded up).",
      format_bytes(budget), cfg.ac.budget, cfg.model.preset, format_bytes(reserved));
}

// What the caching allocator of `cfg`'s CUDA device holds at its highest on each stage of
// `r`'s plan (each stage's shape as the planner prices it); empty on the CPU.
std::vector<cost::DeviceMemory> device_memory(const Config& cfg, const Planner& planner, const RunPlan& r,
                                              const PipelineShape& pipe) {
  if (!on_cuda(cfg.run)) return {};
  std::vector<cost::DeviceMemory> out;
  int64_t first = 0;
  for (size_t s = 0; s < r.split.size(); ++s) {
    const cost::StepShape shape = planner.stage_shape(pipe, static_cast<int64_t>(s), first, r.split[s]);
    out.push_back(cost::predict_device_memory(cfg.model, shape, r.plan, cfg.ac.early_stop, allocator_rules(cfg.run),
                                              kCudaWorkspace));
    first += r.split[s];
  }
  return out;
}

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

}  // namespace

bool on_cuda(const RunConfig& run) { return run.device != "cpu"; }

cost::DeviceMemory RunPlan::device_peak() const {
  cost::DeviceMemory most;
  for (const cost::DeviceMemory& d : device) {
    most.allocated_peak = std::max(most.allocated_peak, d.allocated_peak);
    most.reserved_peak = std::max(most.reserved_peak, d.reserved_peak);
  }
  return most;
}

std::string saved_plan_json(const RunPlan& r) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerPlan& l : r.plan.layers) {
    nlohmann::json layer{
        {"dropped", l.dropped.names()}, {"chunk_begin", l.chunk_begin}, {"input_sharded", l.input_sharded}};
    if (l.attention) layer["attention"] = attention_name(*l.attention);
    if (!l.offloaded.empty()) layer["offloaded"] = l.offloaded.names();
    if (l.prefetch) layer["prefetch"] = true;
    layers.push_back(std::move(layer));
  }
  return nlohmann::json{{"policy", r.plan.policy}, {"split", r.split}, {"layers", layers}}.dump();
}

SavedPlan parse_saved_plan(const std::string& json, int64_t n_layers, int64_t stages) {
  const auto damaged = [](const std::string& why) {
    return std::invalid_argument("The checkpoint's plan (its \"plan\" metadata) " + why +
                                 "; resume from a checkpoint this model's run wrote, or start the run again.");
  };
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  SavedPlan saved;
  try {
    if (!j.is_object()) throw damaged("is not a JSON object");
    saved.plan.policy = j.at("policy").get<std::string>();
    saved.split = j.at("split").get<std::vector<int64_t>>();
    for (const nlohmann::json& l : j.at("layers")) {
      LayerPlan layer;
      const auto dropped = l.at("dropped").get<std::vector<std::string>>();
      for (const std::string& slot : dropped) {
        if (std::find(block_slots().begin(), block_slots().end(), slot) == block_slots().end()) {
          throw damaged(fmt::format("drops '{}' in layer {}, which no block has", slot, saved.plan.layers.size() + 1));
        }
      }
      layer.dropped = SlotMask::of_names(dropped);
      // Older checkpoints offload nothing and say nothing of it.
      const auto offloaded = l.value("offloaded", std::vector<std::string>{});
      for (const std::string& slot : offloaded) {
        if (slot != "input" && std::find(block_slots().begin(), block_slots().end(), slot) == block_slots().end()) {
          throw damaged(
              fmt::format("offloads '{}' in layer {}, which no block has", slot, saved.plan.layers.size() + 1));
        }
        layer.offloaded.add(slot_of_name(slot));
      }
      layer.prefetch = l.value("prefetch", false);
      layer.chunk_begin = l.at("chunk_begin").get<int64_t>();
      layer.input_sharded = l.at("input_sharded").get<bool>();
      if (l.contains("attention")) {
        const std::string op = l.at("attention").get<std::string>();
        const auto* known = std::find_if(std::begin(kAttentionOps), std::end(kAttentionOps),
                                         [&](Attention a) { return op == attention_name(a); });
        if (known == std::end(kAttentionOps)) {
          std::vector<std::string> names;
          for (Attention a : kAttentionOps) names.emplace_back(attention_name(a));
          throw damaged(fmt::format("runs attention '{}' in layer {}, which is none of this build's ops ({})", op,
                                    saved.plan.layers.size() + 1, fmt::join(names, ", ")));
        }
        layer.attention = *known;
      }
      saved.plan.layers.push_back(std::move(layer));
    }
  } catch (const nlohmann::json::exception& e) {
    throw damaged(fmt::format("is damaged ({})", e.what()));
  }
  if (static_cast<int64_t>(saved.plan.layers.size()) != n_layers) {
    throw damaged(fmt::format("has {} layers where the model has {}", saved.plan.layers.size(), n_layers));
  }
  const bool split_ok = static_cast<int64_t>(saved.split.size()) == stages &&
                        std::all_of(saved.split.begin(), saved.split.end(), [](int64_t n) { return n >= 1; }) &&
                        std::accumulate(saved.split.begin(), saved.split.end(), int64_t{0}) == n_layers;
  if (!split_ok) {
    throw damaged(fmt::format("splits the layers as [{}], but this run puts its {} layers on {} pipeline stage{}",
                              fmt::join(saved.split, ","), n_layers, stages, stages == 1 ? "" : "s"));
  }
  for (size_t l = 0; l < saved.plan.layers.size(); ++l) {
    const LayerPlan& layer = saved.plan.layers[l];
    if (layer.chunk_begin < -1 || layer.chunk_begin > static_cast<int64_t>(l)) {
      throw damaged(fmt::format("begins layer {}'s chunk at layer {}", l + 1, layer.chunk_begin + 1));
    }
  }
  return saved;
}

PlannerOptions planner_options(const Config& cfg) {
  PlannerOptions opts;
  opts.early_stop = cfg.ac.early_stop;
  opts.host_budget = cfg.ac.host_budget.empty() ? 0 : parse_host_budget(cfg.ac.host_budget, 0);
  return opts;
}

cost::StepShape step_shape(const Config& local, at::ScalarType dtype, int64_t resident) {
  const TrainConfig& t = local.train;
  cost::StepShape shape;
  shape.batch = t.batch;
  shape.seq = t.seq;
  shape.grad_accum = t.grad_accum;
  shape.ce_chunk = t.ce_chunk;
  shape.dtype = dtype;
  shape.device = local.run.device == "cpu" ? at::kCPU : at::kCUDA;
  shape.resident = resident;
  shape.tp = local.parallel.tp;
  shape.sp = local.parallel.sp;
  shape.zero_ranks = local.parallel.zero == 1 ? std::max<int64_t>(1, local.parallel.dp) : 1;
  return shape;
}

RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const TimeProfile& profile, int64_t resident, int64_t stage,
                 int64_t budget_reference, const SavedPlan* saved) {
  const int64_t L = cfg.model.n_layer;
  const Planner planner(cfg.model, step_shape(cfg, dtype, resident), profile.times, planner_options(cfg));
  RunPlan r;
  for (int s = 0; s < kSlotCount; ++s) {
    if (!planner.block().slot(static_cast<Slot>(s)).empty()) r.slots.push_back(slot_name(static_cast<Slot>(s)));
  }
  r.profile = profile;
  r.stage = stage;
  r.resumed = saved != nullptr;
  PipelineShape pipe;
  if (cfg.parallel.pp > 1) {
    pipe.stages = cfg.parallel.pp;
    pipe.schedule = cfg.parallel.schedule;
    // The policy's stages are stage_sizes'; the planner chooses them unless they are given.
    if (cfg.ac.budget.empty() || cfg.ac.num_layers_per_stage) pipe.split = stage_sizes(cfg.ac, L);
  }
  // Takes a pipeline plan (one stage: split {L}) as the run's.
  const auto take = [&](PipelinePlan planned) {
    r.plan = planned.plan;
    r.split = planned.split;
    r.predicted = planned.stages[static_cast<size_t>(stage)];
    r.stage_peaks.clear();
    for (const auto& st : planned.stages) r.stage_peaks.push_back(st.peak);
    r.pipeline = std::move(planned);
    r.device = device_memory(cfg, planner, r, pipe);
  };
  const auto one_stage = [&](const ActivationPlan& plan, const cost::StepPrediction& p) {
    PipelinePlan one;
    one.plan = plan;
    one.split = {L};
    one.stages = {p};
    return one;
  };
  // The plan for `bytes` of budget as the cost model counts them, or nullopt.
  const auto solve = [&](int64_t bytes) -> std::optional<PipelinePlan> {
    if (cfg.parallel.pp > 1) return planner.solve_pipeline(bytes, pipe);
    auto solved = planner.solve(bytes);
    if (!solved) return std::nullopt;
    return one_stage(solved->plan, solved->prediction);
  };
  const auto too_small = [&](int64_t budget) {
    return cfg.parallel.pp > 1
               ? BudgetTooSmall(pipeline_infeasible(cfg, planner, pipe, budget, cfg.ac.budget),
                                planner.min_pipeline_budget(pipe))
               : BudgetTooSmall(planner.infeasible(budget, cfg.ac.budget), planner.min_feasible_budget());
  };

  PipelineShape fixed = pipe;
  fixed.split = stage_sizes(cfg.ac, L);
  const ActivationPlan none_plan = compile_policy("none", L, cfg.model.dropout);
  const PipelinePlan none = cfg.parallel.pp > 1 ? planner.predict_pipeline(compile_policy("none", L), fixed)
                                                : one_stage(none_plan, planner.predict(none_plan));
  r.none_peak = none.peak();
  if (!cfg.ac.budget.empty()) {
    r.budget = parse_budget(cfg.ac.budget, budget_reference > 0 ? budget_reference : r.none_peak);
  }
  if (saved != nullptr) {
    pipe.split = saved->split;
    take(cfg.parallel.pp > 1 ? planner.predict_pipeline(saved->plan, pipe)
                             : one_stage(saved->plan, planner.predict(saved->plan)));
  } else if (cfg.ac.budget.empty()) {
    const ActivationPlan plan =
        offloading_what_exists(compile_policy(cfg.ac, L, cfg.model.dropout), planner.block(), cfg.model.arch, r.slots);
    take(cfg.parallel.pp > 1 ? planner.predict_pipeline(plan, pipe) : one_stage(plan, planner.predict(plan)));
  } else {
    // On CUDA the budget holds the caching allocator's reserved bytes, which move in
    // segments, not with the cost model's bytes: the cost model's budget goes down, by the
    // excess or a step of the range to the least feasible, until a plan reserves few enough.
    std::optional<int64_t> least;
    for (int64_t bytes = r.budget;;) {
      auto solved = solve(bytes);
      if (!solved && bytes == r.budget) throw too_small(r.budget);
      if (!solved) throw BudgetTooSmall(reserved_infeasible(cfg, r.budget, r.device_peak().reserved_peak), *least);
      take(std::move(*solved));
      const int64_t over = r.device_peak().reserved_peak - r.budget;
      if (over <= 0) break;
      if (!least) least = cfg.parallel.pp > 1 ? planner.min_pipeline_budget(pipe) : planner.min_feasible_budget();
      if (bytes == *least) {
        throw BudgetTooSmall(reserved_infeasible(cfg, r.budget, r.device_peak().reserved_peak), *least);
      }
      const int64_t step = std::max<int64_t>(1, (r.budget - *least) / kReservedSteps);
      bytes = std::max(*least, bytes - std::max(over, step));
    }
  }
  if (cfg.parallel.pp > 1) {
    if (profile.times.layer_pass_seconds > 0) {
      r.step_seconds = r.pipeline->simulated_seconds + stages_optimizer_seconds(profile, *r.pipeline);
      r.none_step_seconds = none.simulated_seconds + stages_optimizer_seconds(profile, none);
    }
    return r;
  }
  r.pipeline.reset();
  if (profile.base_seconds > 0) {
    r.step_seconds = profile.step_seconds(cfg.train.grad_accum, r.predicted.added_seconds());
    r.none_step_seconds = profile.step_seconds(cfg.train.grad_accum, 0.0);
  }
  return r;
}

}  // namespace remat
