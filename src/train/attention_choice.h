// model.attention = auto: the attention op a run takes, chosen by planning it with both
// (README "Attention"). Every command resolves the choice here, before it builds a model.
#pragma once

#include "remat/config.h"
#include "train/planning.h"
#include "train/profile.h"

#include <functional>
#include <string>

namespace remat {

/// The time profile of a run's rank share `local`, whose model.attention is math or tiled:
/// measured or read from the cache under ac.profile (each op has its own), else the matmul
/// rate alone. Called at most once per op.
using ProfileOf = std::function<TimeProfile(const Config& local)>;

/// plan_run of `local` (the rank share of `cfg`) with profile_of(local)'s times. Under
/// model.attention = auto, plans the run with math and with tiled and sets both configs'
/// model.attention to the op chosen:
///  - with ac.budget, the only op whose plans fit it; where both fit, the one with the lower
///    predicted step time when the profiles are measured (ties: math), else math (measured
///    faster on this CPU); a fractional budget is of math's no-recompute peak for both.
///    Where neither fits, throws BudgetTooSmall with the sentence of the op with the lower
///    minimum budget, saying both were tried.
///  - without, the lower predicted step time under ac.profile, else math (tiled is not planned).
///  - per layer: with ac.budget and both profiles measured, also plans with the op chosen
///    above and, in any layer, the other (cost::OtherAttention, its pass difference from the
///    two profiles), and takes that plan, whose layers each name their op, where it mixes
///    the ops and is predicted faster.
/// The plan's text then begins with a line naming the op and why ("attention: tiled
/// (model.attention = auto): math's least-memory plan peaks at 812 MiB, over the 300 MiB
/// budget"). Every rank of a job calls this alike, with profiles alike (rank 0's times).
/// A `saved` plan (a resumed run's) is for a named op (its config.toml names the op auto
/// chose) and is predicted as it is (plan_run), with the other op's times where its layers
/// run both. `reference` (bytes; 0: math's no-recompute peak) is what a fractional budget
/// is a fraction of (the loss head's choice holds both heads to one).
RunPlan plan_run_attention(Config& cfg, Config& local, at::ScalarType dtype, const ProfileOf& profile_of,
                           int64_t resident, int64_t stage = 0, const SavedPlan* saved = nullptr,
                           int64_t reference = 0);

}  // namespace remat
