#include "remat/schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace remat::schedule {

std::vector<Action> forward(const ActivationPlan& plan, const Stage& stage, int64_t m, bool backward_follows) {
  TORCH_INTERNAL_ASSERT(
      stage.first >= 0 && stage.first < stage.end && stage.end <= static_cast<int64_t>(plan.layers.size()),
      "a stage of layers [", stage.first, ", ", stage.end, ") of a plan of ", plan.layers.size());
  std::vector<Action> out;
  if (stage.embedding) out.push_back({Kind::embed_forward, m});
  for (int64_t l = stage.first; l < stage.end; ++l) out.push_back({Kind::forward, m, l});
  if (stage.head) out.push_back({Kind::head_forward, m, -1, -1, backward_follows});
  return out;
}

std::vector<Action> backward(const ActivationPlan& plan, const Stage& stage, int64_t m) {
  std::vector<Action> out;
  if (stage.head) out.push_back({Kind::head_backward, m});
  for (int64_t l = stage.end - 1; l >= stage.first; --l) {
    const int64_t first = plan.chunk_of(l);
    // A chunk ends at its last layer, or at the stage's top (the next stage refuses the rest).
    if (first >= 0 && std::min(plan.chunk_end(first), stage.end - 1) == l) {
      TORCH_CHECK(first >= stage.first, "The activation plan's uniform chunk of layers ", first + 1, " to ", l + 1,
                  " crosses into the pipeline stage that begins at layer ", stage.first + 1,
                  "; a chunk must lie within one stage: compile the policy with the stage split (ac.stages, "
                  "ac.num_layers_per_stage).");
      out.push_back({Kind::recompute, m, first, l});
    }
    // The layer's own copies back queue first: its backward reads them first.
    if (l > stage.first && plan.prefetches(l - 1, stage.end)) {
      if (!plan.prefetches(l, stage.end)) out.push_back({Kind::fetch, m, l});
      out.push_back({Kind::fetch, m, l - 1});
    }
    out.push_back({Kind::backward, m, l});
  }
  if (stage.embedding) out.push_back({Kind::embed_backward, m});
  return out;
}

std::vector<Action> step(const ActivationPlan& plan, const Stage& stage, pipeline::Schedule schedule, int64_t stages,
                         int64_t index, int64_t microbatches) {
  std::vector<Action> out;
  const std::vector<pipeline::Action> order = pipeline::actions(schedule, stages, index, microbatches);
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t m = order[i].microbatch;
    const auto part =
        order[i].backward ? backward(plan, stage, m) : forward(plan, stage, m, pipeline::backward_follows(order, i));
    out.insert(out.end(), part.begin(), part.end());
  }
  out.push_back({Kind::optimizer});
  return out;
}

}  // namespace remat::schedule
