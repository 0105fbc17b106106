#include "cli/plan_cmd.h"

#include "remat/data.h"
#include "remat/memory.h"
#include "remat/ops.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/prices.h"
#include "remat/tokenizer.h"
#include "remat/trainer.h"
#include "run/run.h"
#include "dist/ranks.h"
#include "util/device.h"
#include "util/progress.h"
#include "util/gnuplot.h"
#include "util/stop_signals.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <optional>
#include <stdexcept>

namespace remat::cli {
namespace {

using memory::format_bytes;

// One rank's FLOPs of one microbatch's forward and backward without recompute (a backward costs
// about twice its forward).
double step_flops(const ModelConfig& m, const graph::BlockGraph& b, const cost::StepShape& s, const Layout& layout) {
  const int64_t N = s.batch * s.seq;
  return 3.0 * (m.n_layer * b.forward_flops() + ops::cross_entropy_flops(N, m.d_model, m.vocab_size / layout.tp));
}

// Seconds of the collectives one microbatch's forward and backward run without recompute
// on the ranks of `stage` (its blocks', and the embedding's and the loss head's where it
// holds them), at `times`' links.
double step_link_seconds(const ModelConfig& m, const graph::BlockGraph& b, const cost::StepShape& s,
                         const Layout& stage, const cost::NodeTimes& times) {
  const auto of = [&](const graph::BlockGraph& g) {
    double t = 0;
    for (const auto& n : g.nodes) t += times.link_seconds(n.forward_link) + times.link_seconds(n.backward_link);
    return t;
  };
  double t = static_cast<double>(stage.stage_layers(m.n_layer)) * of(b);
  if (stage.has_embedding()) t += of(graph::embed_graph(m, s.batch, s.seq, s.dtype, stage));
  if (stage.has_head()) t += of(graph::head_graph(m, s.batch, s.seq, s.dtype, s.ce_chunk, stage));
  return t;
}

// The FLOPs that `seconds` of work weigh at `rate` FLOP/s: whole, as the planner counts
// them (its seconds came from FLOPs at that rate).
double as_flops(double seconds, double rate) { return std::round(seconds * rate); }

// The collectives one rank of a stage runs in a step: those its plan's recompute re-runs,
// in seconds and in the FLOPs the prices weigh them as, and the step's own without recompute.
struct Communication {
  double recompute_flops = 0, recompute_seconds = 0, step_seconds = 0;
};

// Of the stage `pred` predicts on the ranks of `stage` (all the layers without a pipeline).
Communication communication(const RunSpec& spec, const Layout& stage, const cost::StepPrediction& pred) {
  const cost::NodeTimes& times = spec.plan.prices.times;
  Communication c;
  c.recompute_seconds = pred.recompute_link_seconds;
  c.recompute_flops = as_flops(pred.recompute_link_seconds, times.flops_per_second);
  c.step_seconds = static_cast<double>(spec.shape.grad_accum) *
                   step_link_seconds(spec.cfg.model, spec.plan.planner->block(), spec.shape, stage, times);
  return c;
}

nlohmann::json communication_json(const Communication& c) {
  return {{"recompute_seconds", c.recompute_seconds}, {"step_seconds", c.step_seconds}};
}

// With the links it was priced at: the config's rates, or a run's (`recorded`).
nlohmann::json communication_json(const RunSpec& spec, const Communication& c, bool recorded) {
  const ParallelConfig& p = spec.cfg.parallel;
  const cost::NodeTimes& times = spec.plan.prices.times;
  nlohmann::json j = communication_json(c);
  j["link_rate_gb_per_s"] = recorded ? times.link_bytes_per_second / 1e9 : p.link_rate;
  j["link_latency_us"] = recorded ? times.link_latency_seconds * 1e6 : p.link_latency;
  j["compute_rate_tflop_per_s"] = recorded ? times.flops_per_second / 1e12 : p.compute_rate;
  return j;
}

// `whose`: which ranks' collectives, empty when every rank runs the same.
std::string communication_text(const RunSpec& spec, const Communication& c, const std::string& whose, bool recorded) {
  const ParallelConfig& p = spec.cfg.parallel;
  const cost::NodeTimes& times = spec.plan.prices.times;
  const std::string links = recorded ? fmt::format("the run's links, {:.2f} GB/s and {:.2f} us a ring step",
                                                   times.link_bytes_per_second / 1e9, times.link_latency_seconds * 1e6)
                                     : fmt::format("parallel.link_rate = {} GB/s and parallel.link_latency = {} us",
                                                   p.link_rate, p.link_latency);
  const std::string rate = recorded ? fmt::format("the run's {} FLOP/s", format_count(times.flops_per_second))
                                    : fmt::format("parallel.compute_rate = {} TFLOP/s", p.compute_rate);
  return fmt::format(
      "communication at {}{}: the recompute re-runs {:.3f} ms of collectives per step (priced as {} FLOPs at {}); "
      "without recompute a step's collectives take {:.3f} ms\n",
      links, whose, 1e3 * c.recompute_seconds, format_count(c.recompute_flops), rate, 1e3 * c.step_seconds);
}

// A step's wall time at the declared rates (declared_step_seconds), and the tokens each
// rank trains a second at it: each data-parallel replica's batch, over its tensor-parallel
// ranks and pipeline stages.
struct DeclaredTime {
  double seconds = 0, data_parallel_seconds = 0, tokens_per_second = 0;
  /// The bottleneck stage's weights gathered again: within its passes, which the pipeline's
  /// time is made of, where the other collectives are the slowest stage's, after them.
  double regather_seconds = 0;
};

DeclaredTime declared_time(const RunSpec& spec) {
  const PlanResult r = spec.plan.pipeline ? *spec.plan.pipeline
                                          : spec.plan.planner->predict(spec.plan.plan, spec.plan.split, Ledgers::peak);
  DeclaredTime t;
  t.seconds = declared_step_seconds(r);
  t.data_parallel_seconds = data_parallel_seconds(r);
  t.regather_seconds = r.stages[static_cast<size_t>(r.bottleneck)].regather_seconds;
  const cost::StepShape& s = spec.shape;
  t.tokens_per_second = static_cast<double>(s.batch * s.seq * s.grad_accum) /
                        static_cast<double>(spec.layout.tp * spec.layout.pp) / t.seconds;
  return t;
}

// Seconds as a reader takes them: milliseconds below one.
std::string seconds_text(double seconds) {
  return seconds < 1 ? fmt::format("{:.3g} ms", 1e3 * seconds) : fmt::format("{:.3f} s", seconds);
}

void print_declared_time(const RunSpec& spec) {
  const ParallelConfig& p = spec.cfg.parallel;
  const DeclaredTime t = declared_time(spec);
  fmt::print(
      "predicted step time at the declared rates: {}, the passes and recompute at parallel.compute_rate = {} "
      "TFLOP/s{}{}; the update{} not priced: {:.0f} tokens/s per rank\n",
      seconds_text(t.seconds), p.compute_rate,
      spec.layout.tp > 1 ? fmt::format(", the tensor-parallel collectives at parallel.link_rate = {} GB/s", p.link_rate)
                         : "",
      spec.layout.dp > 1
          ? fmt::format(", {} of data-parallel collectives{} at parallel.dp_link_rate = {} GB/s and "
                        "dp_link_latency = {} us, beside no compute",
                        seconds_text(t.data_parallel_seconds),
                        t.regather_seconds > 0
                            ? fmt::format(" and {} of weights gathered again{}", seconds_text(t.regather_seconds),
                                          spec.layout.pp > 1 ? " in the bottleneck stage's passes" : "")
                            : "",
                        p.dp_link_rate, p.dp_link_latency)
          : "",
      spec.layout.pp > 1 ? " and the stages' transfers" : "", t.tokens_per_second);
}

void declared_time_json(const RunSpec& spec, nlohmann::json& json) {
  const DeclaredTime t = declared_time(spec);
  json["declared_step_seconds"] = t.seconds;
  json["declared_data_parallel_seconds"] = t.data_parallel_seconds;
  json["declared_tokens_per_second_per_rank"] = t.tokens_per_second;
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

// `step_seconds`: a step's without recompute, which the recompute's is a share of.
bool plot_frontier(const std::string& path, const std::vector<FrontierPoint>& frontier,
                   const std::vector<FrontierPoint>& manual, double step_seconds, std::string* why) {
  std::string script =
      "set terminal pngcairo size 900,560 noenhanced\nset output ARG1\nset title 'remat plan: memory/time frontier'\n"
      "set xlabel 'predicted peak (MiB)'\nset ylabel 'recompute (% of the step FLOPs)'\nset grid\nset key top right\n"
      "$budget << EOD\n";
  for (const auto& p : frontier)
    script += fmt::format("{} {}\n", p.peak / 1048576.0, 100.0 * p.recompute_seconds / step_seconds);
  script += "EOD\n$manual << EOD\n";
  for (const auto& p : manual) {
    script += fmt::format("{} {} \"{}\"\n", p.peak / 1048576.0, 100.0 * p.recompute_seconds / step_seconds, p.label);
  }
  script +=
      "EOD\nplot $budget using 1:2 with linespoints lw 2 pt 7 lc rgb '#d04020' title 'budget plans', "
      "$manual using 1:2 with points pt 5 ps 1.2 lc rgb '#3060b0' title 'manual policies', "
      "$manual using 1:2:3 with labels offset 1,0.6 left font ',8' notitle\n";
  return util::run_gnuplot(script, path, "", why);
}

// ColossalAI's least per-stage checkpoint counts (`num_ckpt_layers_per_stage`, each stage's
// first layers recomputed whole) with which every stage of `split` fits `budget`, and their
// prediction; nullopt when even every layer recomputed does not fit. A stage's peak depends
// on its own layers alone, so each count grows until its stage fits.
std::optional<std::pair<std::vector<int64_t>, PlanResult>> least_counts(const Config& cfg, const Planner& planner,
                                                                        const std::vector<int64_t>& split,
                                                                        int64_t budget) {
  AcConfig ac;
  ac.stages = static_cast<int64_t>(split.size());
  ac.num_layers_per_stage = fmt::format("{}", fmt::join(split, ","));
  std::vector<int64_t> counts(split.size(), 0);
  for (;;) {
    ac.num_ckpt_layers_per_stage = fmt::format("{}", fmt::join(counts, ","));
    PlanResult p = planner.predict(compile_policy(ac, cfg.model.n_layer, cfg.model.dropout), split, Ledgers::peak);
    bool fits = true;
    for (size_t s = 0; s < counts.size(); ++s) {
      if (p.stages[s].peak <= budget) continue;
      if (counts[s] == split[s]) return std::nullopt;
      ++counts[s];
      fits = false;
    }
    if (fits) return std::make_pair(counts, std::move(p));
  }
}

// What `remat plan` adds to a pipeline's plan: the collectives of every stage (JSON) and
// of the bottleneck (text), the layers split evenly and planned stage by stage, and
// ColossalAI's least per-stage counts, against the plan's schedule (time in FLOPs).
void pipeline_extras(const RunSpec& spec, const PlanArgs& args, nlohmann::json& json) {
  const Config& cfg = spec.cfg;
  const ModelConfig& m = cfg.model;
  const Planner& planner = *spec.plan.planner;
  const PlanResult& r = *spec.plan.pipeline;
  const int64_t budget = spec.plan.budget;
  // Seconds as the FLOPs the prices weigh them as.
  const double rate = spec.plan.prices.times.flops_per_second;
  const bool recorded = !args.prices.empty();
  // The split the run was given, or the even one the planner's is compared with.
  const bool given = !planner.layout().split.empty();
  const std::vector<int64_t> counted =
      given ? planner.layout().split : pipeline::even_split(m.n_layer, cfg.parallel.pp);
  // What splitting the layers evenly and planning each stage alone would give.
  const std::optional<PlanResult> even =
      !given && budget > 0 ? planner.plan({budget, spec.plan.host_budget}, counted, Ledgers::peak) : std::nullopt;
  // ColossalAI's way on the same split: whole layers recomputed, counted per stage.
  const auto counts = budget > 0 ? least_counts(cfg, planner, counted, budget) : std::nullopt;
  std::vector<Communication> links;
  for (size_t s = 0; s < r.stages.size(); ++s) {
    links.push_back(communication(spec, spec.layout.at_stage(static_cast<int64_t>(s)), r.stages[s]));
  }
  const auto bottleneck = static_cast<size_t>(r.bottleneck);
  if (args.json) {
    for (size_t s = 0; s < r.stages.size(); ++s) {
      json["stages"][s]["flops_per_microbatch"] = as_flops(r.stage_seconds[s], rate);
      json["stages"][s]["communication"] = communication_json(links[s]);
    }
    json["schedule_flops"] = as_flops(r.schedule_seconds, rate);
    // The bottleneck's collectives, which the schedule waits on.
    json["communication"] = communication_json(spec, links[bottleneck], recorded);
    json["communication"]["stage"] = r.bottleneck + 1;
    json["even_split_schedule_flops"] =
        even ? nlohmann::json(as_flops(even->schedule_seconds, rate)) : nlohmann::json();
    json["least_ckpt_layers_per_stage"] =
        counts ? nlohmann::json{{"counts", counts->first},
                                {"schedule_flops", as_flops(counts->second.schedule_seconds, rate)}}
               : nlohmann::json();
    return;
  }
  if (spec.layout.tp > 1) {
    fmt::print("{}",
               communication_text(spec, links[bottleneck],
                                  fmt::format(" on stage {}'s ranks (the bottleneck)", r.bottleneck + 1), recorded));
  }
  if (budget == 0) return;
  fmt::print(
      "ColossalAI's least per-stage counts on the {} split ({}): {}\n", given ? "given" : "even",
      fmt::join(counted, ","),
      counts ? fmt::format("num_ckpt_layers_per_stage = [{}], {} FLOPs, {:.3f} x this plan's",
                           fmt::join(counts->first, ","), format_count(as_flops(counts->second.schedule_seconds, rate)),
                           counts->second.schedule_seconds / r.schedule_seconds)
             : std::string("none fit the budget, even with every layer recomputed"));
  if (!given) {
    fmt::print("the even split ({}) planned stage by stage: {}\n", fmt::join(counted, ","),
               even
                   ? fmt::format("{} FLOPs, {:.3f} x this plan's", format_count(as_flops(even->schedule_seconds, rate)),
                                 even->schedule_seconds / r.schedule_seconds)
                   : "no plan fits the budget");
  }
}

// What `remat plan` adds to a one-stage plan: the least budget, the recompute's share of
// the step, the collectives, and with --pareto or --json the frontier and the manual
// policies beside it.
struct Extras {
  double flops = 0;         ///< a step's without recompute, of one microbatch
  double rate = 0;          ///< the prices' FLOP rate: seconds as the FLOPs they weigh
  double step_seconds = 0;  ///< a microbatch's without recompute at that rate
  int64_t min_budget = 0;
  Communication link;
  Frontier sweep;
  std::vector<FrontierPoint> manual;
};

Extras one_stage_extras(const RunSpec& spec, const PlanArgs& args) {
  const ModelConfig& m = spec.cfg.model;
  const Planner& planner = *spec.plan.planner;
  Extras x;
  x.flops = step_flops(m, planner.block(), spec.shape, spec.layout);
  x.rate = spec.plan.prices.times.flops_per_second;
  x.step_seconds = x.flops / x.rate;
  x.min_budget = planner.least_budget(spec.plan.host_budget);
  x.link = communication(spec, spec.layout, spec.plan.predicted);
  if (args.pareto || args.json) {
    x.sweep = planner.frontier(spec.plan.host_budget, args.points, kSweepSeconds);
    for (const auto& policy : manual_policies(m.n_layer)) {
      const cost::StepPrediction p =
          planner.predict(compile_policy(policy, m.n_layer, m.dropout), {}, Ledgers::peak).stages[0];
      x.manual.push_back({p.peak, p.recompute_seconds, policy});
    }
  }
  return x;
}

void print_json(const RunSpec& spec, const Extras& x, bool recorded, nlohmann::json& json) {
  const cost::StepPrediction& pred = spec.plan.predicted;
  const auto points = [&](const std::vector<FrontierPoint>& v) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& p : v) {
      a.push_back({{"label", p.label}, {"peak", p.peak}, {"recompute_flops", as_flops(p.recompute_seconds, x.rate)}});
    }
    return a;
  };
  const int64_t m = spec.shape.grad_accum;
  json["min_feasible_budget"] = x.min_budget;
  json["step_flops"] = x.flops * m;
  json["recompute_overhead"] = pred.recompute_flops / (x.flops * m);
  json["communication"] = communication_json(spec, x.link, recorded);
  json["offload"] = {
      {"rate_gb_per_s", recorded ? spec.plan.prices.times.host_bytes_per_second / 1e9 : spec.cfg.ac.offload_rate},
      {"bytes_each_way", pred.offloaded_bytes},
      {"host_peak", pred.host_peak},
      {"seconds", pred.copy_seconds},
      {"wait_seconds", pred.copy_wait_seconds},
      {"slowdown_seconds", pred.copy_slowdown_seconds}};
  json["frontier"] = points(x.sweep.points);
  json["frontier_budgets"] = {{"asked", x.sweep.asked}, {"solved", x.sweep.solved}, {"seconds", x.sweep.seconds}};
  json["manual"] = points(x.manual);
  fmt::print("{}\n", json.dump(2));
}

void print_text(const RunSpec& spec, const Extras& x, bool recorded) {
  const cost::StepPrediction& pred = spec.plan.predicted;
  const auto m = static_cast<double>(spec.shape.grad_accum);
  fmt::print("minimum feasible {}; recompute {:.1f}% over the {} FLOPs of a step without recompute\n",
             format_bytes(x.min_budget), 100.0 * pred.recompute_flops / (x.flops * m), format_count(x.flops * m));
  if (spec.layout.tp > 1) fmt::print("{}", communication_text(spec, x.link, "", recorded));
  if (pred.offloaded_bytes > 0) {
    const cost::NodeTimes& t = spec.plan.prices.times;
    fmt::print(
        "offload copies at {}: {} to host memory and back a step, {:.1f} ms of copies beside the compute, which waits "
        "{:.1f} ms for them and runs {:.1f} ms longer beside them ({}): {:.1f}% over the step's FLOPs at {}\n",
        recorded ? fmt::format("the run's {:.2f} GB/s", t.host_bytes_per_second / 1e9)
                 : fmt::format("ac.offload_rate = {} GB/s", spec.cfg.ac.offload_rate),
        format_bytes(pred.offloaded_bytes), 1e3 * pred.copy_seconds, 1e3 * pred.copy_wait_seconds,
        1e3 * pred.copy_slowdown_seconds,
        recorded ? fmt::format("the run's slowdown {:.3f}", t.host_copy_slowdown)
                 : fmt::format("ac.offload_slowdown = {}", spec.cfg.ac.offload_slowdown),
        100.0 * pred.copy_added_seconds() / (x.step_seconds * m),
        recorded ? fmt::format("the run's {} FLOP/s", format_count(x.rate))
                 : fmt::format("parallel.compute_rate = {} TFLOP/s", spec.cfg.parallel.compute_rate));
  }
}

void print_pareto(const Extras& x, const PlanArgs& args) {
  fmt::print("\nfrontier (budget plans):\n  {:>12}  {:>10}\n", "peak", "recompute");
  for (const auto& p : x.sweep.points) {
    fmt::print("  {:>12}  {:>9.1f}%\n", format_bytes(p.peak), 100.0 * p.recompute_seconds / x.step_seconds);
  }
  fmt::print("manual policies:\n");
  for (const auto& p : x.manual) {
    fmt::print("  {:>12}  {:>9.1f}%  {}\n", format_bytes(p.peak), 100.0 * p.recompute_seconds / x.step_seconds,
               p.label);
  }
  if (x.sweep.solved < x.sweep.asked) {
    fmt::print(
        "(the frontier is coarser: {} of {} budgets solved in {:.1f} s, the sweep starting none after {:.0f} s; "
        "the ends and the middles of the gaps come first)\n",
        x.sweep.solved, x.sweep.asked, x.sweep.seconds, kSweepSeconds);
  }
  std::string why;
  if (!plot_frontier(args.plot, x.sweep.points, x.manual, x.step_seconds, &why)) {
    throw std::runtime_error(
        fmt::format("The frontier could not be plotted to --plot = \"{}\": {}; the tables above "
                    "hold the same figures.",
                    args.plot, why));
  }
  fmt::print("plot: {}\n", args.plot);
}

// The run `cfg` describes, resolved as `remat train` would, priced as `args` says.
RunSpec resolve(const Config& cfg, const PlanArgs& args) {
  // Priced as declared (FLOPs at parallel.compute_rate, links at parallel.link_rate and
  // link_latency, copies at ac.offload_rate), or as a run recorded its prices.
  PriceSource prices = args.prices.empty() ? PriceSource::declared() : PriceSource::recorded(args.prices);
  RunInputs in;
  in.dtype = dtype_of(cfg.run.dtype);
  in.prices = &prices;
  // A run holds its token corpus (both splits) through every step; only a prepared corpus
  // says how many tokens it has.
  in.corpus_dir = corpus_dir(cfg.data);
  try {
    in.corpus = data::load_corpus_info(in.corpus_dir);
  } catch (const std::exception&) {
  }
  if (in.corpus || cfg.data.tokenizer.empty()) return resolve_run(cfg, in);
  // Not prepared yet: the vocabulary is the given tokenizer's.
  Config given = cfg;
  given.data.vocab_size = data::Tokenizer::load(cfg.data.tokenizer).vocab_size();
  return resolve_run(given, in);
}

}  // namespace

int cmd_plan(const Config& cfg_in, const PlanArgs& args) {
  const util::Phase phase("planning");
  Config cfg = cfg_in;
  if (!args.budget.empty()) cfg.ac.budget = args.budget;
  const RunSpec spec = resolve(cfg, args);
  if (args.explain_block) {
    const ModelConfig& m = spec.cfg.model;
    const cost::StepShape& shape = spec.shape;
    fmt::print(
        "One {} block at batch {} x {} tokens in {}{}: every value its forward makes, and the slot that "
        "keeps it for the backward (- : freed after its last forward reader).\n\n{}",
        arch_name(m.arch), shape.batch, shape.seq, spec.cfg.run.dtype, describe_ranks(spec.local),
        graph::explain(cost::shape_block(m, shape, spec.layout)));
    return 0;
  }
  nlohmann::json json = render_json(spec);
  if (!args.json) fmt::print("{}", render_text(spec));
  // Measured prices (--prices) time the step in the plan above.
  const bool recorded = !args.prices.empty();
  if (!recorded && args.json) declared_time_json(spec, json);
  if (!recorded && !args.json) print_declared_time(spec);
  if (spec.plan.pipeline) {
    pipeline_extras(spec, args, json);
    if (args.json) fmt::print("{}\n", json.dump(2));
    return 0;
  }
  const Extras x = one_stage_extras(spec, args);
  if (args.json) {
    print_json(spec, x, recorded, json);
    return 0;
  }
  print_text(spec, x, recorded);
  if (args.pareto) print_pareto(x, args);
  return 0;
}

}  // namespace remat::cli
