#include "run/planning.h"

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

}  // namespace

std::string saved_plan_json(const RunPlan& r) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerPlan& l : r.plan.layers) {
    nlohmann::json layer{
        {"dropped", l.dropped.names()}, {"chunk_begin", l.chunk_begin}, {"input_sharded", l.input_sharded}};
    if (l.attention) layer["attention"] = attention_name(*l.attention);
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

cost::StepShape step_shape(const Config& local, at::ScalarType dtype, int64_t resident) {
  const TrainConfig& t = local.train;
  cost::StepShape shape;
  shape.batch = t.batch;
  shape.seq = t.seq;
  shape.grad_accum = t.grad_accum;
  shape.ce_chunk = t.ce_chunk;
  shape.dtype = dtype;
  shape.resident = resident;
  shape.tp = local.parallel.tp;
  shape.sp = local.parallel.sp;
  shape.zero_ranks = local.parallel.zero == 1 ? std::max<int64_t>(1, local.parallel.dp) : 1;
  return shape;
}

RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const TimeProfile& profile, int64_t resident, int64_t stage,
                 int64_t budget_reference, const SavedPlan* saved) {
  const int64_t L = cfg.model.n_layer;
  PlannerOptions opts;
  opts.early_stop = cfg.ac.early_stop;
  const Planner planner(cfg.model, step_shape(cfg, dtype, resident), profile.times, opts);
  RunPlan r;
  for (int s = 0; s < kSlotCount; ++s) {
    if (!planner.block().slot(static_cast<Slot>(s)).empty()) r.slots.push_back(slot_name(static_cast<Slot>(s)));
  }
  r.profile = profile;
  r.stage = stage;
  r.resumed = saved != nullptr;
  if (cfg.parallel.pp > 1) {
    PipelineShape pipe;
    pipe.stages = cfg.parallel.pp;
    pipe.schedule = cfg.parallel.schedule;
    // The policy's stages are stage_sizes'; the planner chooses them unless they are given.
    if (cfg.ac.budget.empty() || cfg.ac.num_layers_per_stage) pipe.split = stage_sizes(cfg.ac, L);
    PipelineShape fixed = pipe;
    fixed.split = stage_sizes(cfg.ac, L);
    const PipelinePlan none = planner.predict_pipeline(compile_policy("none", L), fixed);
    PipelinePlan planned;
    if (!cfg.ac.budget.empty()) {
      r.budget = parse_budget(cfg.ac.budget, budget_reference > 0 ? budget_reference : none.peak());
    }
    if (saved != nullptr) {
      pipe.split = saved->split;
      planned = planner.predict_pipeline(saved->plan, pipe);
    } else if (cfg.ac.budget.empty()) {
      planned = planner.predict_pipeline(compile_policy(cfg.ac, L, cfg.model.dropout), pipe);
    } else {
      auto solved = planner.solve_pipeline(r.budget, pipe);
      if (!solved) {
        throw BudgetTooSmall(pipeline_infeasible(cfg, planner, pipe, r.budget, cfg.ac.budget),
                             planner.min_pipeline_budget(pipe));
      }
      planned = std::move(*solved);
    }
    r.plan = planned.plan;
    r.split = planned.split;
    r.predicted = planned.stages[static_cast<size_t>(stage)];
    for (const auto& st : planned.stages) r.stage_peaks.push_back(st.peak);
    r.none_peak = none.peak();
    if (profile.times.layer_pass_seconds > 0) {
      r.step_seconds = planned.simulated_seconds + stages_optimizer_seconds(profile, planned);
      r.none_step_seconds = none.simulated_seconds + stages_optimizer_seconds(profile, none);
    }
    r.pipeline = std::move(planned);
    return r;
  }
  if (!cfg.ac.budget.empty()) {
    r.budget = parse_budget(cfg.ac.budget, budget_reference > 0 ? budget_reference : planner.none_peak());
  }
  if (saved != nullptr) {
    r.plan = saved->plan;
    r.predicted = planner.predict(r.plan);
  } else if (cfg.ac.budget.empty()) {
    r.plan = compile_policy(cfg.ac, L, cfg.model.dropout);
    r.predicted = planner.predict(r.plan);
  } else {
    auto solved = planner.solve(r.budget);
    if (!solved) throw BudgetTooSmall(planner.infeasible(r.budget, cfg.ac.budget), planner.min_feasible_budget());
    r.plan = solved->plan;
    r.predicted = solved->prediction;
  }
  r.split = {L};
  r.stage_peaks = {r.predicted.peak};
  r.none_peak = planner.none_peak();
  if (profile.base_seconds > 0) {
    r.step_seconds =
        profile.step_seconds(cfg.train.grad_accum, r.predicted.recompute_seconds + r.predicted.attention_seconds);
    r.none_step_seconds = profile.step_seconds(cfg.train.grad_accum, 0.0);
  }
  return r;
}

}  // namespace remat
