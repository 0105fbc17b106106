// The planner's door: its questions, for any stage count, and on CUDA the caching
// allocator's reserved bytes held within the device budget.
#include "plan/planner_detail.h"
#include "plan/statics.h"

#include "remat/memory.h"

#include <fmt/format.h>

#include <chrono>
#include <map>

namespace remat {
namespace {

using memory::format_bytes;

// The least step, as a share of the range from the budget to the least feasible one, by
// which the cost model's budget goes down until a plan's reserved bytes fit.
constexpr int64_t kReservedSteps = 16;

// `t` (seconds) in units of which a second holds `per_second`.
cost::NodeTimes in_units(const cost::NodeTimes& t, double per_second) {
  if (per_second == 1) return t;
  cost::NodeTimes u = t;
  u.flops_per_second = t.flops_per_second / per_second;
  for (auto& [node, seconds] : u.seconds) seconds *= per_second;
  u.link_bytes_per_second = t.link_bytes_per_second / per_second;
  u.link_latency_seconds = t.link_latency_seconds * per_second;
  u.data_link_bytes_per_second = t.data_link_bytes_per_second / per_second;
  u.data_link_latency_seconds = t.data_link_latency_seconds * per_second;
  u.host_bytes_per_second = t.host_bytes_per_second / per_second;
  u.host_copy_latency_seconds = t.host_copy_latency_seconds * per_second;
  u.layer_pass_seconds = t.layer_pass_seconds * per_second;
  u.ends_pass_seconds = t.ends_pass_seconds * per_second;
  if (t.other_attention) {
    auto other = std::make_shared<cost::OtherAttention>(*t.other_attention);
    other->times = in_units(t.other_attention->times, per_second);
    other->pass_delta = t.other_attention->pass_delta * per_second;
    u.other_attention = std::move(other);
  }
  return u;
}

// `c`'s times, in units of which a second holds `per_second`, in seconds.
void to_seconds(cost::LayerCost& c, double per_second) {
  for (double* t : {&c.recompute_seconds, &c.recompute_link_seconds, &c.copy_seconds, &c.copy_wait_seconds,
                    &c.copy_slowdown_seconds, &c.backward_clock_seconds, &c.fetched_by_seconds}) {
    *t /= per_second;
  }
}

void to_seconds(cost::StepPrediction& p, double per_second) {
  for (double* t : {&p.recompute_seconds, &p.recompute_link_seconds, &p.copy_seconds, &p.copy_wait_seconds,
                    &p.copy_slowdown_seconds, &p.attention_seconds, &p.data_parallel_seconds, &p.regather_seconds}) {
    *t /= per_second;
  }
  for (cost::LayerCost& c : p.layers) to_seconds(c, per_second);
}

const char* dtype_text(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kDouble ? "float64" : "float32";
}

}  // namespace

int64_t PlanResult::peak() const {
  int64_t peak = 0;
  for (const auto& s : stages) peak = std::max(peak, s.peak);
  return peak;
}

cost::DeviceMemory PlanResult::device_peak() const { return cost::highest(device); }

Planner::Planner(const ModelConfig& cfg, const cost::StepShape& shape, const Layout& layout,
                 const cost::NodeTimes& times, PlannerOptions options)
    : cfg_(cfg),
      shape_(shape),
      layout_(layout),
      per_second_(times.seconds.empty() && times.flops_per_second > 0 ? times.flops_per_second : 1.0),
      times_(in_units(times, per_second_)),
      options_(std::move(options)),
      block_(cost::shape_block(cfg, shape, layout)) {
  // model.attention = auto per layer: each layer may run the other op instead, and the
  // plan names every layer's op.
  const cost::OtherAttention* other = times_.other_attention.get();
  if (other != nullptr && other->op != cfg.attention) per_layer_op_ = cfg.attention;
  const cost::GradientBuffers grads = cost::gradient_buffers(cfg_, layout_, cost::master_dtype(shape_.dtype));
  grad_buffers_ = grads.in_layer_backward();
  gathered_ = cost::gathered_weights(cfg_, layout_, shape_.dtype).layer;
  regather_ = times_.data_link_seconds(graph::LinkTraffic::all_reduce(gathered_, layout_.dp));
  device_frontier_ = price_options(false);
  whole_ = {{}, {}, cost::LayerPricer(block_, options_.early_stop, times_).price({}), false, std::nullopt};
  whole_.cost.forward_peak += gathered_;
  whole_.cost.backward_peak += grad_buffers_ + gathered_;
  take_step_constants();
  for (const auto& n : block_.nodes) block_seconds_ += times_.node_seconds(n);
  const auto forward = [&](const graph::BlockGraph& g) {
    double t = 0;
    for (const auto& n : g.nodes) t += times_.node_seconds(n);
    return t;
  };
  embed_forward_ = forward(graph::embed_graph(cfg_, shape_.batch, shape_.seq, shape_.dtype, layout_));
  head_forward_ = forward(graph::head_graph(cfg_, shape_.batch, shape_.seq, shape_.dtype, shape_.ce_chunk, layout_));
  layer_seconds_ = times_.layer_pass_seconds > 0 ? times_.layer_pass_seconds : 3 * block_seconds_;
  embed_seconds_ = 3 * embed_forward_;
  head_seconds_ = 3 * head_forward_;
  // Measured, the ends' pass is shared between them as their forwards are.
  if (times_.ends_pass_seconds > 0 && embed_forward_ + head_forward_ > 0) {
    const double share = embed_forward_ / (embed_forward_ + head_forward_);
    embed_seconds_ = share * times_.ends_pass_seconds;
    head_seconds_ = (1 - share) * times_.ends_pass_seconds;
    embed_forward_ = embed_seconds_ / 3;
    head_forward_ = head_seconds_ / 3;
  }
}

void Planner::take_step_constants() {
  const cost::StepConstants k = cost::step_constants(cfg_, shape_, layout_);
  emb_base_ = k.statics.total() + k.embed_saved;
  head_peak_ = k.head_peak;
  fixed_peak_ =
      std::max({k.statics.total() + k.embed_peak, emb_base_ + k.embed_backward, k.statics.total() + k.optimizer});
  none_peak_.reset();
}

int64_t Planner::none_peak() const {
  if (!none_peak_) none_peak_ = predict_units(ActivationPlan::none(cfg_.n_layer)).peak();
  return *none_peak_;
}

PlanResult Planner::predict(const ActivationPlan& plan, const std::vector<int64_t>& split, Ledgers ledgers) const {
  PlanResult r = predict_units(plan, split);
  if (ledgers == Ledgers::peak_and_allocator) replay_allocator(r);
  return in_seconds(std::move(r));
}

std::vector<std::vector<int64_t>> Planner::rank_peaks(const ActivationPlan& plan,
                                                      const std::vector<int64_t>& split) const {
  if (layout_.zero_ranks() == 1) return {};
  // The layer options are priced alike for every rank: a copy of this planner with the
  // rank's step constants walks it, without pricing them again.
  Planner at_rank = *this;
  Layout& ranked = at_rank.layout_;
  if (!split.empty()) ranked.split = split;
  // What a rank's walk depends on: the gradients it keeps, and the sizes of the parameters
  // it updates, in its order.
  std::map<std::vector<std::vector<int64_t>>, std::vector<int64_t>> walked;
  std::vector<std::vector<int64_t>> out;
  for (int64_t d = 0; d < layout_.dp; ++d) {
    ranked.dp_rank = d;
    std::vector<std::vector<int64_t>> owns;
    for (int64_t s = 0; s < layout_.pp; ++s) {
      const std::vector<graph::Param> params = cost::stage_params(cfg_, ranked.at_stage(s));
      const cost::OptimizerShare share = cost::optimizer_share(cfg_, params, ranked.at_stage(s));
      std::vector<int64_t>& sizes = owns.emplace_back(1, share.rank_grads);
      for (const size_t i : share.updated) sizes.push_back(cost::numel(params[i]));
    }
    auto it = walked.find(owns);
    if (it == walked.end()) {
      std::vector<int64_t> peaks;
      at_rank.take_step_constants();
      for (const auto& st : at_rank.predict(plan, split, Ledgers::peak).stages) peaks.push_back(st.peak);
      it = walked.emplace(std::move(owns), std::move(peaks)).first;
    }
    out.push_back(it->second);
  }
  return out;
}

PlanResult Planner::in_seconds(PlanResult r) const {
  if (per_second_ == 1) return r;
  for (cost::StepPrediction& p : r.stages) to_seconds(p, per_second_);
  for (double& s : r.stage_seconds) s /= per_second_;
  r.schedule_seconds /= per_second_;
  r.simulated_seconds /= per_second_;
  return r;
}

std::vector<LayerOption> Planner::layer_frontier(int64_t host) const {
  std::vector<LayerOption> out = *options(host).frontier;
  for (LayerOption& o : out) {
    to_seconds(o.cost, per_second_);
    o.seconds /= per_second_;
  }
  return out;
}

std::optional<PlanResult> Planner::solve(int64_t budget, const Options& o) const {
  return layout_.pp > 1 ? solve_stages(budget, o) : solve_one(budget, o);
}

int64_t Planner::least_model_budget(const Options& o) const {
  const int64_t none = none_peak();
  if (layout_.pp == 1) return detail::least_budget(0, none, [&](int64_t b) { return fits_one(b, o); });
  const int64_t by_bytes = detail::least_budget(0, none, [&](int64_t b) { return fits_stages(b, o); });
  // Past max_states the timed program merges partial plans and may miss the plan the
  // bytes admit there: then the least budget it plans.
  const auto solves = [&](int64_t b) {
    std::vector<Choice> choices;
    return pipeline::solve(pipeline_problem(b, o, choices)).has_value();
  };
  return solves(by_bytes) ? by_bytes : detail::least_budget(by_bytes + 1, none, solves);
}

int64_t Planner::least_budget(int64_t host) const { return least_model_budget(options(host)); }

std::optional<PlanResult> Planner::plan(const Budgets& budgets, const std::vector<int64_t>& split,
                                        Ledgers ledgers) const {
  Options o = options(budgets.host);
  if (!split.empty()) o.split = split;
  int64_t reserved = 0;
  auto r = on_cuda() && ledgers == Ledgers::peak_and_allocator ? solve_reserved(budgets, o, reserved)
                                                               : solve(budgets.device, o);
  if (!r) return r;
  return in_seconds(std::move(*r));
}

std::optional<PlanResult> Planner::solve_reserved(const Budgets& budgets, const Options& o, int64_t& reserved) const {
  std::optional<int64_t> least;
  for (int64_t bytes = budgets.device;;) {
    auto solved = solve(bytes, o);
    if (!solved) return std::nullopt;
    replay_allocator(*solved);
    reserved = solved->device_peak().reserved_peak;
    const int64_t over = reserved - budgets.device;
    if (over <= 0) return solved;
    if (!least) least = least_model_budget(o);
    if (bytes == *least) return std::nullopt;
    const int64_t step = std::max<int64_t>(1, (budgets.device - *least) / kReservedSteps);
    bytes = std::max(*least, bytes - std::max(over, step));
  }
}

std::string Planner::explain_infeasible(const Budgets& budgets, const std::string& given) const {
  const Options o = options(budgets.host);
  const int64_t least = least_model_budget(o);
  if (on_cuda() && budgets.device >= least) {
    int64_t reserved = 0;
    solve_reserved(budgets, o, reserved);
    return fmt::format(
        "The memory budget {} (\"{}\") fits no plan of {} once the CUDA caching allocator's segments are counted: the "
        "closest plan found reserves {}; give at least that, lower train.batch or train.seq, or set "
        "run.expandable_segments = true (segments that grow instead of being rounded up).",
        format_bytes(budgets.device), given, cfg_.preset, format_bytes(reserved));
  }
  if (layout_.pp > 1) {
    const int64_t m = shape_.grad_accum;
    return fmt::format(
        "The memory budget {} (\"{}\") fits no plan of {} on {} pipeline stages ({} schedule, {} microbatch{}): the "
        "least budget every stage fits is {}; give at least that, lower train.batch, train.seq or "
        "train.grad_accum{}, or use more stages.",
        format_bytes(budgets.device), given, cfg_.preset, layout_.pp, pipeline::schedule_name(layout_.schedule), m,
        m == 1 ? "" : "es", format_bytes(least),
        layout_.schedule == pipeline::Schedule::gpipe ? " (gpipe holds every microbatch; 1f1b at most one per stage)"
                                                      : "");
  }
  const auto r = solve(least, o);
  TORCH_INTERNAL_ASSERT(r.has_value(), "no plan fits the minimum feasible budget");
  const cost::StepPrediction& p = r->stages[0];
  const std::string copies =
      p.statics.compute_copies > 0 ? fmt::format("compute copies {}, ", format_bytes(p.statics.compute_copies)) : "";
  // Stage 3 shards the weights and gradients too where the ranks are there to hold them.
  const std::string shard = layout_.dp > 1 && layout_.zero < 3
                                ? fmt::format(
                                      ", or keep a share of the weights, the gradients and AdamW's moments on each "
                                      "of the {} data-parallel ranks (parallel.zero = 3)",
                                      layout_.dp)
                                : "";
  std::string text = fmt::format(
      "The memory budget {} ({}) is below the minimum feasible {} for {} at batch {} x {} tokens in {}: the "
      "least-memory plan peaks in the {} with parameters {}, {}gradients {}, optimizer state {}, kept activations {} "
      "and a working set of {}; give a budget of at least {}, or lower train.batch or train.seq{}.",
      format_bytes(budgets.device), given, format_bytes(least), cfg_.preset, shape_.batch, shape_.seq,
      dtype_text(shape_.dtype), p.peak_at, format_bytes(p.statics.params), copies, format_bytes(p.statics.grads),
      format_bytes(p.statics.optimizer), format_bytes(p.peak - p.statics.total() - p.working_set),
      format_bytes(p.working_set), format_bytes(least), shard);
  // The fused head keeps the output weight's gradient; the recomputing one may fit lower.
  if (cfg_.loss_head == LossHead::fused) {
    ModelConfig other = cfg_;
    other.loss_head = LossHead::recompute;
    const int64_t other_least = Planner(other, shape_, layout_, times_, options_).least_budget(budgets.host);
    if (other_least < least) {
      text += fmt::format(
          " With model.loss_head=recompute (the loss head keeps the hidden states instead of the output weight's "
          "gradient and recomputes the logits in the backward) the minimum is {}{}.",
          format_bytes(other_least), other_least <= budgets.device ? ", within this budget" : "");
    }
  }
  return text;
}

Frontier Planner::frontier(int64_t host, int points, double seconds) const {
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  const Options o = options(host);
  const int64_t lo = least_model_budget(o), hi = none_peak();
  Frontier f;
  f.asked = points;
  std::vector<FrontierPoint> all;
  for (const int i : sweep_order(points)) {
    if (seconds > 0 && f.solved >= 2 && elapsed() > seconds) break;
    const int64_t budget = points == 1 ? hi : lo + (hi - lo) * i / (points - 1);
    ++f.solved;
    if (auto r = solve(budget, o)) {
      all.push_back({r->peak(), r->stages[static_cast<size_t>(r->bottleneck)].added_seconds() / per_second_, "budget"});
    }
  }
  std::sort(all.begin(), all.end(), [](const FrontierPoint& a, const FrontierPoint& b) {
    return a.peak != b.peak ? a.peak < b.peak : a.recompute_seconds < b.recompute_seconds;
  });
  for (const auto& p : all) {
    if (f.points.empty() || p.recompute_seconds < f.points.back().recompute_seconds) f.points.push_back(p);
  }
  f.seconds = elapsed();
  return f;
}

}  // namespace remat
