// What a step holds outside its blocks' activations (parameters, gradients, AdamW's
// moments, the batch) and what its update allocates: for the step walk and step_constants.
#pragma once

#include "plan/block_sim.h"

#include <vector>

namespace remat::cost {

/// Every parameter on one tensor-parallel rank of `layout`'s stage, in the model's order
/// (embedding, layers, loss head), from the declared graphs: a tied head parameter counted
/// once where the stage holds the embedding too, and as the last stage's own copy where it
/// does not.
std::vector<graph::Param> stage_params(const ModelConfig& cfg, const Layout& layout);

/// The elements of `p`.
int64_t numel(const graph::Param& p);
/// Elements of all of `params`.
int64_t numel(const std::vector<graph::Param>& params);

/// The dtype of the master weights, gradients and moments of a run computing in `compute`.
at::ScalarType master_dtype(at::ScalarType compute);

/// What the optimizer of `layout`'s data-parallel ranks holds: the elements whose
/// moments (and, with sharded gradients, gradients) the busiest rank (the one keeping
/// the most bytes between updates) keeps, and the rank whose update peaks highest (its
/// moments and kept gradients, plus the two temporaries of its largest parameter where
/// AdamW is not fused), with the parameters it updates in AdamW's order (its group of
/// matrices, then the rest). With Layout::dp_rank, that rank's alone, as the busiest.
/// One rank: every parameter. `params` are the stage's (stage_params); with sharded
/// gradients, a pipeline stage's table tied to another stage's keeps its whole gradient
/// on every rank (Model::shard_gradients).
struct OptimizerShare {
  int64_t moments = 0;          ///< elements, for each of the two moments, of the busiest rank
  int rank = 0;                 ///< the rank whose update peaks highest (the lowest of equals)
  int64_t rank_moments = 0;     ///< elements, for each moment, of that rank
  int64_t grads = 0;            ///< gradient elements the busiest rank keeps (sharded)
  int64_t rank_grads = 0;       ///< gradient elements that rank keeps (sharded)
  std::vector<size_t> updated;  ///< that rank's parameters, by index into the stage's
  bool own_grads = false;       ///< the rank keeps the gradients of `updated` (and a tied
                                ///< table's) alone (sharded)
};
OptimizerShare optimizer_share(const ModelConfig& cfg, const std::vector<graph::Param>& params, const Layout& layout);

/// The copies a rank keeps of each element of its share (OptimizerShare::moments): AdamW's
/// two moments where `moments` (made by the first update), and the masters under ZeRO-3.
int64_t share_copies(const Layout& layout, bool moments = true);

/// With sharded gradients (Layout::grads_sharded), the bytes of the buffers a backward
/// writes a part's gradients into before their sum over the ranks (Model::shard_gradients):
/// one layer's, and the embedding's with the loss head's, held from the head's backward to
/// the embedding's, or over the backward of the one a pipeline stage holds. Zeros otherwise.
struct GradientBuffers {
  int64_t layer = 0;
  int64_t ends = 0;
  bool ends_over_layers = false;  ///< the ends' buffer is held over the layers' backward too
  /// What a layer's backward holds of them.
  int64_t in_layer_backward() const { return layer + (ends_over_layers ? ends : 0); }
};
GradientBuffers gradient_buffers(const ModelConfig& cfg, const Layout& layout, at::ScalarType master);

/// With sharded values (Layout::values_sharded), the bytes of the buffer one part's
/// weights are gathered into, in the compute dtype, for its forward, its backward and a
/// uniform chunk's recompute (Model::shard_values): a layer's, the embedding's and the loss
/// head's (a tied table in both). Zeros otherwise.
struct GatheredWeights {
  int64_t layer = 0;
  int64_t embed = 0;
  int64_t head = 0;
};
GatheredWeights gathered_weights(const ModelConfig& cfg, const Layout& layout, at::ScalarType compute);

/// The fused AdamW kernel's step count, a float32 scalar a rank holds beside its moments
/// when it `updates` any parameter; 0 where AdamW is not fused (util::kFusedAdamW).
int64_t step_count_bytes(bool updates);

/// The update of `share`'s rank on `live`, as the trainer runs it: every gradient it keeps
/// squared for the norm (one at a time, the sums kept until the total; with sharded
/// gradients one zero stands for the others' sums), then per updated parameter
/// AdamW's denominator, a square root and its quotient, live at once (none where AdamW is
/// fused, util::kFusedAdamW). Where `moments` is given and empty (a first update), each
/// updated parameter's two moments are made into it first, as AdamW makes them, and the
/// fused kernel's step count after them.
void simulate_update(Live& live, const std::vector<graph::Param>& params, const OptimizerShare& share,
                     at::ScalarType master, std::vector<SimTensor>* moments);

}  // namespace remat::cost
