// Shared by the cost-model and planner tests.
#pragma once

#include "remat/config.h"
#include "remat/cost.h"
#include "remat/graph.h"
#include "remat/pipeline.h"
#include "remat/planner.h"
#include "remat/policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iterator>
#include <optional>
#include <random>

#include <string>

namespace remat::testing {

/// A preset with `layers` blocks and dropout `dropout`; presets that take the
/// tokenizer's vocabulary get 512.
inline ModelConfig plan_config(const std::string& preset, int64_t layers, double dropout) {
  ModelConfig c = model_preset(preset);
  c.n_layer = layers;
  c.dropout = dropout;
  if (c.vocab_size == 0) c.vocab_size = 512;
  return c;
}

/// A step of `B` x `T` tokens in `dtype`, `microbatches` of them, the loss head in chunks
/// of 100 positions.
inline cost::StepShape plan_shape(int64_t B, int64_t T, at::ScalarType dtype = at::kFloat, int64_t microbatches = 1) {
  cost::StepShape s;
  s.batch = B;
  s.seq = T;
  s.ce_chunk = 100;
  s.dtype = dtype;
  s.grad_accum = microbatches;
  return s;
}

/// The layout of one of `tp` tensor-parallel ranks (with sequence parallelism: `sp`).
inline Layout tp_layout(int64_t tp, bool sp = false) {
  Layout l;
  l.tp = tp;
  l.sp = sp;
  return l;
}

/// Stage `stage` of `stages` of a pipeline of `layers` layers split evenly, in `schedule`.
inline Layout stage_layout(int64_t layers, int64_t stages, int64_t stage,
                           pipeline::Schedule schedule = pipeline::Schedule::one_f_one_b) {
  Layout l;
  l.pp = stages;
  l.stage = stage;
  l.schedule = schedule;
  l.split = pipeline::even_split(layers, stages);
  return l;
}

/// A one-stage plan and its prediction.
struct Solved {
  ActivationPlan plan;
  cost::StepPrediction prediction;
};

/// `planner`'s one-stage plan within `budget` and `host` bytes of host memory, or nullopt.
inline std::optional<Solved> solve(const Planner& planner, int64_t budget, int64_t host = 0) {
  auto r = planner.plan({budget, host});
  if (!r) return std::nullopt;
  return Solved{r->plan, r->stages.at(0)};
}

/// A pipeline of `stages` in `schedule`, seen from its first stage: the split fixed where
/// given, else the planner's.
inline Layout pipeline_layout(int64_t stages, pipeline::Schedule schedule, std::vector<int64_t> split = {}) {
  Layout l;
  l.pp = stages;
  l.schedule = schedule;
  l.split = std::move(split);
  return l;
}

/// Times by FLOPs (one a second) under which copying `block`'s kept bytes to host memory
/// and back costs about its forward: some offloads pay against recompute, others do not.
inline cost::NodeTimes offload_times(const graph::BlockGraph& block) {
  cost::NodeTimes times;
  times.flops_per_second = 1.0;
  times.host_bytes_per_second = 2.0 * static_cast<double>(block.saved_bytes()) / block.forward_flops();
  return times;
}

/// The prefetch tests' planner of `shape`'s block: copies at an eighth of offload_times'
/// rate, which the compute waits for, and two keep-sets
/// (Plan with kAllHost bytes of host budget.)
inline Planner waiting_copies_planner(const ModelConfig& cfg, const cost::StepShape& shape, const Layout& layout = {}) {
  const graph::BlockGraph block = graph::block_graph(cfg, shape.batch, shape.seq, shape.dtype);
  cost::NodeTimes times = offload_times(block);
  times.host_bytes_per_second /= 8;
  PlannerOptions opts;
  opts.candidates = {{}, {Slot::attn_probs, Slot::attn_dropout}};
  return Planner(cfg, shape, layout, times, opts);
}

/// All the host memory a test asks.
constexpr int64_t kAllHost = int64_t{1} << 40;

/// Per layer, the input kept or offloaded and each droppable slot kept, recomputed or
/// offloaded, at random (LayerPlan::offloaded); `text` gets each layer's choice.
inline ActivationPlan random_fates(std::mt19937& rng, int64_t layers, std::string& text) {
  ActivationPlan plan;
  plan.policy = "random";
  for (int64_t l = 0; l < layers; ++l) {
    LayerPlan lp;
    if (rng() % 2) lp.offloaded.add(Slot::input);
    for (const Slot s : SlotMask::droppable().slots()) {
      const auto fate = rng() % 3;
      if (fate == 1) lp.dropped.add(s);
      if (fate == 2) lp.offloaded.add(s);
    }
    lp.prefetch = rng() % 2 == 0;
    text += fmt::format("[drop {} offload {}{}] ", fmt::join(lp.dropped.names(), ","),
                        fmt::join(lp.offloaded.names(), ","), lp.prefetch ? " prefetch" : "");
    plan.layers.push_back(lp);
  }
  return plan;
}

/// One random step: the model, its plan, and how it runs.
struct RandomStep {
  ModelConfig cfg;
  ActivationPlan plan;
  int64_t stages = 1;
  int64_t microbatches = 1;
  pipeline::Schedule schedule = pipeline::Schedule::one_f_one_b;
  bool early_stop = true;
  std::string text;
};

/// A step of either preset with at least two layers a stage (so that uniform:2 chunks fit
/// in one), math or tiled attention, dropout 0 or 0.1, 1 to 4 microbatches, either pipeline
/// schedule, and a policy's plan or random fates per slot (random_fates).
inline RandomStep random_step(std::mt19937& rng, int64_t stages) {
  static const char* const kPolicies[] = {"none",
                                          "full",
                                          "every:2",
                                          "uniform:2",
                                          "block:1",
                                          "modules:[qkv]",
                                          "ops:[matmul/2,softmax]",
                                          "modules:[core_attn]"};
  RandomStep r;
  r.stages = stages;
  r.cfg = plan_config(rng() % 2 ? "gpt2-demo" : "llama-demo", std::max<int64_t>(4, 2 * stages), rng() % 2 ? 0.1 : 0.0);
  r.cfg.attention = rng() % 2 ? Attention::tiled : Attention::math;
  r.cfg.attention_tile = 20;  // three query tiles, the last one short
  r.microbatches = 1 + static_cast<int64_t>(rng() % 4);
  r.schedule = rng() % 2 ? pipeline::Schedule::gpipe : pipeline::Schedule::one_f_one_b;
  r.early_stop = rng() % 4 != 0;
  if (rng() % 3 == 0) {
    r.plan = random_fates(rng, r.cfg.n_layer, r.text);
  } else {
    AcConfig ac;
    r.text = kPolicies[rng() % std::size(kPolicies)];
    ac.policy.emplace(r.text);
    ac.stages = stages;
    r.plan = compile_policy(ac, r.cfg.n_layer, r.cfg.dropout);
  }
  r.text = fmt::format("{} {} p={}, {} microbatches, {} stages, {}, early_stop={}: {}",
                       r.cfg.arch == Arch::gpt2 ? "gpt2" : "llama", attention_name(r.cfg.attention), r.cfg.dropout,
                       r.microbatches, r.stages, pipeline::schedule_name(r.schedule), r.early_stop, r.text);
  return r;
}

}  // namespace remat::testing
