// A run resolved once: `remat train`, `remat bench` and `remat plan` turn a config, the
// launch, the corpus and a source of time profiles into one RunSpec here, and print it with
// one renderer, so that `remat plan` shows what `remat train` runs.
#pragma once

#include "remat/config.h"
#include "remat/data.h"
#include "remat/layout.h"
#include "run/auto.h"
#include "run/planning.h"
#include "run/price_source.h"

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <optional>
#include <string>

namespace remat {

/// What a run is resolved against besides its config.
struct RunInputs {
  at::ScalarType dtype = at::kFloat;
  int64_t stage = 0;  ///< this rank's pipeline stage
  /// The prepared corpus the run trains on: its tokenizer sets the vocabulary and its
  /// tokens (both splits) stay in memory through every step. nullopt: not prepared (remat
  /// plan), then the vocabulary is data.vocab_size's and the tokens are not counted.
  std::optional<data::CorpusInfo> corpus;
  std::string corpus_dir;  ///< where the corpus is or would be prepared (corpus_dir(data))
  /// Where the prices of a rank share with every auto named come from (required); the run
  /// asks for the host copies' rate where its policy offloads or its budget plan may.
  PriceSource* prices = nullptr;
  const SavedPlan* saved = nullptr;  ///< a resumed run's plan, run again as it is
  /// Bytes this rank may still allocate on its device (its share of what the machine has
  /// free), which the run's statics and its plan's peak must fit (on the CPU with room left
  /// for the heap's own bytes); -1: unchecked (remat plan prices runs for other machines).
  int64_t memory_available = -1;
  /// Bytes of host memory this rank has free (its share of the machine's): what a
  /// fractional or default ac.host_budget is of; -1: this machine's MemAvailable (remat plan).
  int64_t host_available = -1;
};

/// A run, resolved: what every command that runs or prices it works from.
struct RunSpec {
  Config cfg;     ///< every auto decided, model.vocab_size set
  Config local;   ///< this rank's share of it (rank_share)
  Layout layout;  ///< this rank's (layout_of), its split the plan's
  at::ScalarType dtype = at::kFloat;
  cost::StepShape shape;  ///< one microbatch of this rank, as the cost model prices it
  std::optional<data::CorpusInfo> corpus;
  std::string corpus_dir;
  RunPlan plan;  ///< the activation plan, its prediction and the auto choices
};

/// `cfg` (as loaded) with its vocabulary set, from `corpus`'s tokenizer (padded; a given
/// size is checked against it) or, without one, data.vocab_size's, and validated.
Config resolve_config(const Config& cfg, const std::optional<data::CorpusInfo>& corpus);

/// Resolves `cfg` (as loaded: vocabulary perhaps 0, autos unresolved) against `in`:
/// vocabulary, validation, ac.host_budget in bytes (written into the config as bytes, as
/// the run records it), the rank share and layout, the plan with both autos resolved. Throws std::invalid_argument sentences
/// (BudgetTooSmall where no plan fits ac.budget), also where the run would not fit
/// `in.memory_available`: its parameters, gradients and moments checked before any time
/// profile allocates a model, its plan's peak after; and where its offloaded slots would
/// not fit `in.host_available`.
RunSpec resolve_run(const Config& cfg, const RunInputs& in);

/// The run as text: three lines on the run, the choices `auto` made, the plan (layers
/// planned alike grouped, what they keep by module, wrapped within 100 columns), and the
/// predicted step. `remat plan` prints it, `remat train` before its first step; plan.txt
/// holds it and then plan_listing's.
std::string render_text(const RunSpec& spec);

/// Every layer's plan spelled out (every slot kept and dropped, its kept bytes and
/// recompute FLOPs): plan.txt's second part.
std::string plan_listing(const RunSpec& spec);

/// The run as JSON: model, shape, ranks, choices, budget, every layer's plan with its
/// bytes and FLOPs, the predicted breakdown and times (pipeline: per stage).
nlohmann::json render_json(const RunSpec& spec);

/// The plan's lines of render_text for `cfg` alone (no run line): its choices, the layer
/// table and the predicted step.
std::string plan_text(const Config& cfg, const RunPlan& plan);

}  // namespace remat
