// The planner's stages: the pipeline program (remat/pipeline.h) over the layer options and
// uniform chunks, every stage's prediction, and the stages' times.
#include "plan/planner_detail.h"

#include <fmt/format.h>

namespace remat {
namespace {

// `base` seen from stage `s`, which holds `n` of `layers` layers: the others lie in the
// stages before it, or in the next one for the first. A stage's frame depends on which
// ends it holds and on its layer count alone.
Layout holding(const Layout& base, int64_t s, int64_t n, int64_t layers) {
  Layout l = base.at_stage(s);
  l.split.assign(static_cast<size_t>(base.pp), 0);
  l.split[static_cast<size_t>(s)] = n;
  if (base.pp > 1) l.split[static_cast<size_t>(s == 0 ? 1 : 0)] += layers - n;
  return l;
}

}  // namespace

Layout Planner::stage_layout(const std::vector<int64_t>& split, int64_t s) const {
  Layout l = layout_.at_stage(s);
  l.split = split;
  return l;
}

double Planner::ends_seconds(const Layout& stage) const {
  return (stage.has_embedding() ? embed_seconds_ : 0.0) + (stage.has_head() ? head_seconds_ : 0.0);
}

pipeline::StageTimes Planner::stage_times(const Layout& stage, int64_t n, double recompute) const {
  // A layer's forward is its nodes' times (measured ones are a recompute's), never more
  // than its whole measured pass.
  const double forward = static_cast<double>(n) * std::min(block_seconds_, layer_seconds_) +
                         (stage.has_embedding() ? embed_forward_ : 0.0) + (stage.has_head() ? head_forward_ : 0.0);
  const double whole = static_cast<double>(n) * layer_seconds_ + recompute + ends_seconds(stage);
  return {forward, whole - forward};
}

pipeline::Problem Planner::pipeline_problem(int64_t budget, const Options& o, std::vector<Choice>& choices,
                                            bool offload) const {
  const int64_t L = cfg_.n_layer;
  pipeline::Problem p;
  p.layers = L;
  p.budget = budget;
  p.split = o.split;
  for (int64_t s = 0; s < layout_.pp; ++s) p.in_flight.push_back(layout_.at_stage(s).in_flight(shape_.grad_accum));
  choices.clear();
  p.host_budget = o.host;
  for (int64_t i = 0; i < static_cast<int64_t>(o.frontier->size()); ++i) {
    const LayerOption& opt = (*o.frontier)[static_cast<size_t>(i)];
    if (!offload && opt.cost.host > 0) continue;
    p.pieces.push_back({1, opt.cost.kept, detail::top(opt), layer_seconds_ + opt.seconds, opt.cost.host});
    choices.push_back({i, 0, false});
  }
  for (int64_t n = 2; n <= std::min(options_.max_chunk, L); ++n) {
    for (const bool sharded : input_holds()) {
      const ChunkCost c = chunk_cost(n, sharded);
      p.pieces.push_back({n, c.kept, c.top, static_cast<double>(n) * layer_seconds_ + c.seconds});
      choices.push_back({-1, n, sharded});
    }
  }
  p.frame = [this, L](int64_t s, int64_t n) {
    const Layout stage = holding(layout_, s, n, L);
    const cost::StepConstants k = cost::step_constants(cfg_, shape_, stage);
    pipeline::Frame f;
    f.statics = k.statics.total();
    f.under = k.embed_saved;
    f.over = k.head_saved;
    f.head_top = stage.has_head() ? k.head_peak : -1;
    f.outside = stage.has_embedding() ? std::max(k.embed_peak, k.embed_saved + k.embed_backward) : 0;
    f.optimizer = k.optimizer;
    f.seconds = ends_seconds(stage);
    return f;
  };
  p.max_states = options_.max_states;
  return p;
}

std::optional<PlanResult> Planner::solve_stages(int64_t budget, const Options& o) const {
  std::vector<Choice> choices;
  pipeline::Problem problem = pipeline_problem(budget, o, choices);
  auto solved = pipeline::solve(problem);
  // Offloading pieces multiply the partial plans past where the program merges them, which
  // may lose the best plan without offload: solved alone, it stands where it is faster.
  if (std::any_of(problem.pieces.begin(), problem.pieces.end(), [](const pipeline::Piece& c) { return c.host > 0; })) {
    std::vector<Choice> device_choices;
    pipeline::Problem device = pipeline_problem(budget, o, device_choices, false);
    auto alone = pipeline::solve(device);
    if (alone && (!solved || alone->seconds < solved->seconds)) {
      solved = std::move(alone);
      problem = std::move(device);
      choices = std::move(device_choices);
    }
  }
  if (!solved) return std::nullopt;
  ActivationPlan plan = ActivationPlan::none(cfg_.n_layer);
  std::vector<int64_t> split;
  for (const auto& st : solved->stages) {
    int64_t pos = st.first;
    for (const int64_t i : st.pieces) {
      place(plan, pos, choices[static_cast<size_t>(i)], o);
      pos += problem.pieces[static_cast<size_t>(i)].span;
    }
    split.push_back(st.layers);
  }
  plan.policy = fmt::format("budget:{}", budget);
  PlanResult r = predict_units(plan, split);
  for (size_t s = 0; s < r.stages.size(); ++s) {
    TORCH_INTERNAL_ASSERT(r.stages[s].peak <= solved->stages[s].peak, "stage ", s + 1,
                          " of the pipeline plan peaks at ", r.stages[s].peak, " above the ", solved->stages[s].peak,
                          " its solver priced");
    TORCH_INTERNAL_ASSERT(r.stages[s].host_peak == solved->stages[s].host, "stage ", s + 1,
                          " of the pipeline plan offloads ", r.stages[s].host_peak, " bytes, not the ",
                          solved->stages[s].host, " its solver priced");
  }
  // Each stage's prefetches lower its own time only, so the pipeline's split stands.
  if (!times_.host_copies_overlap || !plan.offloads()) return r;
  for (int64_t s = 0; s < layout_.pp; ++s) {
    prefetch_where_it_pays(plan, stage_layout(split, s), budget, r.stages[static_cast<size_t>(s)]);
  }
  return predict_units(plan, split);
}

bool Planner::fits_stages(int64_t budget, const Options& o) const {
  // Whether a budget fits is a matter of bytes alone: with no time to weigh, the program
  // keeps only the partial plans no other betters in kept bytes and peak, far fewer.
  std::vector<Choice> choices;
  pipeline::Problem p = pipeline_problem(budget, o, choices);
  for (pipeline::Piece& c : p.pieces) c.seconds = 0;
  p.frame = [frame = p.frame](int64_t s, int64_t n) {
    pipeline::Frame f = frame(s, n);
    f.seconds = 0;
    return f;
  };
  return pipeline::solve(p).has_value();
}

void Planner::prefetch_where_it_pays(ActivationPlan& plan, const Layout& stage, int64_t budget,
                                     cost::StepPrediction& predicted) const {
  // Where copies take the compute's cores (the CPU's) they are priced whole wherever they run.
  if (!times_.host_copies_overlap) return;
  const int64_t first = stage.first_layer(cfg_.n_layer), end = first + stage.stage_layers(cfg_.n_layer);
  for (int64_t l = first; l + 1 < end; ++l) {
    if (!plan.may_prefetch(l, end)) continue;
    plan.layers[static_cast<size_t>(l)].prefetch = true;
    cost::StepPrediction p = cost::predict_step(cfg_, shape_, stage, plan, options_.early_stop, times_);
    if (p.peak <= budget && p.added_seconds() < predicted.added_seconds()) {
      predicted = std::move(p);
    } else {
      plan.layers[static_cast<size_t>(l)].prefetch = false;
    }
  }
}

PlanResult Planner::predict_units(const ActivationPlan& plan, const std::vector<int64_t>& split) const {
  const std::vector<int64_t> stages = !split.empty() ? split : layout_.stage_split(cfg_.n_layer);
  std::vector<cost::StepPrediction> predicted;
  for (int64_t s = 0; s < layout_.pp; ++s) {
    predicted.push_back(cost::predict_step(cfg_, shape_, stage_layout(stages, s), plan, options_.early_stop, times_));
  }
  return assemble(plan, stages, std::move(predicted));
}

PlanResult Planner::assemble(ActivationPlan plan, std::vector<int64_t> split,
                             std::vector<cost::StepPrediction> stages) const {
  PlanResult r;
  r.plan = std::move(plan);
  r.split = std::move(split);
  r.stages = std::move(stages);
  std::vector<pipeline::StageTimes> times;
  for (int64_t s = 0; s < layout_.pp; ++s) {
    const double recompute = r.stages[static_cast<size_t>(s)].added_seconds() / static_cast<double>(shape_.grad_accum);
    times.push_back(stage_times(stage_layout(r.split, s), r.split[static_cast<size_t>(s)], recompute));
    r.stage_seconds.push_back(times.back().forward + times.back().backward);
    if (r.stage_seconds.back() > r.stage_seconds[static_cast<size_t>(r.bottleneck)]) r.bottleneck = s;
  }
  r.schedule_seconds =
      static_cast<double>(shape_.grad_accum + layout_.pp - 1) * r.stage_seconds[static_cast<size_t>(r.bottleneck)];
  r.simulated_seconds = pipeline::simulate(layout_.schedule, times, shape_.grad_accum);
  return r;
}

void Planner::replay_allocator(PlanResult& r) const {
  if (!on_cuda()) return;
  // The cuBLAS workspace of one handle and stream, as PyTorch sizes it on Hopper.
  const int64_t workspace = memory::cublas_workspace_bytes(9, 0);
  r.device.clear();
  for (int64_t s = 0; s < layout_.pp; ++s) {
    r.device.push_back(cost::predict_device_memory(cfg_, shape_, stage_layout(r.split, s), r.plan, options_.early_stop,
                                                   options_.allocator, workspace));
  }
}

}  // namespace remat
