#include "run/choice.h"

#include "remat/memory.h"
#include "util/progress.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace remat {
namespace {

using memory::format_bytes;

// "a", "a and b", "a, b and c".
std::string listed(const std::vector<std::string>& items) {
  if (items.size() <= 1) return items.empty() ? "" : items.front();
  std::vector<std::string> head(items.begin(), items.end() - 1);
  return fmt::format("{} and {}", fmt::join(head, ", "), items.back());
}

}  // namespace

std::string Choice::line() const { return fmt::format("{}: {} ({} = auto): {}", label, taken, setting, why); }

Chosen choose(const std::vector<Candidate>& c, const ChoiceRules& rules) {
  TORCH_INTERNAL_ASSERT(!c.empty(), "choose: no candidates");
  std::vector<size_t> fit, over;
  for (size_t i = 0; i < c.size(); ++i) (c[i].plan ? fit : over).push_back(i);
  if (fit.empty()) {
    size_t lowest = 0;
    std::vector<std::string> needs;
    for (size_t i = 0; i < c.size(); ++i) {
      if (c[i].least < c[lowest].least) lowest = i;
      needs.push_back(fmt::format("{} needs a budget of at least {}", c[i].name, format_bytes(c[i].least)));
    }
    throw BudgetTooSmall(fmt::format("{} = auto tried {} {} and no plan of {} fits: {}. With {}: {}", rules.setting,
                                     c.size() == 2 ? "both" : fmt::format("all {}", c.size()), rules.candidates,
                                     c.size() == 2 ? "either" : "any", listed(needs), c[lowest].name, c[lowest].unfit),
                         c[lowest].least);
  }
  if (c.size() == 1) return {0, ChoiceReason::only_candidate, rules.preferred_why};
  const RunPlan& first = *c[fit.front()].plan;
  if (fit.size() == 1) {
    std::vector<std::string> peaks;
    for (size_t i : over)
      peaks.push_back(fmt::format("{}'s least-memory plan peaks at {}", c[i].name, format_bytes(c[i].least)));
    return {fit.front(), ChoiceReason::only_fit,
            fmt::format("{}, over the {} budget; {}'s plan peaks at {}", listed(peaks), format_bytes(first.budget),
                        c[fit.front()].name, format_bytes(first.peak()))};
  }
  std::string within;
  if (first.budget > 0) {
    std::vector<std::string> peaks;
    for (size_t i : fit) peaks.push_back(format_bytes(c[i].plan->peak()));
    within = fmt::format("{} fit the {} budget (peaks {}); ", fit.size() == 2 ? "both" : fmt::format("{}", fit.size()),
                         format_bytes(first.budget), listed(peaks));
  }
  // The others of `fit` than `taken`, each with its figure.
  const auto others = [&](size_t taken, const auto& figure) {
    std::vector<std::string> out;
    for (size_t i : fit) {
      if (i != taken) out.push_back(fmt::format("{}'s {}", c[i].name, figure(c[i])));
    }
    return listed(out);
  };
  const bool timed = std::all_of(fit.begin(), fit.end(), [&](size_t i) { return c[i].plan->step_seconds > 0; });
  if (timed) {
    const size_t best = *std::min_element(
        fit.begin(), fit.end(), [&](size_t a, size_t b) { return c[a].plan->step_seconds < c[b].plan->step_seconds; });
    const auto ms = [](const Candidate& x) { return fmt::format("{:.1f} ms", 1e3 * x.plan->step_seconds); };
    return {best, ChoiceReason::faster_predicted,
            fmt::format("{}predicted step {} against {}", within, ms(c[best]), others(best, ms))};
  }
  if (rules.weigh_flops) {
    const size_t best = *std::min_element(fit.begin(), fit.end(),
                                          [&](size_t a, size_t b) { return c[a].weighed_flops < c[b].weighed_flops; });
    const auto flops = [](const Candidate& x) { return format_count(x.weighed_flops); };
    return {
        best, ChoiceReason::fewer_flops,
        fmt::format("{}{} FLOPs a step {} against {}", within, flops(c[best]), rules.flops_what, others(best, flops))};
  }
  return {fit.front(), ChoiceReason::preferred, within + rules.preferred_why};
}

}  // namespace remat
