#include "train/head_choice.h"

#include "remat/memory.h"
#include "train/data_parallel.h"
#include "train/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>

namespace remat {
namespace {

using memory::format_bytes;

// One head's planning: its configs (the attention op resolved with it), its plan, or why
// none fits.
struct Headed {
  LossHead head = LossHead::fused;
  Config cfg, local;
  std::optional<RunPlan> plan;
  std::string unfit;  // the planner's sentence when no plan fits
  int64_t least = 0;  // the minimum feasible budget when no plan fits
};

Headed plan_head(LossHead head, const Config& cfg, const Config& local, at::ScalarType dtype,
                 const ProfileOf& profile_of, int64_t resident, int64_t stage, int64_t reference) {
  Headed out{head, cfg, local, std::nullopt, "", 0};
  out.cfg.model.loss_head = out.local.model.loss_head = head;
  try {
    out.plan = plan_run_attention(out.cfg, out.local, dtype, profile_of, resident, stage, nullptr, reference);
  } catch (const BudgetTooSmall& e) {
    out.unfit = e.what();
    out.least = e.min_budget;
  }
  return out;
}

int64_t peak(const RunPlan& r) { return *std::max_element(r.stage_peaks.begin(), r.stage_peaks.end()); }

// A step's FLOPs the choice weighs without measured times: the plan's recompute and, for
// the recompute head, the logits it computes again ([tokens x d_model] by this rank's
// [d_model x vocab] per microbatch).
double weighed_flops(const Headed& h) {
  const Config& c = h.local;
  double flops = h.plan->predicted.recompute_flops;
  if (h.head == LossHead::recompute) {
    const double tokens = static_cast<double>(c.train.batch * c.train.seq);
    const double vocab = static_cast<double>(c.model.vocab_size / std::max<int64_t>(1, c.parallel.tp));
    flops += 2.0 * tokens * vocab * static_cast<double>(c.model.d_model) * static_cast<double>(c.train.grad_accum);
  }
  return flops;
}

// The head of `fused` and `recompute` (both planned) the run takes, with the reason.
std::pair<const Headed*, std::string> choose(const Headed& fused, const Headed& recompute) {
  if (!fused.plan && !recompute.plan) {
    throw std::invalid_argument(fmt::format(
        "{} model.loss_head = auto tried the recompute head too, whose least-memory plan needs {}.", fused.unfit,
        format_bytes(recompute.least)));
  }
  if (!fused.plan || !recompute.plan) {
    const Headed& fits = fused.plan ? fused : recompute;
    const Headed& over = fused.plan ? recompute : fused;
    return {&fits, fmt::format("the {} head's least-memory plan peaks at {}, over the {} budget; the {} head's plan "
                               "peaks at {}", loss_head_name(over.head), format_bytes(over.least),
                               format_bytes(fits.plan->budget), loss_head_name(fits.head),
                               format_bytes(peak(*fits.plan)))};
  }
  const RunPlan &f = *fused.plan, &r = *recompute.plan;
  const std::string within = fmt::format("both fit the {} budget (peaks {} and {}); ", format_bytes(f.budget),
                                         format_bytes(peak(f)), format_bytes(peak(r)));
  if (f.step_seconds > 0 && r.step_seconds > 0) {
    const Headed& faster = r.step_seconds < f.step_seconds ? recompute : fused;
    const Headed& slower = &faster == &fused ? recompute : fused;
    return {&faster, fmt::format("{}predicted step {:.1f} ms against the {} head's {:.1f} ms", within,
                                 1e3 * faster.plan->step_seconds, loss_head_name(slower.head),
                                 1e3 * slower.plan->step_seconds)};
  }
  // A pipeline's prediction is of one stage: ranks weighing their own stages' FLOPs could
  // choose apart, so without measured times every rank takes the fused head.
  if (f.split.size() > 1) {
    return {&fused, within + "without measured step times fused, the head that runs one product fewer"};
  }
  const double ff = weighed_flops(fused), rf = weighed_flops(recompute);
  const Headed& fewer = rf < ff ? recompute : fused;
  const Headed& more = &fewer == &fused ? recompute : fused;
  return {&fewer, fmt::format("{}{} FLOPs a step of recompute and head products against the {} head's {}", within,
                              format_count(std::min(ff, rf)), loss_head_name(more.head), format_count(std::max(ff, rf)))};
}

}  // namespace

RunPlan plan_run_auto(Config& cfg, Config& local, at::ScalarType dtype, const ProfileOf& profile_of,
                      int64_t resident, int64_t stage, const SavedPlan* saved) {
  if (local.model.loss_head != LossHead::automatic) {
    return plan_run_attention(cfg, local, dtype, profile_of, resident, stage, saved);
  }
  // Each head's and op's profile is taken once, however often the planning asks for it.
  std::map<std::pair<Attention, LossHead>, TimeProfile> taken_profiles;
  const ProfileOf once = [&](const Config& c) {
    const std::pair key{c.model.attention, c.model.loss_head};
    if (const auto found = taken_profiles.find(key); found != taken_profiles.end()) return found->second;
    return taken_profiles[key] = profile_of(c);
  };
  std::string reason;
  std::optional<Headed> taken;
  if (local.ac.budget.empty()) {
    reason = "no ac.budget, and the fused head runs one product fewer";
    taken = plan_head(LossHead::fused, cfg, local, dtype, once, resident, stage, 0);
  } else {
    // Both heads are held to the same bytes: a fraction is of the fused head's
    // no-recompute peak (with math where the attention op is still to be chosen).
    Config unbounded = local;
    unbounded.ac.budget.clear();
    unbounded.model.loss_head = LossHead::fused;
    if (unbounded.model.attention == Attention::automatic) unbounded.model.attention = Attention::math;
    const int64_t reference = plan_run(unbounded, dtype, once(unbounded), resident, stage).none_peak;
    const Headed fused = plan_head(LossHead::fused, cfg, local, dtype, once, resident, stage, reference);
    const Headed recompute = plan_head(LossHead::recompute, cfg, local, dtype, once, resident, stage, reference);
    const auto [chosen, why] = choose(fused, recompute);
    reason = why;
    taken = *chosen;
  }
  cfg = taken->cfg;
  local = taken->local;
  RunPlan planned = std::move(*taken->plan);
  planned.loss_head_choice =
      fmt::format("loss head: {} (model.loss_head = auto): {}", loss_head_name(taken->head), reason);
  planned.text = planned.loss_head_choice + "\n" + planned.text;
  return planned;
}

std::string AutoChoices::text() const {
  return loss_head + (!loss_head.empty() && !attention.empty() ? "\n" : "") + attention;
}

AutoChoices resolve_planned_auto(Config& cfg, at::ScalarType dtype, const std::string& budget, int64_t resident) {
  const bool head = cfg.model.loss_head == LossHead::automatic;
  const bool attention = cfg.model.attention == Attention::automatic;
  if (!head && !attention) return {};
  Config local = rank_share(cfg);
  local.ac.budget = budget;
  local.ac.profile = false;  // FLOPs, not measured times
  const ProfileOf flops = [](const Config&) {
    TimeProfile p;
    p.times.flops_per_second = 1.0;
    return p;
  };
  const RunPlan planned = plan_run_auto(cfg, local, dtype, flops, resident);
  return {planned.loss_head_choice, planned.attention_choice};
}

}  // namespace remat
