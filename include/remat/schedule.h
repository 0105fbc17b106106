// A training step as one list of actions: the order in which a stage runs its parts for
// every microbatch, then the optimizer. The engine executes these actions (the model its
// microbatch's forward and backward, the step and pipeline executors the microbatches'
// order) and the cost model simulates the very same list, so uniform chunks, sharded
// inputs and microbatches in flight are facts written here once.
#pragma once

#include "remat/pipeline.h"
#include "remat/plan.h"

#include <cstdint>
#include <vector>

namespace remat::schedule {

/// What one action does.
enum class Kind {
  embed_forward,   ///< the embedding's forward (the first stage only)
  forward,         ///< layer `layer`'s forward, keeping what its plan keeps
  head_forward,    ///< the final norm and the loss (the last stage only)
  head_backward,   ///< their backward, from the loss
  recompute,       ///< a uniform chunk's forward again, layers [layer, last], keeping all
  fetch,           ///< layer `layer`'s offloaded memory starts coming back (ActivationPlan::prefetches)
  backward,        ///< layer `layer`'s backward (its dropped slots recomputed within it)
  embed_backward,  ///< the embedding's backward
  optimizer,       ///< after every microbatch: the gradient reductions and the update
};

/// One action of one microbatch (the optimizer's belongs to none: microbatch -1).
struct Action {
  Kind kind = Kind::forward;
  int64_t microbatch = -1;
  int64_t layer = -1;  ///< forward, backward: the layer; recompute: the chunk's first
  int64_t last = -1;   ///< recompute: the chunk's last layer
  /// head_forward: its gathered weights (ZeRO-3) stay for the head_backward that follows it
  /// at once (pipeline::backward_follows), which gathers none.
  bool weights_kept = false;
  bool operator==(const Action& o) const {
    return kind == o.kind && microbatch == o.microbatch && layer == o.layer && last == o.last &&
           weights_kept == o.weights_kept;
  }
};

/// The part of the model a stage runs: layers [first, end) and the ends it holds.
struct Stage {
  int64_t first = 0;
  int64_t end = 0;
  bool embedding = true;
  bool head = true;
};

/// Microbatch `m`'s forward through `stage` under `plan` (a LayerPlan per layer of the
/// model): the embedding, each layer from the first, the head, which keeps its gathered
/// weights where `backward_follows` (its backward is the stage's next pass).
std::vector<Action> forward(const ActivationPlan& plan, const Stage& stage, int64_t m, bool backward_follows);

/// Microbatch `m`'s backward: the head, each layer from the top, a uniform chunk's
/// recompute right before its last layer's backward, the embedding. Before the backward of
/// a layer above one that prefetches, the copies back of that layer, then of the one below.
std::vector<Action> backward(const ActivationPlan& plan, const Stage& stage, int64_t m);

/// A whole step of stage `index` (from 0) of `stages`: the microbatches' forwards and
/// backwards in pipeline::actions' order (one stage: each microbatch's forward, then its
/// backward), each expanded as above, then the optimizer.
std::vector<Action> step(const ActivationPlan& plan, const Stage& stage, pipeline::Schedule schedule, int64_t stages,
                         int64_t index, int64_t microbatches);

}  // namespace remat::schedule
