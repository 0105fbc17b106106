#include "cli/plan_cmd.h"

#include "remat/data.h"
#include "remat/memory.h"
#include "remat/ops.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/trainer.h"
#include "train/head_choice.h"
#include "train/data_parallel.h"
#include "train/planning.h"
#include "train/progress.h"
#include "util/gnuplot.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <stdexcept>

namespace remat::cli {
namespace {

using memory::format_bytes;

at::ScalarType plan_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  throw std::invalid_argument(fmt::format("run.dtype = \"{}\" cannot be planned; use float32 or bfloat16.", name));
}

// One rank's FLOPs of one microbatch's forward and backward without recompute (a backward costs
// about twice its forward).
double step_flops(const ModelConfig& m, const graph::BlockGraph& b, const cost::StepShape& s) {
  const int64_t N = s.batch * s.seq;
  return 3.0 * (m.n_layer * b.forward_flops() + ops::cross_entropy_flops(N, m.d_model, m.vocab_size / s.tp));
}

// Seconds of the collectives one microbatch's forward and backward run without recompute
// on the ranks of stage `s` (its blocks', and the embedding's and the loss head's where it
// holds them), at `times`' links.
double step_link_seconds(const ModelConfig& m, const graph::BlockGraph& b, const cost::StepShape& s,
                         const cost::NodeTimes& times) {
  const auto of = [&](const graph::BlockGraph& g) {
    double t = 0;
    for (const auto& n : g.nodes) t += times.link_seconds(n.forward_link) + times.link_seconds(n.backward_link);
    return t;
  };
  double t = static_cast<double>(s.stage_layers(m.n_layer)) * of(b);
  if (s.has_embedding()) t += of(graph::embed_graph(m, s.batch, s.seq, s.dtype, s.tp, s.sp));
  if (s.has_head(m.n_layer)) t += of(graph::head_graph(m, s.batch, s.seq, s.dtype, s.ce_chunk, s.tp, s.sp));
  return t;
}

// The links `remat plan` prices collectives at (parallel.link_rate and link_latency), in a
// unit of time of which a second holds `per_second` (the planner's: FLOPs at
// parallel.compute_rate).
cost::NodeTimes configured_links(const ParallelConfig& p, double per_second) {
  cost::NodeTimes t;
  t.link_bytes_per_second = p.link_rate * 1e9 / per_second;
  t.link_latency_seconds = p.link_latency * 1e-6 * per_second;
  return t;
}

// The collectives one rank of a stage runs in a step: those its plan's recompute re-runs,
// as the planner priced them (FLOPs) and in seconds, and the step's own without recompute.
struct Communication {
  double recompute_flops = 0, recompute_seconds = 0, step_seconds = 0;
};

// Of the stage `pred` predicts (all the layers without a pipeline), on ranks of `shape`.
Communication communication(const Config& cfg, const Planner& planner, const cost::StepShape& shape,
                            const cost::StepPrediction& pred) {
  cost::StepShape stage = shape;
  stage.first_layer = pred.first_layer;
  stage.layers = static_cast<int64_t>(pred.layers.size());
  Communication c;
  c.recompute_flops = pred.recompute_link_seconds;
  c.recompute_seconds = pred.recompute_link_seconds / (cfg.parallel.compute_rate * 1e12);
  c.step_seconds = static_cast<double>(stage.grad_accum) *
                   step_link_seconds(cfg.model, planner.block(), stage, configured_links(cfg.parallel, 1.0));
  return c;
}

nlohmann::json communication_json(const Communication& c) {
  return {{"recompute_seconds", c.recompute_seconds}, {"step_seconds", c.step_seconds}};
}

// With the links it was priced at.
nlohmann::json communication_json(const Config& cfg, const Communication& c) {
  nlohmann::json j = communication_json(c);
  j["link_rate_gb_per_s"] = cfg.parallel.link_rate;
  j["link_latency_us"] = cfg.parallel.link_latency;
  j["compute_rate_tflop_per_s"] = cfg.parallel.compute_rate;
  return j;
}

// `whose`: which ranks' collectives, empty when every rank runs the same.
std::string communication_text(const Config& cfg, const Communication& c, const std::string& whose) {
  return fmt::format("communication at parallel.link_rate = {} GB/s and parallel.link_latency = {} us{}: the "
                     "recompute re-runs {:.3f} ms of collectives per step (priced as {} FLOPs at "
                     "parallel.compute_rate = {} TFLOP/s); without recompute a step's collectives take {:.3f} ms\n",
                     cfg.parallel.link_rate, cfg.parallel.link_latency, whose, 1e3 * c.recompute_seconds,
                     format_count(c.recompute_flops), cfg.parallel.compute_rate, 1e3 * c.step_seconds);
}

nlohmann::json breakdown_json(const cost::StepPrediction& p) {
  return {{"parameters", p.statics.params},
          {"gradients", p.statics.grads},
          {"optimizer", p.statics.optimizer},
          {"compute_copies", p.statics.compute_copies},
          {"batch", p.statics.batch},
          {"token_corpus", p.statics.resident},
          {"kept_activations", p.peak - p.statics.total() - p.working_set},
          {"working_set", p.working_set},
          {"peak", p.peak},
          {"peak_at", p.peak_at}};
}

std::string breakdown_text(const cost::StepPrediction& p) {
  std::string s;
  s += fmt::format("  parameters        {:>12}\n", format_bytes(p.statics.params));
  s += fmt::format("  gradients         {:>12}\n", format_bytes(p.statics.grads));
  s += fmt::format("  optimizer state   {:>12}\n", format_bytes(p.statics.optimizer));
  if (p.statics.compute_copies > 0) s += fmt::format("  compute copies    {:>12}\n", format_bytes(p.statics.compute_copies));
  s += fmt::format("  batch             {:>12}\n", format_bytes(p.statics.batch));
  if (p.statics.resident > 0) s += fmt::format("  token corpus      {:>12}\n", format_bytes(p.statics.resident));
  s += fmt::format("  kept activations  {:>12}\n", format_bytes(p.peak - p.statics.total() - p.working_set));
  s += fmt::format("  working set       {:>12}\n", format_bytes(p.working_set));
  s += fmt::format("  peak              {:>12}   ({})\n", format_bytes(p.peak), p.peak_at);
  return s;
}

// The manual policies drawn on the frontier, those valid for `layers`.
std::vector<std::string> manual_policies(int64_t layers) {
  std::vector<std::string> out = {"none", "full", "modules:[core_attn]", "ops:[matmul,attention]",
                                  "modules:[core_attn,act]"};
  for (int64_t k : {2, 4}) {
    if (k <= layers) out.push_back(fmt::format("every:{}", k));
    if (k <= layers) out.push_back(fmt::format("uniform:{}", k));
  }
  if (layers >= 2) out.push_back(fmt::format("block:{}", layers / 2));
  return out;
}

bool plot_frontier(const std::string& path, const std::vector<FrontierPoint>& frontier,
                   const std::vector<FrontierPoint>& manual, double flops, std::string* why) {
  std::string script =
      "set terminal pngcairo size 900,560 noenhanced\nset output ARG1\nset title 'remat plan: memory/time frontier'\n"
      "set xlabel 'predicted peak (MiB)'\nset ylabel 'recompute (% of the step FLOPs)'\nset grid\nset key top right\n"
      "$budget << EOD\n";
  for (const auto& p : frontier) script += fmt::format("{} {}\n", p.peak / 1048576.0, 100.0 * p.recompute_seconds / flops);
  script += "EOD\n$manual << EOD\n";
  for (const auto& p : manual) {
    script += fmt::format("{} {} \"{}\"\n", p.peak / 1048576.0, 100.0 * p.recompute_seconds / flops, p.label);
  }
  script += "EOD\nplot $budget using 1:2 with linespoints lw 2 pt 7 lc rgb '#d04020' title 'budget plans', "
            "$manual using 1:2 with points pt 5 ps 1.2 lc rgb '#3060b0' title 'manual policies', "
            "$manual using 1:2:3 with labels offset 1,0.6 left font ',8' notitle\n";
  return util::run_gnuplot(script, path, "", why);
}

// ColossalAI's least per-stage checkpoint counts (`num_ckpt_layers_per_stage`, each stage's
// first layers recomputed whole) with which every stage of `pipe`'s split fits `budget`, and
// their prediction; nullopt when even every layer recomputed does not fit. A stage's peak
// depends on its own layers alone, so each count grows until its stage fits.
std::optional<std::pair<std::vector<int64_t>, PipelinePlan>> least_counts(const Config& cfg, const Planner& planner,
                                                                          const PipelineShape& pipe, int64_t budget) {
  AcConfig ac;
  ac.stages = pipe.stages;
  ac.num_layers_per_stage = fmt::format("{}", fmt::join(pipe.split, ","));
  std::vector<int64_t> counts(pipe.split.size(), 0);
  for (;;) {
    ac.num_ckpt_layers_per_stage = fmt::format("{}", fmt::join(counts, ","));
    PipelinePlan p = planner.predict_pipeline(compile_policy(ac, cfg.model.n_layer, cfg.model.dropout), pipe);
    bool fits = true;
    for (size_t s = 0; s < counts.size(); ++s) {
      if (p.stages[s].peak <= budget) continue;
      if (counts[s] == pipe.split[s]) return std::nullopt;
      ++counts[s];
      fits = false;
    }
    if (fits) return std::make_pair(counts, std::move(p));
  }
}

// `remat plan` of a pipeline: the layers of each stage and each layer's plan, solved
// together within the per-rank budget (time in FLOPs, as above).
int plan_pipeline(const Config& cfg, const cost::StepShape& shape, const PlanArgs& args, const Planner& planner,
                  const std::string& header, const AutoChoices& choices) {
  const ModelConfig& m = cfg.model;
  PipelineShape pipe;
  pipe.stages = cfg.parallel.pp;
  pipe.schedule = cfg.parallel.schedule;
  if (cfg.ac.num_layers_per_stage) pipe.split = stage_sizes(cfg.ac, m.n_layer);
  const int64_t microbatches = cfg.train.grad_accum;
  const PipelinePlan none = planner.predict_pipeline(compile_policy("none", m.n_layer), pipe);
  const std::string budget_text = args.budget.empty() ? (cfg.ac.budget.empty() ? "1.0" : cfg.ac.budget) : args.budget;
  const int64_t budget = parse_budget(budget_text, none.peak());
  const auto solved = planner.solve_pipeline(budget, pipe);
  if (!solved) throw std::invalid_argument(pipeline_infeasible(cfg, planner, pipe, budget, budget_text));
  const PipelinePlan& r = *solved;
  // What splitting the layers evenly and planning each stage alone would give.
  std::optional<PipelinePlan> even;
  if (pipe.split.empty()) {
    PipelineShape fixed = pipe;
    fixed.split = pipeline::even_split(m.n_layer, pipe.stages);
    even = planner.solve_pipeline(budget, fixed);
  }
  // ColossalAI's way on the same split: whole layers recomputed, counted per stage.
  PipelineShape counted = pipe;
  if (counted.split.empty()) counted.split = pipeline::even_split(m.n_layer, pipe.stages);
  const auto counts = least_counts(cfg, planner, counted, budget);
  std::vector<Communication> links;
  for (const auto& st : r.stages) links.push_back(communication(cfg, planner, shape, st));
  if (args.json) {
    // The bottleneck's collectives, which the schedule waits on.
    nlohmann::json bottleneck_links = communication_json(cfg, links[static_cast<size_t>(r.bottleneck)]);
    bottleneck_links["stage"] = r.bottleneck + 1;
    nlohmann::json stages = nlohmann::json::array();
    for (size_t s = 0; s < r.stages.size(); ++s) {
      const cost::StepPrediction& p = r.stages[s];
      nlohmann::json layers = nlohmann::json::array();
      for (size_t i = 0; i < p.layers.size(); ++i) {
        const LayerPlan& lp = r.plan.layers[static_cast<size_t>(p.first_layer) + i];
        layers.push_back({{"layer", p.first_layer + static_cast<int64_t>(i) + 1},
                          {"dropped", lp.dropped},
                          {"chunk_begin", lp.chunk_begin < 0 ? -1 : lp.chunk_begin + 1},
                          {"input_sharded", lp.input_sharded},
                          {"attention", attention_name(lp.attention.value_or(m.attention))},
                          {"kept_bytes", p.layers[i].kept}});
      }
      stages.push_back({{"stage", s + 1},
                        {"first_layer", p.first_layer + 1},
                        {"layers", r.split[s]},
                        {"in_flight", pipeline::in_flight(pipe.schedule, pipe.stages, static_cast<int64_t>(s),
                                                          microbatches)},
                        {"plan", layers},
                        {"breakdown", breakdown_json(p)},
                        {"flops_per_microbatch", r.stage_seconds[s]},
                        {"communication", communication_json(links[s])}});
    }
    const nlohmann::json out = {{"model", {{"preset", m.preset}, {"arch", arch_name(m.arch)}, {"layers", m.n_layer}}},
                                {"attention", attention_name(m.attention)},
                                {"attention_choice", choices.attention},
                                {"loss_head", loss_head_name(m.loss_head)},
                                {"loss_head_choice", choices.loss_head},
                                {"pipeline", {{"stages", pipe.stages},
                                              {"schedule", pipeline::schedule_name(pipe.schedule)},
                                              {"microbatches", microbatches}}},
                                {"budget", budget},
                                {"none_peak", none.peak()},
                                {"stages", stages},
                                {"bottleneck", r.bottleneck + 1},
                                {"schedule_flops", r.schedule_seconds},
                                {"communication", bottleneck_links},
                                {"even_split_schedule_flops", even ? nlohmann::json(even->schedule_seconds) : nlohmann::json()},
                                {"least_ckpt_layers_per_stage",
                                 counts ? nlohmann::json{{"counts", counts->first},
                                                         {"schedule_flops", counts->second.schedule_seconds}}
                                        : nlohmann::json()}};
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  fmt::print("{}\n", header);
  fmt::print("pipeline: {} stages, {} schedule, {} microbatch{}; budget {} (\"{}\") per rank; without recompute the "
             "busiest stage of the {} split would peak at {}\n\n", pipe.stages, pipeline::schedule_name(pipe.schedule),
             microbatches, microbatches == 1 ? "" : "es", format_bytes(budget), budget_text,
             pipe.split.empty() ? "even" : "given", format_bytes(none.peak()));
  fmt::print("plan (layers per stage and each layer's plan, solved together for the fastest slowest stage):\n");
  for (size_t s = 0; s < r.stages.size(); ++s) {
    fmt::print("{}\n", stage_line(r, s, microbatches, pipe.schedule,
                                        format_count(r.stage_seconds[s]) + " FLOPs per microbatch"));
    fmt::print("{}", layer_groups_text(r.plan, r.stages[s]));
  }
  fmt::print("\nbottleneck: stage {} at {} FLOPs per microbatch; the schedule takes (microbatches + stages - 1) = {} "
             "times that, {} FLOPs, plus the optimizer\n", r.bottleneck + 1, format_count(r.stage_seconds[r.bottleneck]),
             microbatches + pipe.stages - 1, format_count(r.schedule_seconds));
  if (shape.tp > 1) {
    fmt::print("{}", communication_text(cfg, links[static_cast<size_t>(r.bottleneck)],
                                        fmt::format(" on stage {}'s ranks (the bottleneck)", r.bottleneck + 1)));
  }
  // The policy the ac settings name, on the given (or even) split, for comparison.
  const ActivationPlan policy = compile_policy(cfg.ac, m.n_layer, m.dropout);
  if (policy.policy != "none") {
    const PipelinePlan given = planner.predict_pipeline(policy, pipe);
    std::vector<std::string> peaks;
    for (const auto& st : given.stages) peaks.push_back(format_bytes(st.peak));
    fmt::print("{} on the {} split ({}): stage peaks {}; bottleneck stage {}, {} FLOPs, {:.3f} x this plan's{}\n",
               policy.policy, pipe.split.empty() ? "even" : "given", fmt::join(given.split, ","), fmt::join(peaks, ", "),
               given.bottleneck + 1, format_count(given.schedule_seconds),
               given.schedule_seconds / r.schedule_seconds,
               given.peak() > budget ? fmt::format(", over the budget by {}", format_bytes(given.peak() - budget)) : "");
  }
  fmt::print("ColossalAI's least per-stage counts on the {} split ({}): {}\n", pipe.split.empty() ? "even" : "given",
             fmt::join(counted.split, ","),
             counts ? fmt::format("num_ckpt_layers_per_stage = [{}], {} FLOPs, {:.3f} x this plan's",
                                  fmt::join(counts->first, ","), format_count(counts->second.schedule_seconds),
                                  counts->second.schedule_seconds / r.schedule_seconds)
                    : std::string("none fit the budget, even with every layer recomputed"));
  if (pipe.split.empty()) {
    fmt::print("the even split ({}) planned stage by stage: {}\n", fmt::join(pipeline::even_split(m.n_layer, pipe.stages), ","),
               even ? fmt::format("{} FLOPs, {:.3f} x this plan's", format_count(even->schedule_seconds),
                                  even->schedule_seconds / r.schedule_seconds)
                    : "no plan fits the budget");
  }
  return 0;
}

}  // namespace

int cmd_plan(const Config& cfg_in, const PlanArgs& args) {
  Config cfg = cfg_in;
  ModelConfig& m = cfg.model;
  // What `remat prepare` will train, padded as the trainer pads it (a given size is already).
  if (m.vocab_size == 0) m.vocab_size = padded_vocab_size(cfg, cfg.data.vocab_size);
  // A rank's share of the batch: its memory and time are what a data-parallel run plans.
  const int64_t ranks = data_parallel_ranks(cfg);
  cost::StepShape shape;
  shape.batch = cfg.train.batch / ranks;
  shape.seq = cfg.train.seq;
  shape.grad_accum = cfg.train.grad_accum;
  shape.ce_chunk = cfg.train.ce_chunk;
  shape.dtype = plan_dtype(cfg.run.dtype);
  shape.tp = cfg.parallel.tp;
  shape.sp = cfg.parallel.sp;
  shape.zero_ranks = cfg.parallel.zero == 1 ? ranks : 1;
  // A run holds its token corpus (both splits) through every step, as the trainer counts
  // it; only a prepared corpus says how many tokens it has.
  const std::string corpus = corpus_dir(cfg.data);
  std::string corpus_text;
  try {
    const data::CorpusInfo info = data::load_corpus_info(corpus);
    shape.resident = data::TokenDataset::held_bytes(info);
    corpus_text = fmt::format("; its token corpus ({}) holds {}", corpus, format_bytes(shape.resident));
  } catch (const std::exception&) {
    corpus_text = fmt::format("; its token corpus is not counted: {} is not prepared yet (remat prepare), and a run "
                              "holds {} bytes a token of it", corpus, data::TokenDataset::kBytesPerToken);
  }
  // model.loss_head = auto and model.attention = auto: chosen before any block is declared
  // (empty where both are named).
  const AutoChoices choices =
      resolve_planned_auto(cfg, shape.dtype, args.budget.empty() ? cfg.ac.budget : args.budget,
                                shape.resident);
  const std::string tp_text =
      shape.tp > 1 ? fmt::format(", one of {} tensor-parallel ranks (its share of heads, features and vocabulary{})",
                                 shape.tp, shape.sp ? ", and of the positions outside them" : "")
                   : "";
  if (args.explain_block) {
    const graph::BlockGraph g = graph::block_graph(m, shape.batch, shape.seq, shape.dtype, shape.tp, shape.sp);
    fmt::print("One {} block at batch {} x {} tokens in {}{}: every value its forward makes, and the slot that "
               "keeps it for the backward (- : freed after its last forward reader).\n\n{}",
               arch_name(m.arch), shape.batch, shape.seq, cfg.run.dtype, tp_text, graph::explain(g));
    return 0;
  }
  // Time is priced in FLOPs here (a device-independent unit): recompute "seconds" are
  // FLOPs at one FLOP per second, shown as a share of the step's FLOPs. A collective takes
  // the FLOPs a rank could compute while it runs: its ring steps at parallel.link_latency
  // and its bytes at parallel.link_rate, in FLOPs at parallel.compute_rate.
  cost::NodeTimes times = configured_links(cfg.parallel, cfg.parallel.compute_rate * 1e12);
  times.flops_per_second = 1.0;
  PlannerOptions opts;
  opts.early_stop = cfg.ac.early_stop;
  const Planner planner(m, shape, times, opts);
  const std::string header = fmt::format(
      "remat plan: {} ({}), {} layers, d_model {}, {} heads; batch {} x {} tokens{}{}, {}, {} microbatch{}", m.preset,
      arch_name(m.arch), m.n_layer, m.d_model, m.n_head, shape.batch, shape.seq,
      ranks > 1 ? fmt::format(" per rank (train.batch = {} over {} data-parallel ranks{})", cfg.train.batch, ranks,
                              shape.zero_ranks > 1 ? ", AdamW's moments sharded over them: the busiest rank's share"
                                                   : "")
                : "",
      tp_text, cfg.run.dtype, shape.grad_accum, shape.grad_accum == 1 ? "" : "es") + corpus_text +
      (choices.text().empty() ? "" : "\n" + choices.text());
  if (cfg.parallel.pp > 1) return plan_pipeline(cfg, shape, args, planner, header, choices);
  const double flops = step_flops(m, planner.block(), shape);
  const int64_t none_peak = planner.none_peak();
  const int64_t min_budget = planner.min_feasible_budget();
  const std::string budget_text = args.budget.empty() ? (cfg.ac.budget.empty() ? "1.0" : cfg.ac.budget) : args.budget;
  const int64_t budget = parse_budget(budget_text, none_peak);
  auto solved = planner.solve(budget);
  if (!solved) throw std::invalid_argument(planner.infeasible(budget, budget_text));
  const ActivationPlan& plan = solved->plan;
  const cost::StepPrediction& pred = solved->prediction;
  const double overhead = pred.recompute_flops / (flops * shape.grad_accum);
  const Communication link = communication(cfg, planner, shape, pred);

  std::vector<FrontierPoint> frontier, manual;
  if (args.pareto || args.json) {
    frontier = planner.frontier(args.points);
    for (const auto& policy : manual_policies(m.n_layer)) {
      const auto p = planner.predict(compile_policy(policy, m.n_layer, m.dropout));
      manual.push_back({p.peak, p.recompute_seconds, policy});
    }
  }

  if (args.json) {
    nlohmann::json layers = nlohmann::json::array();
    for (int64_t l = 0; l < m.n_layer; ++l) {
      layers.push_back({{"layer", l + 1},
                        {"dropped", plan.layers[l].dropped},
                        {"chunk_begin", plan.layers[l].chunk_begin < 0 ? -1 : plan.layers[l].chunk_begin + 1},
                        {"input_sharded", plan.layers[l].input_sharded},
                        {"attention", attention_name(plan.layers[l].attention.value_or(m.attention))},
                        {"kept_bytes", pred.layers[l].kept},
                        {"recompute_flops", pred.layers[l].recompute_flops}});
    }
    auto points = [&](const std::vector<FrontierPoint>& v) {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& p : v) a.push_back({{"label", p.label}, {"peak", p.peak}, {"recompute_flops", p.recompute_seconds}});
      return a;
    };
    const nlohmann::json out = {
        {"model", {{"preset", m.preset}, {"arch", arch_name(m.arch)}, {"layers", m.n_layer}, {"d_model", m.d_model}}},
        {"attention", attention_name(m.attention)},
        {"attention_choice", choices.attention},
        {"loss_head", loss_head_name(m.loss_head)},
        {"loss_head_choice", choices.loss_head},
        {"shape", {{"batch", shape.batch}, {"ranks", ranks}, {"tp", shape.tp}, {"sp", shape.sp}, {"seq", shape.seq}, {"grad_accum", shape.grad_accum}, {"dtype", cfg.run.dtype}}},
        {"budget", budget},
        {"none_peak", none_peak},
        {"min_feasible_budget", min_budget},
        {"plan", layers},
        {"breakdown", breakdown_json(pred)},
        {"recompute_flops_per_step", pred.recompute_flops},
        {"step_flops", flops * shape.grad_accum},
        {"recompute_overhead", overhead},
        {"communication", communication_json(cfg, link)},
        {"frontier", points(frontier)},
        {"manual", points(manual)}};
    fmt::print("{}\n", out.dump(2));
    return 0;
  }

  fmt::print("{}\n", header);
  fmt::print("budget {} (\"{}\"); no-recompute peak {}; minimum feasible {}\n\n", format_bytes(budget), budget_text,
             format_bytes(none_peak), format_bytes(min_budget));
  fmt::print("plan (least recompute within the budget):\n");
  fmt::print("{}", layer_groups_text(plan, pred));
  fmt::print("\npredicted memory at the peak:\n{}", breakdown_text(pred));
  fmt::print("\nrecompute: {} FLOPs per step, {:.1f}% over the {} FLOPs of a step without recompute\n",
             format_count(pred.recompute_flops), 100.0 * overhead, format_count(flops * shape.grad_accum));
  if (shape.tp > 1) fmt::print("{}", communication_text(cfg, link, ""));
  if (args.pareto) {
    fmt::print("\nfrontier (budget plans):\n  {:>12}  {:>10}\n", "peak", "recompute");
    for (const auto& p : frontier) {
      fmt::print("  {:>12}  {:>9.1f}%\n", format_bytes(p.peak), 100.0 * p.recompute_seconds / flops);
    }
    fmt::print("manual policies:\n");
    for (const auto& p : manual) {
      fmt::print("  {:>12}  {:>9.1f}%  {}\n", format_bytes(p.peak), 100.0 * p.recompute_seconds / flops, p.label);
    }
    std::string why;
    if (plot_frontier(args.plot, frontier, manual, flops, &why)) {
      fmt::print("plot: {}\n", args.plot);
    } else {
      fmt::print("no plot: {}\n", why);
    }
  }
  return 0;
}

}  // namespace remat::cli
