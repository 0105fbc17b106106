#include "train/planning.h"

#include "remat/memory.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "train/progress.h"

#include <fmt/format.h>

#include <algorithm>

namespace remat {

RunPlan plan_run(const Config& cfg, at::ScalarType dtype, const TimeProfile& profile, int64_t resident) {
  const auto& t = cfg.train;
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
  if (cfg.ac.budget.empty()) {
    r.plan = compile_policy(cfg.ac, cfg.model.n_layer, cfg.model.dropout);
    r.predicted = planner.predict(r.plan);
  } else {
    r.budget = parse_budget(cfg.ac.budget, planner.none_peak());
    auto solved = planner.solve(r.budget);
    if (!solved) throw std::invalid_argument(planner.infeasible(r.budget, cfg.ac.budget));
    r.plan = solved->plan;
    r.predicted = solved->prediction;
  }
  using memory::format_bytes;
  const auto& p = r.predicted;
  r.none_peak = planner.none_peak();
  if (profile.base_seconds > 0) {
    r.step_seconds = profile.step_seconds(t.grad_accum, p.recompute_seconds);
    r.none_step_seconds = profile.step_seconds(t.grad_accum, 0.0);
  }
  r.text = explain_plan(r.plan) + "\npredicted per microbatch (kept bytes, recompute FLOPs):\n";
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
  if (r.step_seconds > 0) {
    r.text += fmt::format("predicted step time {:.1f} ms: {} x {:.1f} ms forward and backward + {:.1f} ms recompute + "
                          "{:.1f} ms optimizer (time profile {})\n", 1e3 * r.step_seconds, t.grad_accum,
                          1e3 * profile.base_seconds, 1e3 * p.recompute_seconds, 1e3 * profile.optimizer_seconds,
                          profile.path);
  }
  if (r.budget > 0) {
    r.text += fmt::format("budget {} (ac.budget = \"{}\"): the planner's plan peaks at {}; without recompute the step "
                          "would peak at {}{}\n", format_bytes(r.budget), cfg.ac.budget, format_bytes(p.peak),
                          format_bytes(r.none_peak),
                          r.none_step_seconds > 0 ? fmt::format(" and take {:.1f} ms", 1e3 * r.none_step_seconds) : "");
  }
  return r;
}

}  // namespace remat
