// The one text and JSON rendering of a resolved run (run/run.h).
#include "remat/memory.h"
#include "remat/policy.h"
#include "remat/prices.h"
#include "run/run.h"
#include "dist/ranks.h"
#include "util/progress.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <map>

namespace remat {
namespace {

using memory::format_bytes;

constexpr size_t kColumns = 100;

// Whether `r`'s times are measured (seconds of this machine) rather than FLOPs at a rate.
bool measured(const RunPlan& r) { return r.prices.base_seconds > 0 || r.prices.times.layer_pass_seconds > 0; }

// `seconds` priced by `r`'s prices, as a reader takes it: milliseconds where measured,
// else the FLOPs they stand for.
std::string work(const RunPlan& r, double seconds) {
  if (measured(r)) return fmt::format("{:.1f} ms", 1e3 * seconds);
  return format_count(seconds * r.prices.times.flops_per_second) + " FLOPs";
}

// The slots of `names`, by module: "attn.{norm,probs} mlp.{act_in}" (a slot without a
// module, "input", as it is).
std::string by_module(const std::vector<std::string>& names) {
  std::vector<std::pair<std::string, std::vector<std::string>>> modules;
  for (const std::string& n : names) {
    const size_t dot = n.find('.');
    const std::string module = dot == std::string::npos ? n : n.substr(0, dot);
    if (modules.empty() || modules.back().first != module) modules.push_back({module, {}});
    if (dot != std::string::npos) modules.back().second.push_back(n.substr(dot + 1));
  }
  std::vector<std::string> parts;
  for (const auto& [module, slots] : modules) {
    if (slots.empty()) {
      parts.push_back(module);
    } else {
      parts.push_back(slots.size() == 1 ? module + "." + slots[0]
                                        : fmt::format("{}.{{{}}}", module, fmt::join(slots, ",")));
    }
  }
  return fmt::format("{}", fmt::join(parts, " "));
}

// What layer `l` of `plan` keeps of a block with `slots`, in a few words.
std::string layer_words(const ActivationPlan& plan, const std::vector<std::string>& slots, size_t l) {
  const LayerPlan& lp = plan.layers[l];
  const bool chunk_start = plan.chunk_of(static_cast<int64_t>(l)) == static_cast<int64_t>(l);
  std::string text;
  if (lp.chunk_begin >= 0) {
    text = fmt::format("nothing: recomputed with the chunk from layer {}", lp.chunk_begin + 1);
  } else if (chunk_start) {
    text = "input: the chunk's forward is recomputed in its last layer's backward";
  } else if (lp.dropped.empty()) {
    text = "all";
  } else {
    std::vector<std::string> kept, dropped;
    for (const std::string& s : slots) {
      if (s == "input") continue;
      (lp.dropped.has(slot_of_name(s)) ? dropped : kept).push_back(s);
    }
    // The shorter of the two lists.
    text = kept.empty()                   ? "input only"
           : kept.size() < dropped.size() ? "input, " + by_module(kept)
                                          : "all but " + by_module(dropped);
  }
  if (lp.input_sharded) text += "; input as a share per tensor-parallel rank";
  if (lp.attention) text += fmt::format("; {} attention", attention_name(*lp.attention));
  if (!lp.offloaded.empty()) text += "; offloads " + by_module(lp.offloaded.names()) + " to host memory";
  if (lp.prefetch) text += fmt::format(", back from the start of layer {}'s backward", l + 2);
  if (plan.keeps_weights(static_cast<int64_t>(l))) text += "; its gathered weights kept to its backward";
  return text;
}

std::string line(const std::string& text) { return text + "\n"; }

// `text` after `prefix`, wrapped at its last space within kColumns; continuation lines
// are indented by `indent`.
std::string wrapped(const std::string& prefix, const std::string& text, size_t indent) {
  std::string out = prefix;
  size_t width = prefix.size(), from = 0;
  while (text.size() - from > kColumns - width) {
    size_t end = text.rfind(' ', from + kColumns - width);
    if (end == std::string::npos || end <= from) end = from + kColumns - width;
    out += text.substr(from, end - from) + "\n" + std::string(indent, ' ');
    width = indent;
    from = end < text.size() && text[end] == ' ' ? end + 1 : end;
  }
  return out + text.substr(from) + "\n";
}

// The peak's activations kept (less the gathered weights layers keep) and working set
// (less the running part's gathered weights).
int64_t activations_at_peak(const cost::StepPrediction& p) {
  return p.peak - p.statics.total() - p.working_set - p.peak_kept_weights;
}
int64_t working_set_at_peak(const cost::StepPrediction& p) { return p.working_set - p.peak_running_weights; }

// The parts of `p`'s peak, indented lines.
std::string breakdown(const cost::StepPrediction& p) {
  std::string s = fmt::format("  parameters {}, gradients {}, optimizer {}", format_bytes(p.statics.params),
                              format_bytes(p.statics.grads), format_bytes(p.statics.optimizer));
  if (p.statics.compute_copies > 0) s += fmt::format(", compute copies {}", format_bytes(p.statics.compute_copies));
  s += fmt::format(", batch {}\n  kept activations {}", format_bytes(p.statics.batch),
                   format_bytes(activations_at_peak(p)));
  if (p.statics.gathered > 0) {
    s += fmt::format(", gathered weights {}", format_bytes(p.peak_kept_weights + p.peak_running_weights));
  }
  s += fmt::format(", working set {}", format_bytes(working_set_at_peak(p)));
  if (p.statics.gathered > 0) {
    const std::string kept = p.peak_kept_weights > 0 ? fmt::format(" and {} that layers keep to their backward",
                                                                   format_bytes(p.peak_kept_weights))
                                                     : std::string();
    s += fmt::format(
        "\n  gathered weights at the peak: {} of the part running{}; each part's, {} at most, are gathered for its "
        "forward and, unless the plan keeps a layer's, again for its backward",
        format_bytes(p.peak_running_weights), kept, format_bytes(p.statics.gathered));
  }
  if (p.host_peak > 0) {
    s += fmt::format("\n  host memory {} at most (offloaded slots), {} copied there and back a step",
                     format_bytes(p.host_peak), format_bytes(p.offloaded_bytes));
  }
  return s + "\n";
}

nlohmann::json breakdown_json(const cost::StepPrediction& p) {
  return {{"parameters", p.statics.params},
          {"gradients", p.statics.grads},
          {"optimizer", p.statics.optimizer},
          {"compute_copies", p.statics.compute_copies},
          {"gathered_weights", p.statics.gathered},
          {"batch", p.statics.batch},
          {"kept_activations", activations_at_peak(p)},
          {"kept_weights", p.peak_kept_weights},
          {"running_weights", p.peak_running_weights},
          {"working_set", working_set_at_peak(p)},
          {"peak", p.peak},
          {"peak_at", p.peak_at},
          {"host_peak", p.host_peak},
          {"offloaded_bytes", p.offloaded_bytes},
          {"data_parallel",
           {{"gradient_bytes", p.data_parallel.gradients.bytes},
            {"exchange_bytes", p.data_parallel.exchange.bytes},
            {"gather_bytes", p.data_parallel.gathers.bytes},
            {"regather_bytes", p.data_parallel.regathers.bytes},
            {"regather_seconds", p.regather_seconds},
            {"ring_steps", p.data_parallel.total().messages},
            {"seconds", p.data_parallel_seconds}}}};
}

// Of a layer's copies to host memory and back, the share that runs beside its compute
// (LayerCost::copy_wait_seconds); -1 without copies.
double copies_hidden(const cost::LayerCost& c) {
  return c.copy_seconds > 0 ? 1.0 - c.copy_wait_seconds / c.copy_seconds : -1.0;
}

// The layers `pred` predicts (a pipeline stage's, or every layer) under `plan` of a block
// with `slots` (RunPlan::slots), runs of consecutive layers planned alike one line each
// (wrapped within 100 columns), under a heading line; where some layer offloads, with its
// host bytes and the share of its copies hidden behind its compute.
std::string layer_table(const ActivationPlan& plan, const std::vector<std::string>& slots,
                        const cost::StepPrediction& pred) {
  struct Group {
    int64_t first, last;
    std::string words;
    int64_t kept, host;
    double flops, hidden;
  };
  std::vector<Group> groups;
  bool offloads = false;
  for (size_t i = 0; i < pred.layers.size(); ++i) {
    const auto l = static_cast<size_t>(pred.first_layer) + i;
    const std::string words = layer_words(plan, slots, l);
    const auto& c = pred.layers[i];
    const double hidden = copies_hidden(c);
    offloads = offloads || c.host > 0;
    const bool chunked = plan.chunk_of(static_cast<int64_t>(l)) >= 0;
    const Group* last = groups.empty() ? nullptr : &groups.back();
    if (last != nullptr && !chunked && last->words == words && last->kept == c.kept && last->host == c.host &&
        last->flops == c.recompute_flops && last->hidden == hidden) {
      groups.back().last = static_cast<int64_t>(l);
    } else {
      groups.push_back(
          {static_cast<int64_t>(l), static_cast<int64_t>(l), words, c.kept, c.host, c.recompute_flops, hidden});
    }
  }
  const std::string host_heading = offloads ? fmt::format(" {:>11} {:>7}", "host each", "hidden") : "";
  std::string out =
      fmt::format("  {:<10} {:>11} {:>16}{}  {}\n", "layers", "kept each", "recompute each", host_heading, "keeps");
  for (const Group& g : groups) {
    const std::string range =
        g.first == g.last ? fmt::format("{}", g.first + 1) : fmt::format("{}-{}", g.first + 1, g.last + 1);
    const std::string flops = g.flops > 0 ? format_count(g.flops) + " FLOPs" : "-";
    const std::string host = !offloads ? ""
                                       : fmt::format(" {:>11} {:>7}", g.host > 0 ? format_bytes(g.host) : "-",
                                                     g.hidden >= 0 ? fmt::format("{:.0f}%", 100 * g.hidden) : "-");
    out += wrapped(fmt::format("  {:<10} {:>11} {:>16}{}  ", range, format_bytes(g.kept), flops, host), g.words,
                   offloads ? 63 : 43);
  }
  return out;
}

// One line on stage `s` of `r` (from 0): its layers, microbatches in flight under
// `schedule`, its predicted peak and where, then `work` (its time per microbatch).
std::string stage_line(const PlanResult& r, size_t s, int64_t microbatches, pipeline::Schedule schedule,
                       const std::string& work) {
  const cost::StepPrediction& p = r.stages[s];
  const int64_t first = p.first_layer + 1, last = p.first_layer + static_cast<int64_t>(p.layers.size());
  const int64_t held =
      pipeline::in_flight(schedule, static_cast<int64_t>(r.stages.size()), static_cast<int64_t>(s), microbatches);
  return fmt::format("stage {}: {}, {} microbatch{} in flight, peak {} ({}), {}", s + 1,
                     first == last ? fmt::format("layer {} (1)", first)
                                   : fmt::format("layers {}-{} ({})", first, last, last - first + 1),
                     held, held == 1 ? "" : "es", format_bytes(p.peak), p.peak_at, work);
}

// The data-parallel ranks' own `peaks` ([rank][stage]) on `r`'s stage, the highest first,
// the ranks whose peaks print alike together: "77.80 MiB on ranks 0 and 1, 77.65 MiB on
// ranks 2 and 3".
std::string dp_rank_peaks_line(const RunPlan& r, const std::vector<std::vector<int64_t>>& peaks) {
  std::map<int64_t, std::vector<size_t>, std::greater<>> ranks;
  for (size_t d = 0; d < peaks.size(); ++d) ranks[peaks[d][static_cast<size_t>(r.stage)]].push_back(d);
  std::vector<std::pair<std::string, std::vector<size_t>>> shown;
  for (const auto& [peak, of] : ranks) {
    if (shown.empty() || shown.back().first != format_bytes(peak)) {
      shown.emplace_back(format_bytes(peak), of);
    } else {
      shown.back().second.insert(shown.back().second.end(), of.begin(), of.end());
    }
  }
  std::vector<std::string> each;
  for (auto& [bytes, of] : shown) {
    std::sort(of.begin(), of.end());
    const std::string last = std::to_string(of.back());
    each.push_back(of.size() == 1 ? fmt::format("{} on rank {}", bytes, last)
                                  : fmt::format("{} on ranks {} and {}", bytes,
                                                fmt::join(std::vector<size_t>(of.begin(), of.end() - 1), ", "), last));
  }
  return fmt::format(
      "data-parallel ranks{}, each holding its own share of the sharded optimizer state (the peak above is the "
      "busiest's): {}",
      r.pipeline ? " of this stage" : "", fmt::join(each, ", "));
}

// What a rank of `r`'s stage sends over its data-parallel group in a step, by what: the
// same bytes whatever the prices (the step time prices them).
std::string data_parallel_line(const RunPlan& r) {
  const cost::DataParallelTraffic& t = r.predicted.data_parallel;
  std::vector<std::string> parts;
  const auto part = [&](const graph::LinkTraffic& l, const char* what) {
    if (!l.none()) parts.push_back(fmt::format("{} {}", what, format_bytes(static_cast<int64_t>(l.bytes))));
  };
  part(t.gradients, "gradient sums");
  part(t.exchange, "parameter exchange");
  part(t.gathers, "weight gathers");
  part(t.regathers, "weight gathers again (backwards and recomputes)");
  return fmt::format("data-parallel traffic a step{}, sent by each rank in {} all-reduce ring steps: {}",
                     r.pipeline ? " of this stage" : "", t.total().messages, fmt::join(parts, ", "));
}

}  // namespace

std::string plan_text(const Config& cfg, const RunPlan& r) {
  std::string text;
  for (const Choice& c : r.choices) text += c.line() + "\n";
  const std::string how =
      r.resumed ? fmt::format("{}, the checkpoint's, as the run trained before it stopped", r.plan.policy)
      : !cfg.ac.budget.empty()
          ? fmt::format("the planner's for ac.budget = \"{}\" ({})", cfg.ac.budget, format_bytes(r.budget))
          : fmt::format("policy {}", r.plan.policy);
  text += fmt::format("plan: {}, {} layers\n", how, r.plan.layers.size());
  const cost::StepPrediction& p = r.predicted;
  if (r.pipeline) {
    const PlanResult& pp = *r.pipeline;
    const int64_t m = cfg.train.grad_accum;
    text += fmt::format("pipeline: {} stages, {} schedule, {} microbatch{}; this rank is stage {}\n", pp.stages.size(),
                        pipeline::schedule_name(cfg.parallel.schedule), m, m == 1 ? "" : "es", r.stage + 1);
    for (size_t s = 0; s < pp.stages.size(); ++s) {
      text += line(stage_line(pp, s, m, cfg.parallel.schedule, work(r, pp.stage_seconds[s]) + " per microbatch"));
      text += layer_table(r.plan, r.slots, pp.stages[s]);
    }
    text +=
        line(fmt::format("bottleneck: stage {}; the schedule takes (microbatches + stages - 1) = {} times "
                         "its {}, {}, plus the optimizer",
                         pp.bottleneck + 1, m + static_cast<int64_t>(pp.stages.size()) - 1,
                         work(r, pp.stage_seconds[static_cast<size_t>(pp.bottleneck)]), work(r, pp.schedule_seconds)));
  } else {
    text += layer_table(r.plan, r.slots, p);
  }
  text += fmt::format("predicted step{}: peak {} in the {}\n", r.pipeline ? " of this stage" : "", format_bytes(p.peak),
                      p.peak_at);
  text += breakdown(p);
  if (const auto peaks = r.dp_rank_peaks(); !peaks.empty()) text += line(dp_rank_peaks_line(r, peaks));
  if (!p.data_parallel.total().none()) text += line(data_parallel_line(r));
  if (!r.device.empty()) {
    const cost::DeviceMemory& d = r.device[static_cast<size_t>(r.stage)];
    text += line(fmt::format(
        "CUDA caching allocator{}: reserves {} at most, {} allocated (requests rounded up, a 32 MiB cuBLAS workspace "
        "counted), expandable_segments {}; the CUDA context and NCCL's buffers, outside it, take about 0.3 to 0.5 GiB "
        "more (not modelled)",
        r.pipeline ? ", this stage" : "", format_bytes(d.reserved_peak), format_bytes(d.allocated_peak),
        cfg.run.expandable_segments ? "on" : "off"));
  }
  text +=
      line(fmt::format("recompute: {} FLOPs a step{}", format_count(p.recompute_flops),
                       measured(r) && p.recompute_flops > 0 ? fmt::format(", {}", work(r, p.recompute_seconds)) : ""));
  if (r.step_seconds > 0) {
    const Prices& prof = r.prices;
    const double data_parallel = r.pipeline ? data_parallel_seconds(*r.pipeline) : p.data_parallel_seconds;
    const std::string collectives =
        data_parallel > 0
            ? fmt::format(" + {:.1f} ms data-parallel collectives ({:.2f} GB/s and {:.1f} us a ring step)",
                          1e3 * data_parallel, prof.times.data_link_bytes_per_second / 1e9,
                          1e6 * prof.times.data_link_latency_seconds)
            : "";
    const std::string parts =
        r.pipeline
            ? fmt::format(
                  "the schedule simulated stage by stage, {:.1f} ms (transfers not priced), + {:.1f} ms "
                  "the slowest stage's update{}",
                  1e3 * r.pipeline->simulated_seconds,
                  1e3 * (r.step_seconds - r.pipeline->simulated_seconds - data_parallel), collectives)
            : fmt::format(
                  "{} x {:.1f} ms forward and backward{} + {:.1f} ms recompute{} + {:.1f} ms the update around the "
                  "passes{}",
                  cfg.train.grad_accum, 1e3 * prof.base_seconds,
                  p.attention_seconds != 0 ? fmt::format(" {:+.1f} ms the layers running the other "
                                                         "attention op",
                                                         1e3 * p.attention_seconds)
                                           : "",
                  1e3 * p.recompute_seconds,
                  p.offloaded_bytes > 0
                      ? fmt::format(" + {:.1f} ms waiting for the {:.1f} ms of copies to host memory "
                                    "and back + {:.1f} ms slower compute beside them",
                                    1e3 * p.copy_wait_seconds, 1e3 * p.copy_seconds, 1e3 * p.copy_slowdown_seconds)
                      : "",
                  1e3 * prof.optimizer_seconds, collectives);
    text += line(fmt::format("predicted step time {:.1f} ms: {}", 1e3 * r.step_seconds, parts));
    if (!prof.path.empty()) text += line("time profile: " + prof.path);
  }
  if (r.budget > 0) {
    // A plan mixing the attention ops per layer is compared with the model's op in every
    // layer, as a run without recompute would train.
    const bool mixed = std::any_of(r.plan.layers.begin(), r.plan.layers.end(),
                                   [](const LayerPlan& lp) { return lp.attention.has_value(); });
    const std::string every =
        mixed ? fmt::format(" ({} attention in every layer)", attention_name(cfg.model.attention)) : "";
    const int64_t host_budget = r.host_budget;
    text += line(fmt::format(
        "budget {}{}{}: the plan peaks at {}{}; without recompute{} the step would peak at {}{}",
        format_bytes(r.budget), r.pipeline ? " per rank" : "",
        host_budget > 0 ? fmt::format(", host memory {} (ac.host_budget)", format_bytes(host_budget)) : "",
        format_bytes(r.peak()),
        r.device.empty()
            ? ""
            : fmt::format(" and the CUDA allocator reserves {}", format_bytes(r.device_peak().reserved_peak)),
        every, format_bytes(r.none_peak),
        r.none_step_seconds > 0 ? fmt::format(" and take {:.1f} ms", 1e3 * r.none_step_seconds) : ""));
  }
  return text;
}

std::string render_text(const RunSpec& spec) {
  const ModelConfig& m = spec.cfg.model;
  // The corpus is mapped from disk, never held: a line for where it is, not for bytes.
  const std::string corpus = spec.corpus
                                 ? fmt::format("token corpus: {}, {} tokens read from disk as batches are drawn",
                                               spec.corpus_dir, spec.corpus->train_tokens + spec.corpus->val_tokens)
                                 : fmt::format("token corpus: {}, not prepared yet (remat prepare)", spec.corpus_dir);
  const int64_t accum = spec.cfg.train.grad_accum;
  std::string text = line(fmt::format("run: {} ({}), {} layers, d_model {}, {} heads, vocabulary {}", m.preset,
                                      arch_name(m.arch), m.n_layer, m.d_model, m.n_head, m.vocab_size));
  text += line(fmt::format("step: {} x {} tokens, {} microbatch{}, {}{}", spec.cfg.train.batch, spec.cfg.train.seq,
                           accum, accum == 1 ? "" : "es", spec.cfg.run.dtype, describe_ranks(spec.local)));
  text += line(corpus);
  return text + plan_text(spec.cfg, spec.plan);
}

std::string plan_listing(const RunSpec& spec) {
  const RunPlan& r = spec.plan;
  std::string text = explain_plan(r.plan);
  text += "\nkept bytes and recompute FLOPs per layer (of one microbatch; this rank's stage):\n";
  const cost::StepPrediction& p = r.predicted;
  text += fmt::format("  embedding  {:>11}\n", format_bytes(p.embedding));
  for (size_t i = 0; i < p.layers.size(); ++i) {
    text += fmt::format("  layer {:<4} {:>11}  {:>8} FLOPs recomputed{}\n", p.first_layer + static_cast<int64_t>(i) + 1,
                        format_bytes(p.layers[i].kept), format_count(p.layers[i].recompute_flops),
                        p.layers[i].host > 0 ? fmt::format(", {} in host memory", format_bytes(p.layers[i].host)) : "");
  }
  text += fmt::format("  head       {:>11}  ({} loss head)\n", format_bytes(p.head),
                      loss_head_name(spec.cfg.model.loss_head));
  return text;
}

nlohmann::json render_json(const RunSpec& spec) {
  const ModelConfig& m = spec.cfg.model;
  const RunPlan& r = spec.plan;
  const auto layers_of = [&](const cost::StepPrediction& p) {
    nlohmann::json layers = nlohmann::json::array();
    for (size_t i = 0; i < p.layers.size(); ++i) {
      const LayerPlan& lp = r.plan.layers[static_cast<size_t>(p.first_layer) + i];
      const double hidden = copies_hidden(p.layers[i]);
      layers.push_back({{"layer", p.first_layer + static_cast<int64_t>(i) + 1},
                        {"dropped", lp.dropped.names()},
                        {"chunk_begin", lp.chunk_begin < 0 ? -1 : lp.chunk_begin + 1},
                        {"input_sharded", lp.input_sharded},
                        {"attention", attention_name(lp.attention.value_or(m.attention))},
                        {"kept_bytes", p.layers[i].kept},
                        {"offloaded", lp.offloaded.names()},
                        {"prefetch", lp.prefetch},
                        {"weights_kept", r.plan.keeps_weights(p.first_layer + static_cast<int64_t>(i))},
                        {"host_bytes", p.layers[i].host},
                        {"copies_hidden", hidden >= 0 ? nlohmann::json(hidden) : nlohmann::json(nullptr)},
                        {"recompute_flops", p.layers[i].recompute_flops}});
    }
    return layers;
  };
  nlohmann::json choices = nlohmann::json::array();
  std::map<std::string, std::string> lines;
  for (const Choice& c : r.choices) {
    choices.push_back({{"setting", c.setting}, {"taken", c.taken}, {"why", c.why}});
    lines[c.setting] = c.line();
  }
  const auto line_of = [&](const std::string& setting) {
    const auto found = lines.find(setting);
    return found == lines.end() ? std::string() : found->second;
  };
  nlohmann::json out = {
      {"model",
       {{"preset", m.preset},
        {"arch", arch_name(m.arch)},
        {"layers", m.n_layer},
        {"d_model", m.d_model},
        {"vocab_size", m.vocab_size}}},
      {"attention", attention_name(m.attention)},
      {"attention_choice", line_of("model.attention")},
      {"loss_head", loss_head_name(m.loss_head)},
      {"loss_head_choice", line_of("model.loss_head")},
      {"choices", choices},
      {"shape",
       {{"batch", spec.shape.batch},
        {"ranks", spec.layout.dp},
        {"tp", spec.layout.tp},
        {"sp", spec.layout.sp},
        {"seq", spec.shape.seq},
        {"grad_accum", spec.shape.grad_accum},
        {"dtype", spec.cfg.run.dtype}}},
      {"token_corpus_tokens", spec.corpus ? spec.corpus->train_tokens + spec.corpus->val_tokens : 0},
      {"policy", r.plan.policy},
      {"budget", r.budget},
      {"host_budget", r.host_budget},
      {"none_peak", r.none_peak},
      {"dp_rank_peaks", r.dp_rank_peaks()},
      {"predicted_step_seconds", r.step_seconds},
      {"none_step_seconds", r.none_step_seconds},
  };
  if (r.pipeline) {
    const PlanResult& pp = *r.pipeline;
    nlohmann::json stages = nlohmann::json::array();
    for (size_t s = 0; s < pp.stages.size(); ++s) {
      const cost::StepPrediction& p = pp.stages[s];
      stages.push_back({{"stage", s + 1},
                        {"first_layer", p.first_layer + 1},
                        {"layers", pp.split[s]},
                        {"in_flight", pipeline::in_flight(spec.cfg.parallel.schedule, spec.layout.pp,
                                                          static_cast<int64_t>(s), spec.cfg.train.grad_accum)},
                        {"plan", layers_of(p)},
                        {"breakdown", breakdown_json(p)},
                        {"recompute_flops", p.recompute_flops}});
    }
    out["pipeline"] = {{"stages", spec.layout.pp},
                       {"schedule", pipeline::schedule_name(spec.cfg.parallel.schedule)},
                       {"microbatches", spec.cfg.train.grad_accum}};
    out["stages"] = stages;
    out["bottleneck"] = pp.bottleneck + 1;
  } else {
    out["plan"] = layers_of(r.predicted);
    out["breakdown"] = breakdown_json(r.predicted);
    out["recompute_flops_per_step"] = r.predicted.recompute_flops;
  }
  if (!r.device.empty()) {
    nlohmann::json stages = nlohmann::json::array();
    for (const cost::DeviceMemory& d : r.device) {
      stages.push_back({{"allocated_peak", d.allocated_peak}, {"reserved_peak", d.reserved_peak}});
    }
    out["cuda_allocator"] = {{"expandable_segments", spec.cfg.run.expandable_segments}, {"stages", stages}};
  }
  return out;
}

}  // namespace remat
