// model.loss_head = auto: the loss head a run takes, chosen by planning it with both heads
// (README "Loss head"), the attention op resolved per head as attention_choice.h does.
// Every command resolves the choice here, before it builds a model.
#pragma once

#include "train/attention_choice.h"

#include <string>

namespace remat {

/// plan_run_attention of `local` (the rank share of `cfg`). Under model.loss_head = auto,
/// plans the run with each head and sets both configs' model.loss_head (and
/// model.attention, as chosen with that head) to the head chosen:
///  - without ac.budget: fused (the head without the extra [tokens x d_model x vocab]
///    product; the recompute head saves bytes only a budget has use for);
///  - with ac.budget, the only head whose plans fit it; where both fit, the lower predicted
///    step time when the profiles are measured, else (one stage) the fewer FLOPs of recompute
///    plus the recompute head's extra product, else fused. A fractional budget is of the
///    fused head's no-recompute peak for both. Where neither fits, throws
///    std::invalid_argument with the fused head's sentence and the recompute head's minimum.
/// The plan's text then begins with a line naming the head and why. Every rank calls this
/// alike, with profiles alike (rank 0's times), and so chooses alike.
RunPlan plan_run_auto(Config& cfg, Config& local, at::ScalarType dtype, const ProfileOf& profile_of,
                      int64_t resident, int64_t stage = 0, const SavedPlan* saved = nullptr);

/// The lines naming what `auto` chose and why; each empty where the config named it.
struct AutoChoices {
  std::string loss_head;  ///< "loss head: fused (model.loss_head = auto): ..."
  std::string attention;  ///< "attention: math (model.attention = auto): ..."
  /// The non-empty lines, one per line (no trailing newline).
  std::string text() const;
};

/// `remat plan`'s choices: resolves `cfg`'s model.loss_head = auto and model.attention = auto
/// as plan_run_auto does for `budget` (as the user wrote it; empty: none), pricing time in
/// FLOPs, with `resident` bytes (the token corpus) live throughout.
AutoChoices resolve_planned_auto(Config& cfg, at::ScalarType dtype, const std::string& budget, int64_t resident);

}  // namespace remat
