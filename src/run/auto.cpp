#include "run/auto.h"

#include "remat/memory.h"
#include "remat/ops/attention.h"
#include "run/choice.h"
#include "util/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace remat {
namespace {

using memory::format_bytes;
using ops::attention_refusal;

bool measured(const Prices& p) { return p.base_seconds > 0; }

// The candidate `name`, planned by `plan`, or the planner's word that no plan fits.
Candidate candidate(const std::string& name, const std::function<RunPlan()>& plan) {
  Candidate out;
  out.name = name;
  try {
    out.plan = plan();
  } catch (const BudgetTooSmall& e) {
    out.unfit = e.what();
    out.least = e.min_budget;
  }
  return out;
}

// `base`'s prices, with `other`'s times for the layers a plan runs op `other_op` in: its
// node times, and a layer's pass with it less with `base`'s (per layer from the pipeline
// probes, else the whole models' passes over their layers; 0 where either is unmeasured).
Prices with_other(const Prices& base, const Prices& other, Attention other_op, int64_t layers) {
  auto o = std::make_shared<cost::OtherAttention>();
  o->op = other_op;
  o->times = other.times;
  if (base.times.layer_pass_seconds > 0 && other.times.layer_pass_seconds > 0) {
    o->pass_delta = other.times.layer_pass_seconds - base.times.layer_pass_seconds;
  } else if (measured(base) && measured(other)) {
    o->pass_delta = (other.base_seconds - base.base_seconds) / static_cast<double>(layers);
  }
  Prices out = base;
  out.times.other_attention = std::move(o);
  return out;
}

// How many layers of `plan` run op `other`, and the rest `model_op`.
std::string layer_ops_text(const ActivationPlan& plan, Attention model_op, Attention other) {
  const auto n = std::count_if(plan.layers.begin(), plan.layers.end(),
                               [&](const LayerPlan& l) { return l.attention && *l.attention == other; });
  return fmt::format("{} of {} layers {}, the others {}", n, plan.layers.size(), attention_name(other),
                     attention_name(model_op));
}

RunPlan with_choice(RunPlan planned, Choice choice) {
  planned.choices.insert(planned.choices.begin(), std::move(choice));
  return planned;
}

// plan_run_auto for a named loss head: model.attention resolved. `reference` (bytes; 0:
// math's no-recompute peak) is what a fractional budget is a fraction of.
RunPlan resolve_attention(Config& cfg, Config& local, at::ScalarType dtype, const PricesOf& prices_of, int64_t stage,
                          const SavedPlan* saved, int64_t reference, int64_t host_budget) {
  if (local.model.attention != Attention::automatic) {
    const Attention op = local.model.attention;
    // A resumed run whose plan chose the op per layer: both ops' times price it.
    for (const LayerPlan& l : saved != nullptr ? saved->plan.layers : std::vector<LayerPlan>{}) {
      if (!l.attention || *l.attention == op) continue;
      Config other = local;
      other.model.attention = *l.attention;
      const Prices both = with_other(prices_of(local), prices_of(other), *l.attention, local.model.n_layer);
      return plan_run(local, dtype, both, stage, reference, saved, host_budget);
    }
    return plan_run(local, dtype, prices_of(local), stage, reference, saved, host_budget);
  }
  const auto with_op = [&](Attention a) {
    Config c = local;
    c.model.attention = a;
    return c;
  };
  ChoiceRules rules{"model.attention", "attention ops", false, "", ""};
  // Only the default op where nothing could tell the ops apart (neither bytes nor times).
  const bool alone = local.ac.budget.empty() && !local.ac.profile;
  std::vector<Attention> ops;
  std::vector<Prices> profiles;
  for (Attention a : kAttentionOps) {
    if (alone && !ops.empty()) break;
    // An op that cannot run this model (sdpa with attention dropout) is no candidate.
    if (!attention_refusal(a, local.model.dropout, local.run.device.is_cuda(), dtype, local.model.head_dim()).empty()) {
      continue;
    }
    ops.push_back(a);
    profiles.push_back(prices_of(with_op(a)));
  }
  rules.preferred_why = alone ? fmt::format(
                                    "no ac.budget and no measured step times: {}, the faster op on this CPU "
                                    "(docs/attention.md)",
                                    attention_name(ops[0]))
                              : fmt::format(
                                    "without measured step times {}, the faster op on this CPU "
                                    "(docs/attention.md)",
                                    attention_name(ops[0]));
  // Every op is held to the same bytes: a fraction is of the default op's no-recompute peak.
  if (!local.ac.budget.empty() && reference == 0) {
    Config unbounded = with_op(ops[0]);
    unbounded.ac.budget.clear();
    reference = plan_run(unbounded, dtype, profiles[0], stage, 0, nullptr, host_budget).none_peak;
  }
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < ops.size(); ++i) {
    candidates.push_back(candidate(attention_name(ops[i]), [&] {
      return plan_run(with_op(ops[i]), dtype, profiles[i], stage, reference, nullptr, host_budget);
    }));
  }
  Chosen chosen = choose(candidates, rules);
  const Attention op = ops[chosen.index];
  RunPlan planned = std::move(*candidates[chosen.index].plan);
  // Per layer, where every op's times are measured and a budget holds the plan: a layer may
  // run another op (of the faster where bytes allow, of the leaner where they do not). The
  // model keeps the op chosen above; the plan names each layer's.
  const bool all_measured = std::all_of(profiles.begin(), profiles.end(), measured);
  for (size_t i = 0; i < ops.size() && !local.ac.budget.empty() && all_measured; ++i) {
    if (i == chosen.index) continue;
    const Prices mixed_profile = with_other(profiles[chosen.index], profiles[i], ops[i], local.model.n_layer);
    Candidate mixed = candidate(
        "", [&] { return plan_run(with_op(op), dtype, mixed_profile, stage, reference, nullptr, host_budget); });
    const bool mixes = mixed.plan && std::any_of(mixed.plan->plan.layers.begin(), mixed.plan->plan.layers.end(),
                                                 [&](const LayerPlan& l) { return l.attention != op; });
    if (!mixes || mixed.plan->step_seconds >= planned.step_seconds) continue;
    chosen.reason = ChoiceReason::mixed_per_layer;
    chosen.text = fmt::format(
        "per layer, {}: predicted step {:.1f} ms within the {} budget (peak {}), against {} alone's {:.1f} ms{}",
        layer_ops_text(mixed.plan->plan, op, ops[i]), 1e3 * mixed.plan->step_seconds, format_bytes(mixed.plan->budget),
        format_bytes(mixed.plan->peak()), attention_name(op), 1e3 * planned.step_seconds,
        candidates[i].plan
            ? fmt::format(" and {} alone's {:.1f} ms", attention_name(ops[i]), 1e3 * candidates[i].plan->step_seconds)
            : fmt::format(" ({} alone does not fit)", attention_name(ops[i])));
    planned = std::move(*mixed.plan);
  }
  cfg.model.attention = local.model.attention = op;
  return with_choice(std::move(planned),
                     {"attention", "model.attention", attention_name(op), chosen.reason, chosen.text});
}

// The FLOPs a step of `local` spends that the heads differ by: the plan's recompute and,
// for the recompute head, the logits it computes again ([tokens x d_model] by this rank's
// [d_model x vocab] per microbatch).
double head_flops(const Config& local, const RunPlan& plan) {
  double flops = plan.predicted.recompute_flops;
  if (local.model.loss_head == LossHead::recompute) {
    const auto& t = local.train;
    const double vocab = static_cast<double>(local.model.vocab_size / std::max<int64_t>(1, local.parallel.tp));
    flops +=
        2.0 * static_cast<double>(t.batch * t.seq * t.grad_accum) * vocab * static_cast<double>(local.model.d_model);
  }
  return flops;
}

}  // namespace

RunPlan plan_run_auto(Config& cfg, Config& local, at::ScalarType dtype, const PricesOf& prices_of, int64_t stage,
                      const SavedPlan* saved, int64_t host_budget) {
  if (local.model.loss_head != LossHead::automatic) {
    return resolve_attention(cfg, local, dtype, prices_of, stage, saved, 0, host_budget);
  }
  // Each head's and op's profile is taken once, however often the planning asks for it.
  std::map<std::pair<Attention, LossHead>, Prices> taken;
  const PricesOf once = [&](const Config& c) {
    const std::pair key{c.model.attention, c.model.loss_head};
    if (const auto found = taken.find(key); found != taken.end()) return found->second;
    return taken[key] = prices_of(c);
  };
  const std::vector<LossHead> heads =
      local.ac.budget.empty() ? std::vector{LossHead::fused} : std::vector{LossHead::fused, LossHead::recompute};
  // Both heads are held to the same bytes: a fraction is of the fused head's no-recompute
  // peak (with the default op where the attention op is still to be chosen).
  int64_t reference = 0;
  if (!local.ac.budget.empty()) {
    Config unbounded = local;
    unbounded.ac.budget.clear();
    unbounded.model.loss_head = LossHead::fused;
    if (unbounded.model.attention == Attention::automatic) unbounded.model.attention = kAttentionOps[0];
    reference = plan_run(unbounded, dtype, once(unbounded), stage, 0, nullptr, host_budget).none_peak;
  }
  std::vector<std::pair<Config, Config>> configs;
  std::vector<Candidate> candidates;
  for (LossHead h : heads) {
    configs.emplace_back(cfg, local);
    auto& [c, l] = configs.back();
    c.model.loss_head = l.model.loss_head = h;
    candidates.push_back(candidate(fmt::format("the {} head", loss_head_name(h)), [&] {
      return resolve_attention(c, l, dtype, once, stage, nullptr, reference, host_budget);
    }));
    if (candidates.back().plan) candidates.back().weighed_flops = head_flops(l, *candidates.back().plan);
  }
  ChoiceRules rules{"model.loss_head", "loss heads", local.parallel.pp == 1, "of recompute and head products",
                    heads.size() == 1 ? "no ac.budget, and the fused head runs one product fewer"
                                      : "without measured step times fused, the head that runs one product fewer"};
  const Chosen chosen = choose(candidates, rules);
  cfg = configs[chosen.index].first;
  local = configs[chosen.index].second;
  return with_choice(std::move(*candidates[chosen.index].plan),
                     {"loss head", "model.loss_head", loss_head_name(heads[chosen.index]), chosen.reason, chosen.text});
}

}  // namespace remat
