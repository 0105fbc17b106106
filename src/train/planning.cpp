#include "train/planning.h"

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

std::string slots_text(const std::set<std::string>& dropped) {
  if (dropped.empty()) return "keep all";
  std::string out = "drop";
  for (const auto& s : dropped) out += " " + s;
  return out;
}

// Consecutive layers planned alike: layers first to last (from 0), what they keep, each
// one's kept bytes.
struct LayerGroup {
  int64_t first = 0, last = 0;
  std::string text;
  int64_t kept = 0;
};

std::vector<LayerGroup> layer_groups(const ActivationPlan& plan, const cost::StepPrediction& pred) {
  std::vector<LayerGroup> out;
  const int64_t L = static_cast<int64_t>(plan.layers.size());
  const int64_t F = pred.first_layer, E = F + static_cast<int64_t>(pred.layers.size());
  for (int64_t l = F; l < E; ++l) {
    const LayerPlan& lp = plan.layers[static_cast<size_t>(l)];
    const bool chunk_start = lp.chunk_begin < 0 && l + 1 < std::min(L, E) &&
                             plan.layers[static_cast<size_t>(l + 1)].chunk_begin == l;
    std::string text;
    if (lp.chunk_begin >= 0) {
      text = fmt::format("keep nothing: recomputed with the chunk from layer {}", lp.chunk_begin + 1);
    } else if (chunk_start) {
      text = "keep input: the chunk's forward is recomputed in its last layer's backward";
    } else {
      text = slots_text(lp.dropped);
    }
    if (lp.input_sharded) text += ", input as a share per tensor-parallel rank";
    if (lp.attention) text += fmt::format(", {} attention", attention_name(*lp.attention));
    const auto& c = pred.layers[static_cast<size_t>(l - F)];
    if (!out.empty() && out.back().text == text && out.back().kept == c.kept && !chunk_start && lp.chunk_begin < 0) {
      out.back().last = l;
    } else {
      out.push_back({l, l, text, c.kept});
    }
  }
  return out;
}

// The optimizer step of the slowest stage to update (they update at once): the measured
// step's time per parameter byte updated, times the bytes each stage updates (half its
// moments' bytes: its share under ZeRO-1).
double stages_optimizer_seconds(const TimeProfile& profile, const PipelinePlan& r) {
  if (profile.optimizer_bytes <= 0) return 0;
  int64_t most = 0;
  for (const auto& st : r.stages) most = std::max(most, st.statics.optimizer / 2);
  return profile.optimizer_seconds * static_cast<double>(most) / static_cast<double>(profile.optimizer_bytes);
}

// Each stage's layers, what they keep, peak and time; the bottleneck; the predicted step
// time `step_seconds` (0: none).
std::string pipeline_text(const Config& cfg, const PipelinePlan& r, int64_t stage, const TimeProfile& profile,
                          double step_seconds) {
  const bool profiled = profile.base_seconds > 0;
  const int64_t m = cfg.train.grad_accum;
  std::string text = fmt::format("pipeline: {} stages, {} schedule, {} microbatch{}; this rank is stage {}\n",
                                 r.stages.size(), pipeline::schedule_name(cfg.parallel.schedule), m,
                                 m == 1 ? "" : "es", stage + 1);
  for (size_t s = 0; s < r.stages.size(); ++s) {
    text += stage_line(r, s, m, cfg.parallel.schedule,
                       fmt::format("{:.1f} ms per microbatch ({})", 1e3 * r.stage_seconds[s],
                                   profile.times.layer_pass_seconds > 0
                                       ? "its layers' and ends' measured passes, its recompute's node times"
                                   : profiled ? "its nodes' times in the time profile"
                                              : "its FLOPs at the measured matmul rate")) +
            "\n";
    text += layer_groups_text(r.plan, r.stages[s]);
  }
  text += fmt::format("bottleneck: stage {}; the schedule takes (microbatches + stages - 1) = {} times its {:.1f} ms, "
                      "{:.1f} ms, plus the optimizer\n", r.bottleneck + 1, m + static_cast<int64_t>(r.stages.size()) - 1,
                      1e3 * r.stage_seconds[static_cast<size_t>(r.bottleneck)], 1e3 * r.schedule_seconds);
  if (step_seconds > 0) {
    text += fmt::format("predicted step time {:.1f} ms: the schedule simulated stage by stage, {:.1f} ms (transfers "
                        "not priced), + {:.1f} ms the slowest stage's optimizer\n", 1e3 * step_seconds,
                        1e3 * r.simulated_seconds, 1e3 * (step_seconds - r.simulated_seconds));
  }
  return text;
}

}  // namespace

std::string layer_groups_text(const ActivationPlan& plan, const cost::StepPrediction& pred) {
  std::string text;
  for (const LayerGroup& g : layer_groups(plan, pred)) {
    const std::string range = g.first == g.last ? fmt::format("layer {}", g.first + 1)
                                                : fmt::format("layers {}-{}", g.first + 1, g.last + 1);
    text += fmt::format("  {:<14} keeps {:>10} each   {}\n", range, format_bytes(g.kept), g.text);
  }
  return text;
}

std::string stage_line(const PipelinePlan& r, size_t s, int64_t microbatches, pipeline::Schedule schedule,
                       const std::string& work) {
  const cost::StepPrediction& p = r.stages[s];
  const int64_t first = p.first_layer + 1, last = p.first_layer + static_cast<int64_t>(p.layers.size());
  const int64_t held =
      pipeline::in_flight(schedule, static_cast<int64_t>(r.stages.size()), static_cast<int64_t>(s), microbatches);
  return fmt::format("stage {}: {}, {} microbatch{} in flight, peak {} ({}), {}", s + 1,
                     first == last ? fmt::format("layer {} (1)", first)
                                   : fmt::format("layers {}-{} ({})", first, last, last - first + 1),
                     held, held == 1 ? "" : "es", format_bytes(p.peak), p.peak_at, work);
}

std::string pipeline_infeasible(const Config& cfg, const Planner& planner, const PipelineShape& pipe, int64_t budget,
                                const std::string& given) {
  const int64_t m = cfg.train.grad_accum;
  return fmt::format(
      "The memory budget {} (\"{}\") fits no plan of {} on {} pipeline stages ({} schedule, {} microbatch{}): the "
      "least budget every stage fits is {}; give at least that, lower train.batch, train.seq or train.grad_accum{}, "
      "or use more stages.", format_bytes(budget), given, cfg.model.preset, pipe.stages,
      pipeline::schedule_name(pipe.schedule), m, m == 1 ? "" : "es", format_bytes(planner.min_pipeline_budget(pipe)),
      pipe.schedule == pipeline::Schedule::gpipe ? " (gpipe holds every microbatch; 1f1b at most one per stage)" : "");
}

namespace {

// Where a resumed run's plan comes from, before the plan itself.
std::string saved_note(const SavedPlan* saved) {
  return saved != nullptr ? "plan: the checkpoint's, as the run trained before it stopped\n" : "";
}

}  // namespace

std::string saved_plan_json(const RunPlan& r) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerPlan& l : r.plan.layers) {
    nlohmann::json layer{{"dropped", l.dropped}, {"chunk_begin", l.chunk_begin}, {"input_sharded", l.input_sharded}};
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
      layer.dropped = l.at("dropped").get<std::set<std::string>>();
      layer.chunk_begin = l.at("chunk_begin").get<int64_t>();
      layer.input_sharded = l.at("input_sharded").get<bool>();
      if (l.contains("attention")) {
        const std::string op = l.at("attention").get<std::string>();
        if (op != attention_name(Attention::math) && op != attention_name(Attention::tiled)) {
          throw damaged(fmt::format("runs attention '{}' in layer {}, which is not math or tiled", op,
                                    saved.plan.layers.size() + 1));
        }
        layer.attention = op == attention_name(Attention::math) ? Attention::math : Attention::tiled;
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
  const std::set<std::string> slots(block_slots().begin(), block_slots().end());
  for (size_t l = 0; l < saved.plan.layers.size(); ++l) {
    const LayerPlan& layer = saved.plan.layers[l];
    for (const std::string& slot : layer.dropped) {
      if (!slots.count(slot)) throw damaged(fmt::format("drops '{}' in layer {}, which no block has", slot, l + 1));
    }
    if (layer.chunk_begin < -1 || layer.chunk_begin > static_cast<int64_t>(l)) {
      throw damaged(fmt::format("begins layer {}'s chunk at layer {}", l + 1, layer.chunk_begin + 1));
    }
  }
  return saved;
}

RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const TimeProfile& profile, int64_t resident,
                 int64_t stage, int64_t budget_reference, const SavedPlan* saved) {
  const auto& t = cfg.train;
  const int64_t L = cfg.model.n_layer;
  cost::StepShape shape;
  shape.batch = t.batch;
  shape.seq = t.seq;
  shape.grad_accum = t.grad_accum;
  shape.ce_chunk = t.ce_chunk;
  shape.dtype = dtype;
  shape.resident = resident;
  shape.tp = cfg.parallel.tp;
  shape.sp = cfg.parallel.sp;
  shape.zero_ranks = cfg.parallel.zero == 1 ? std::max<int64_t>(1, cfg.parallel.dp) : 1;
  PlannerOptions opts;
  opts.early_stop = cfg.ac.early_stop;
  const Planner planner(cfg.model, shape, profile.times, opts);
  RunPlan r;
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
    r.text = saved_note(saved) + explain_plan(r.plan) + pipeline_text(cfg, planned, stage, profile, r.step_seconds);
    if (profile.base_seconds > 0) r.text += fmt::format("time profile {}\n", profile.path);
    if (r.budget > 0) {
      r.text += fmt::format("budget {} (ac.budget = \"{}\") per rank: the busiest stage peaks at {}; without "
                            "recompute it would peak at {}\n", format_bytes(r.budget), cfg.ac.budget,
                            format_bytes(planned.peak()), format_bytes(r.none_peak));
    }
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
  const auto& p = r.predicted;
  r.none_peak = planner.none_peak();
  if (profile.base_seconds > 0) {
    r.step_seconds = profile.step_seconds(t.grad_accum, p.recompute_seconds + p.attention_seconds);
    r.none_step_seconds = profile.step_seconds(t.grad_accum, 0.0);
  }
  r.text = saved_note(saved) + explain_plan(r.plan) + "\npredicted per microbatch (kept bytes, recompute FLOPs):\n";
  r.text += fmt::format("  embedding  {:>11}\n", format_bytes(p.embedding));
  for (size_t l = 0; l < p.layers.size(); ++l) {
    r.text += fmt::format("  layer {:<4} {:>11}  {:>8} FLOPs recomputed\n", l + 1, format_bytes(p.layers[l].kept),
                          format_count(p.layers[l].recompute_flops));
  }
  r.text += fmt::format("  head       {:>11}  ({} loss head, model.loss_head)\n", format_bytes(p.head),
                        loss_head_name(cfg.model.loss_head));
  r.text += fmt::format("predicted step: peak {} in the {} (parameters {}, gradients {}, optimizer {}, kept "
                        "activations {}, working set {}, token corpus {}); recompute {} FLOPs, {:.1f} ms\n",
                        format_bytes(p.peak), p.peak_at, format_bytes(p.statics.params), format_bytes(p.statics.grads),
                        format_bytes(p.statics.optimizer), format_bytes(p.peak - p.statics.total() - p.working_set),
                        format_bytes(p.working_set), format_bytes(p.statics.resident), format_count(p.recompute_flops), 1e3 * p.recompute_seconds);
  if (profile.times.link_bytes_per_second > 0) {
    r.text += fmt::format("tensor-parallel links measured at {:.2f} GB/s a rank sends and {:.1f} us a ring step; the "
                          "recompute re-runs {:.1f} ms of collectives\n", profile.times.link_bytes_per_second / 1e9,
                          1e6 * profile.times.link_latency_seconds, 1e3 * p.recompute_link_seconds);
  }
  if (r.step_seconds > 0) {
    const std::string other =
        p.attention_seconds != 0
            ? fmt::format(" {:+.1f} ms the layers running the other attention op", 1e3 * p.attention_seconds)
            : "";
    r.text += fmt::format("predicted step time {:.1f} ms: {} x {:.1f} ms forward and backward{} + {:.1f} ms recompute + "
                          "{:.1f} ms optimizer (time profile {})\n", 1e3 * r.step_seconds, t.grad_accum,
                          1e3 * profile.base_seconds, other, 1e3 * p.recompute_seconds,
                          1e3 * profile.optimizer_seconds, profile.path);
  }
  if (r.budget > 0) {
    // A plan mixing the attention ops per layer is compared with the model's op in every
    // layer, as a run without recompute would train.
    const bool mixed = std::any_of(r.plan.layers.begin(), r.plan.layers.end(),
                                   [](const LayerPlan& lp) { return lp.attention.has_value(); });
    const std::string every = mixed ? fmt::format(" ({} attention in every layer)", attention_name(cfg.model.attention)) : "";
    r.text += fmt::format("budget {} (ac.budget = \"{}\"): the planner's plan peaks at {}; without recompute{} the step "
                          "would peak at {}{}\n", format_bytes(r.budget), cfg.ac.budget, format_bytes(p.peak), every,
                          format_bytes(r.none_peak),
                          r.none_step_seconds > 0 ? fmt::format(" and take {:.1f} ms", 1e3 * r.none_step_seconds) : "");
  }
  return r;
}

}  // namespace remat
