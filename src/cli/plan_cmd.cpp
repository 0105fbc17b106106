#include "cli/plan_cmd.h"

#include "remat/data.h"
#include "remat/memory.h"
#include "remat/ops.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/trainer.h"
#include "run/run.h"
#include "train/data_parallel.h"
#include "train/device.h"
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
  return fmt::format(
      "communication at parallel.link_rate = {} GB/s and parallel.link_latency = {} us{}: the "
      "recompute re-runs {:.3f} ms of collectives per step (priced as {} FLOPs at "
      "parallel.compute_rate = {} TFLOP/s); without recompute a step's collectives take {:.3f} ms\n",
      cfg.parallel.link_rate, cfg.parallel.link_latency, whose, 1e3 * c.recompute_seconds,
      format_count(c.recompute_flops), cfg.parallel.compute_rate, 1e3 * c.step_seconds);
}

// How long --pareto and --json sweep budgets before they stop starting solves.
constexpr double kSweepSeconds = 10;

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
  for (const auto& p : frontier)
    script += fmt::format("{} {}\n", p.peak / 1048576.0, 100.0 * p.recompute_seconds / flops);
  script += "EOD\n$manual << EOD\n";
  for (const auto& p : manual) {
    script += fmt::format("{} {} \"{}\"\n", p.peak / 1048576.0, 100.0 * p.recompute_seconds / flops, p.label);
  }
  script +=
      "EOD\nplot $budget using 1:2 with linespoints lw 2 pt 7 lc rgb '#d04020' title 'budget plans', "
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

// What `remat plan` adds to a pipeline's plan: the collectives of every stage (JSON) and
// of the bottleneck (text), the layers split evenly and planned stage by stage, and
// ColossalAI's least per-stage counts, against the plan's schedule (time in FLOPs).
void pipeline_extras(const RunSpec& spec, const PlanArgs& args, const Planner& planner, nlohmann::json& json) {
  const Config& cfg = spec.cfg;
  const ModelConfig& m = cfg.model;
  const PipelinePlan& r = *spec.plan.pipeline;
  PipelineShape pipe;
  pipe.stages = cfg.parallel.pp;
  pipe.schedule = cfg.parallel.schedule;
  if (cfg.ac.num_layers_per_stage) pipe.split = stage_sizes(cfg.ac, m.n_layer);
  const int64_t budget = spec.plan.budget;
  // What splitting the layers evenly and planning each stage alone would give.
  std::optional<PipelinePlan> even;
  if (pipe.split.empty() && budget > 0) {
    PipelineShape fixed = pipe;
    fixed.split = pipeline::even_split(m.n_layer, pipe.stages);
    even = planner.solve_pipeline(budget, fixed);
  }
  // ColossalAI's way on the same split: whole layers recomputed, counted per stage.
  PipelineShape counted = pipe;
  if (counted.split.empty()) counted.split = pipeline::even_split(m.n_layer, pipe.stages);
  const auto counts = budget > 0 ? least_counts(cfg, planner, counted, budget) : std::nullopt;
  std::vector<Communication> links;
  for (const auto& st : r.stages) links.push_back(communication(cfg, planner, spec.shape, st));
  const auto bottleneck = static_cast<size_t>(r.bottleneck);
  if (args.json) {
    for (size_t s = 0; s < r.stages.size(); ++s) {
      json["stages"][s]["flops_per_microbatch"] = r.stage_seconds[s];
      json["stages"][s]["communication"] = communication_json(links[s]);
    }
    json["schedule_flops"] = r.schedule_seconds;
    // The bottleneck's collectives, which the schedule waits on.
    json["communication"] = communication_json(cfg, links[bottleneck]);
    json["communication"]["stage"] = r.bottleneck + 1;
    json["even_split_schedule_flops"] = even ? nlohmann::json(even->schedule_seconds) : nlohmann::json();
    json["least_ckpt_layers_per_stage"] =
        counts ? nlohmann::json{{"counts", counts->first}, {"schedule_flops", counts->second.schedule_seconds}}
               : nlohmann::json();
    return;
  }
  if (spec.layout.tp > 1) {
    fmt::print("{}", communication_text(cfg, links[bottleneck],
                                        fmt::format(" on stage {}'s ranks (the bottleneck)", r.bottleneck + 1)));
  }
  if (budget == 0) return;
  fmt::print("ColossalAI's least per-stage counts on the {} split ({}): {}\n", pipe.split.empty() ? "even" : "given",
             fmt::join(counted.split, ","),
             counts ? fmt::format("num_ckpt_layers_per_stage = [{}], {} FLOPs, {:.3f} x this plan's",
                                  fmt::join(counts->first, ","), format_count(counts->second.schedule_seconds),
                                  counts->second.schedule_seconds / r.schedule_seconds)
                    : std::string("none fit the budget, even with every layer recomputed"));
  if (pipe.split.empty()) {
    fmt::print("the even split ({}) planned stage by stage: {}\n",
               fmt::join(pipeline::even_split(m.n_layer, pipe.stages), ","),
               even ? fmt::format("{} FLOPs, {:.3f} x this plan's", format_count(even->schedule_seconds),
                                  even->schedule_seconds / r.schedule_seconds)
                    : "no plan fits the budget");
  }
}

}  // namespace

int cmd_plan(const Config& cfg_in, const PlanArgs& args) {
  Config cfg = cfg_in;
  if (!args.budget.empty()) cfg.ac.budget = args.budget;
  // Time is priced in FLOPs here (a device-independent unit): recompute "seconds" are
  // FLOPs at one FLOP per second. A collective takes the FLOPs a rank could compute while
  // it runs: its ring steps at parallel.link_latency and its bytes at parallel.link_rate,
  // in FLOPs at parallel.compute_rate.
  cost::NodeTimes times = configured_links(cfg.parallel, cfg.parallel.compute_rate * 1e12);
  times.flops_per_second = 1.0;
  times.host_bytes_per_second = cfg.ac.offload_rate * 1e9 / (cfg.parallel.compute_rate * 1e12);
  times.host_copies_overlap = cfg.run.device != "cpu";
  times.host_copy_slowdown = cfg.ac.offload_slowdown;
  RunInputs in;
  in.dtype = dtype_of(cfg.run.dtype);
  in.profile_of = [&](const Config&) {
    TimeProfile p;
    p.times = times;
    return p;
  };
  // A run holds its token corpus (both splits) through every step; only a prepared corpus
  // says how many tokens it has.
  in.corpus_dir = corpus_dir(cfg.data);
  try {
    in.corpus = data::load_corpus_info(in.corpus_dir);
  } catch (const std::exception&) {
  }
  const RunSpec spec = resolve_run(cfg, in);
  const ModelConfig& m = spec.cfg.model;
  const cost::StepShape& shape = spec.shape;
  if (args.explain_block) {
    const graph::BlockGraph g = cost::shape_block(m, shape);
    fmt::print(
        "One {} block at batch {} x {} tokens in {}{}: every value its forward makes, and the slot that "
        "keeps it for the backward (- : freed after its last forward reader).\n\n{}",
        arch_name(m.arch), shape.batch, shape.seq, spec.cfg.run.dtype, describe_ranks(spec.local), graph::explain(g));
    return 0;
  }
  const Planner planner(m, shape, times, planner_options(spec.local));
  nlohmann::json json = render_json(spec);
  if (!args.json) fmt::print("{}", render_text(spec));
  if (spec.plan.pipeline) {
    pipeline_extras(spec, args, planner, json);
    if (args.json) fmt::print("{}\n", json.dump(2));
    return 0;
  }
  const cost::StepPrediction& pred = spec.plan.predicted;
  const double flops = step_flops(m, planner.block(), shape);
  const double overhead = pred.recompute_flops / (flops * shape.grad_accum);
  const int64_t min_budget = planner.min_feasible_budget();
  const Communication link = communication(spec.cfg, planner, shape, pred);
  Frontier sweep;
  std::vector<FrontierPoint> manual;
  if (args.pareto || args.json) {
    sweep = planner.frontier(args.points, kSweepSeconds);
    for (const auto& policy : manual_policies(m.n_layer)) {
      const auto p = planner.predict(compile_policy(policy, m.n_layer, m.dropout));
      manual.push_back({p.peak, p.recompute_seconds, policy});
    }
  }
  if (args.json) {
    auto points = [&](const std::vector<FrontierPoint>& v) {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& p : v)
        a.push_back({{"label", p.label}, {"peak", p.peak}, {"recompute_flops", p.recompute_seconds}});
      return a;
    };
    json["min_feasible_budget"] = min_budget;
    json["step_flops"] = flops * shape.grad_accum;
    json["recompute_overhead"] = overhead;
    json["communication"] = communication_json(spec.cfg, link);
    json["offload"] = {{"rate_gb_per_s", spec.cfg.ac.offload_rate},
                       {"bytes_each_way", pred.offloaded_bytes},
                       {"host_peak", pred.host_peak},
                       {"seconds", pred.copy_seconds / (spec.cfg.parallel.compute_rate * 1e12)},
                       {"wait_seconds", pred.copy_wait_seconds / (spec.cfg.parallel.compute_rate * 1e12)},
                       {"slowdown_seconds", pred.copy_slowdown_seconds / (spec.cfg.parallel.compute_rate * 1e12)}};
    json["frontier"] = points(sweep.points);
    json["frontier_budgets"] = {{"asked", sweep.asked}, {"solved", sweep.solved}, {"seconds", sweep.seconds}};
    json["manual"] = points(manual);
    fmt::print("{}\n", json.dump(2));
    return 0;
  }
  fmt::print("minimum feasible {}; recompute {:.1f}% over the {} FLOPs of a step without recompute\n",
             format_bytes(min_budget), 100.0 * overhead, format_count(flops * shape.grad_accum));
  if (shape.tp > 1) fmt::print("{}", communication_text(spec.cfg, link, ""));
  if (pred.offloaded_bytes > 0) {
    const double rate = spec.cfg.parallel.compute_rate * 1e12;
    fmt::print(
        "offload copies at ac.offload_rate = {} GB/s: {} to host memory and back a step, {:.1f} ms of copies beside "
        "the compute, which waits {:.1f} ms for them and runs {:.1f} ms longer beside them (ac.offload_slowdown = "
        "{}): {:.1f}% over the step's FLOPs at parallel.compute_rate = {} TFLOP/s\n",
        spec.cfg.ac.offload_rate, format_bytes(pred.offloaded_bytes), 1e3 * pred.copy_seconds / rate,
        1e3 * pred.copy_wait_seconds / rate, 1e3 * pred.copy_slowdown_seconds / rate, spec.cfg.ac.offload_slowdown,
        100.0 * pred.copy_added_seconds() / (flops * static_cast<double>(shape.grad_accum)),
        spec.cfg.parallel.compute_rate);
  }
  if (args.pareto) {
    fmt::print("\nfrontier (budget plans):\n  {:>12}  {:>10}\n", "peak", "recompute");
    for (const auto& p : sweep.points) {
      fmt::print("  {:>12}  {:>9.1f}%\n", format_bytes(p.peak), 100.0 * p.recompute_seconds / flops);
    }
    fmt::print("manual policies:\n");
    for (const auto& p : manual) {
      fmt::print("  {:>12}  {:>9.1f}%  {}\n", format_bytes(p.peak), 100.0 * p.recompute_seconds / flops, p.label);
    }
    std::string why;
    if (sweep.solved < sweep.asked) {
      fmt::print(
          "(the frontier is coarser: {} of {} budgets solved in {:.1f} s, the sweep starting none after {:.0f} s; "
          "the ends and the middles of the gaps come first)\n",
          sweep.solved, sweep.asked, sweep.seconds, kSweepSeconds);
    }
    if (!plot_frontier(args.plot, sweep.points, manual, flops, &why)) {
      throw std::runtime_error(
          fmt::format("The frontier could not be plotted to --plot = \"{}\": {}; the tables above "
                      "hold the same figures.",
                      args.plot, why));
    }
    fmt::print("plot: {}\n", args.plot);
  }
  return 0;
}

}  // namespace remat::cli
