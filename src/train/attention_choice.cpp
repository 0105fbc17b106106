#include "train/attention_choice.h"

#include "remat/memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

namespace remat {
namespace {

using memory::format_bytes;

// One op's planning: its plan, or why none fits.
struct Planned {
  Attention attention = Attention::math;
  std::optional<RunPlan> plan;
  std::string unfit;   // the planner's sentence when no plan fits
  int64_t least = 0;   // the minimum feasible budget when no plan fits
};

Planned plan_with(const Config& local, Attention a, at::ScalarType dtype, const TimeProfile& profile,
                  int64_t resident, int64_t stage, int64_t reference) {
  Config c = local;
  c.model.attention = a;
  Planned out;
  out.attention = a;
  try {
    out.plan = plan_run(c, dtype, profile, resident, stage, reference);
  } catch (const BudgetTooSmall& e) {
    out.unfit = e.what();
    out.least = e.min_budget;
  }
  return out;
}

int64_t peak(const RunPlan& r) { return *std::max_element(r.stage_peaks.begin(), r.stage_peaks.end()); }

Attention other_op(Attention a) { return a == Attention::math ? Attention::tiled : Attention::math; }

bool measured(const TimeProfile& p) { return p.base_seconds > 0; }

// `base`'s profile, with the other op's times for the layers a plan runs it in: its node
// times, and a layer's pass with it less with `base`'s (per layer from the pipeline probes,
// else the whole models' passes over their layers; 0 where either is unmeasured).
TimeProfile with_other(const TimeProfile& base, const TimeProfile& other, Attention other_attention, int64_t layers) {
  auto o = std::make_shared<cost::OtherAttention>();
  o->op = other_attention;
  o->times = other.times;
  if (base.times.layer_pass_seconds > 0 && other.times.layer_pass_seconds > 0) {
    o->pass_delta = other.times.layer_pass_seconds - base.times.layer_pass_seconds;
  } else if (measured(base) && measured(other)) {
    o->pass_delta = (other.base_seconds - base.base_seconds) / static_cast<double>(layers);
  }
  TimeProfile out = base;
  out.times.other_attention = std::move(o);
  return out;
}

// How many layers of `plan` run which op.
std::string layer_ops_text(const ActivationPlan& plan, Attention model_op) {
  const auto other = std::count_if(plan.layers.begin(), plan.layers.end(),
                                   [&](const LayerPlan& l) { return l.attention && *l.attention != model_op; });
  return fmt::format("{} of {} layers {}, the others {}", other, plan.layers.size(),
                     attention_name(other_op(model_op)), attention_name(model_op));
}

// The op of `a` and `b` (math first) the run takes, with the reason; both planned.
std::pair<const Planned*, std::string> choose(const Planned& a, const Planned& b) {
  if (!a.plan && !b.plan) {
    const Planned& lower = a.least <= b.least ? a : b;
    throw BudgetTooSmall(fmt::format("model.attention = auto tried both attention ops and no plan of either fits: {} "
                                     "needs a budget of at least {}, {} at least {}. With {}: {}",
                                     attention_name(a.attention), format_bytes(a.least), attention_name(b.attention),
                                     format_bytes(b.least), attention_name(lower.attention), lower.unfit),
                         lower.least);
  }
  if (!a.plan || !b.plan) {
    const Planned& fits = a.plan ? a : b;
    const Planned& over = a.plan ? b : a;
    return {&fits, fmt::format("{}'s least-memory plan peaks at {}, over the {} budget; {}'s plan peaks at {}",
                               attention_name(over.attention), format_bytes(over.least),
                               format_bytes(fits.plan->budget), attention_name(fits.attention),
                               format_bytes(peak(*fits.plan)))};
  }
  const RunPlan &ra = *a.plan, &rb = *b.plan;
  const std::string within =
      ra.budget > 0 ? fmt::format("both fit the {} budget (peaks {} and {}); ", format_bytes(ra.budget),
                                  format_bytes(peak(ra)), format_bytes(peak(rb)))
                    : "";
  if (ra.step_seconds > 0 && rb.step_seconds > 0) {
    const Planned& faster = rb.step_seconds < ra.step_seconds ? b : a;
    const Planned& slower = &faster == &a ? b : a;
    return {&faster, fmt::format("{}predicted step {:.1f} ms against {}'s {:.1f} ms", within,
                                 1e3 * faster.plan->step_seconds, attention_name(slower.attention),
                                 1e3 * slower.plan->step_seconds)};
  }
  return {&a, fmt::format("{}without measured step times {}, the faster op on this CPU "
                          "(README \"Attention\")", within, attention_name(a.attention))};
}

}  // namespace

RunPlan plan_run_attention(Config& cfg, Config& local, at::ScalarType dtype, const ProfileOf& profile_of,
                           int64_t resident, int64_t stage, const SavedPlan* saved, int64_t reference) {
  if (local.model.attention != Attention::automatic) {
    const Attention op = local.model.attention;
    const bool mixed =
        saved != nullptr && std::any_of(saved->plan.layers.begin(), saved->plan.layers.end(),
                                        [&](const LayerPlan& l) { return l.attention && *l.attention != op; });
    if (!mixed) return plan_run(local, dtype, profile_of(local), resident, stage, reference, saved);
    // A resumed run whose plan chose the op per layer: both ops' times price it.
    Config other_cfg = local;
    other_cfg.model.attention = other_op(op);
    const TimeProfile both = with_other(profile_of(local), profile_of(other_cfg), other_op(op), local.model.n_layer);
    return plan_run(local, dtype, both, resident, stage, reference, saved);
  }
  Config math_cfg = local;
  math_cfg.model.attention = Attention::math;
  const TimeProfile math_profile = profile_of(math_cfg);
  std::string reason;
  Attention chosen = Attention::math;
  std::optional<RunPlan> planned;
  if (local.ac.budget.empty() && !local.ac.profile) {
    reason = "no ac.budget and no measured step times: math, the faster op on this CPU "
             "(README \"Attention\")";
    planned = plan_run(math_cfg, dtype, math_profile, resident, stage);
  } else {
    // Both ops are held to the same bytes: a fraction is of math's no-recompute peak.
    if (!local.ac.budget.empty() && reference == 0) {
      Config unbounded = math_cfg;
      unbounded.ac.budget.clear();
      reference = plan_run(unbounded, dtype, math_profile, resident, stage).none_peak;
    }
    Config tiled_cfg = local;
    tiled_cfg.model.attention = Attention::tiled;
    const TimeProfile tiled_profile = profile_of(tiled_cfg);
    const Planned math = plan_with(local, Attention::math, dtype, math_profile, resident, stage, reference);
    const Planned tiled = plan_with(local, Attention::tiled, dtype, tiled_profile, resident, stage, reference);
    const auto [taken, why] = choose(math, tiled);
    chosen = taken->attention;
    reason = why;
    planned = *taken->plan;
    // Per layer, where both ops' times are measured and a budget holds the plan: each layer
    // may run the other op (a layer of the faster op where bytes allow, of the leaner where
    // they do not). The model keeps the op chosen above; the plan names each layer's.
    if (!local.ac.budget.empty() && measured(math_profile) && measured(tiled_profile)) {
      const bool math_base = chosen == Attention::math;
      const TimeProfile mixed_profile = with_other(math_base ? math_profile : tiled_profile,
                                                   math_base ? tiled_profile : math_profile, other_op(chosen),
                                                   local.model.n_layer);
      Planned mixed = plan_with(local, chosen, dtype, mixed_profile, resident, stage, reference);
      const bool mixes = mixed.plan && std::any_of(mixed.plan->plan.layers.begin(), mixed.plan->plan.layers.end(),
                                                   [&](const LayerPlan& l) { return l.attention != chosen; });
      if (mixes && mixed.plan->step_seconds < planned->step_seconds) {
        const Planned& other = math_base ? tiled : math;
        const std::string layers = layer_ops_text(mixed.plan->plan, chosen);
        reason = fmt::format(
            "per layer, {}: predicted step {:.1f} ms within the {} budget (peak {}), against {} alone's {:.1f} ms{}",
            layers, 1e3 * mixed.plan->step_seconds, format_bytes(mixed.plan->budget), format_bytes(peak(*mixed.plan)),
            attention_name(chosen), 1e3 * planned->step_seconds,
            other.plan ? fmt::format(" and {} alone's {:.1f} ms", attention_name(other.attention),
                                     1e3 * other.plan->step_seconds)
                       : fmt::format(" ({} alone does not fit)", attention_name(other.attention)));
        planned = std::move(*mixed.plan);
      }
    }
  }
  cfg.model.attention = local.model.attention = chosen;
  planned->attention_choice = fmt::format("attention: {} (model.attention = auto): {}", attention_name(chosen), reason);
  planned->text = planned->attention_choice + "\n" + planned->text;
  return std::move(*planned);
}

}  // namespace remat
