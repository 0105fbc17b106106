// One optimizer step, shared by `remat train` and `remat bench` so that what the bench
// measures is exactly the step training runs.
#pragma once

#include "remat/config.h"
#include "remat/data.h"
#include "remat/dist.h"
#include "remat/model.h"
#include "remat/pipeline.h"
#include "remat/plan.h"
#include "remat/store.h"
#include "model/adamw.h"

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace remat {

/// Applies `plan` to `model` with the store options `ac` asks for (determinism check,
/// early stop, RNG replay).
void apply_plan(Model& model, const ActivationPlan& plan, const AcConfig& ac);

/// What one optimizer step did and what it cost.
struct StepResult {
  double loss = 0;                        ///< mean training loss over the step's microbatches
  double lr = 0;                          ///< learning rate the step used
  double grad_norm = 0;                   ///< global L2 gradient norm before clipping
  double seconds = 0;                     ///< wall time, the device synchronized before and after
  int64_t current_bytes = 0;              ///< tensor bytes held after the step
  int64_t peak_bytes = 0;                 ///< highest tensor bytes held during the step
  int64_t reserved_peak_bytes = 0;        ///< CUDA: the caching allocator's highest reserved bytes (0 on CPU)
  ActivationBytes activations;            ///< saved-activation bytes of the first microbatch, measured
  int64_t host_peak_bytes = 0;            ///< offloaded slots: the most bytes in host memory so far
  int64_t host_pinned_bytes = 0;          ///< of the host pool's buffers, those page-locked for CUDA copies
  StoreCounters counters;                 ///< what the store re-ran during the step (zeros without a store)
  int64_t reduce_buckets = 0;             ///< data parallel: the gradient buckets all-reduced (sharded
                                          ///< gradients: the parts summed, one per part and microbatch)
  int64_t reduce_buckets_overlapped = 0;  ///< of them, those started during the backward
  std::string trace;                      ///< Chrome-trace JSON of the step when it was traced
};

/// The optimizer of one model and its training step. AdamW in two groups: weight decay
/// on matrices only (Param::decay), none on norms and biases.
///
/// ZeRO stage 1 (`zero` = 1 with more than one data-parallel rank): each rank keeps AdamW's
/// moments, and runs the update, for the parameters cost::zero_owners gives it only. The
/// gradients are still all-reduced whole (Gloo in LibTorch 1.13 has no reduce-scatter: the
/// all-reduce stands in for it, and each rank reads its parameters' part), so clipping sees
/// the same global norm; after the update the owners' parameters reach every rank through
/// an exact all-reduce of the one buffer they are views of (Model::value_buffer). Each
/// parameter is updated by the very kernels, on the very tensor, that update it without
/// ZeRO, so the weights are bitwise those of `zero` = 0.
///
/// ZeRO stage 2 (`zero` = 2): each rank also keeps only its parameters' gradients. Each
/// part's gradients are summed over the ranks as the part's backward ends, every
/// microbatch (Model::shard_gradients), and the norm from each rank's own squares. With one
/// microbatch per step the sums are those of `zero` = 0 to the bit wherever the transport
/// adds the ranks' values in the same order (always over two ranks); with several, each
/// microbatch's gradients are summed over the ranks before the microbatches are, and the
/// weights agree with `zero` = 0 to float32 rounding.
///
/// ZeRO stage 3 (`zero` = 3): each rank also keeps only its parameters' masters
/// (Model::shard_values); each part gathers its weights exactly for its forward and its
/// backward, so the weights are those of `zero` = 2 to the bit, and no exchange follows
/// the update.
class TrainStep {
 public:
  /// `model` must outlive this object; its gradient accumulators become the optimizer's
  /// gradients. `seed` keys the dropout of every step (StepContext). With `ranks` (data
  /// parallel; it must outlive this object) `train.batch` is this rank's share of each
  /// microbatch: every rank draws the whole microbatch of batch x ranks sequences, as one
  /// process would, trains on its own consecutive rows of it and sums the gradients.
  /// `zero`: parallel.zero (0 to 3), the optimizer sharded over ranks->data() from 1,
  /// the gradients too from 2, the masters too at 3.
  ///
  /// Pipeline parallel (`model` one stage of several in ranks->pipeline()): each step's
  /// microbatches run through the stages in `schedule`'s order (run_pipeline), the tied
  /// embedding's gradient is summed between its two stages and the gradient norm over
  /// every stage; each stage updates its own parameters.
  ///
  /// `overlap`: the data-parallel all-reduce runs during the last microbatch's backward
  /// (GradientReduction) where it can: not under sequence parallelism, whose partial
  /// gradients are summed over the tensor-parallel group first, nor through pipeline stages.
  TrainStep(Model& model, const TrainConfig& train, uint64_t seed, dist::Comm* ranks = nullptr, int64_t zero = 0,
            pipeline::Schedule schedule = pipeline::Schedule::one_f_one_b, bool overlap = false);

  /// Runs 0-based `step` at learning_rate(train, step): zero_grad, train.grad_accum
  /// microbatches drawn from `data` with `rng` through forward_backward, the gradients
  /// and the loss summed over the ranks (if any), gradient clipping to train.grad_clip,
  /// the AdamW update. The peak is measured from the step's start. `traced`: record the
  /// step as a Chrome trace (StepResult::trace). Throws a sentence naming the step, the
  /// first non-finite parameter or gradient and what to change when the loss or the
  /// gradient norm is not finite (then before the update, so the weights stay as they
  /// were) or when the update made a weight non-finite. Over several ranks every rank
  /// throws, naming the same parameter (and its stage).
  StepResult run(int64_t step, const data::TokenDataset& data, std::mt19937_64& rng, bool traced = false);

  /// Writes the training state after `steps` completed steps to `path` as one safetensors
  /// file, atomically (flushed, then renamed): every parameter, AdamW's moments and step
  /// count, and `rng`'s state, the data cursor. Dropout needs nothing more: its masks are
  /// keyed by the seed and the step.
  /// Split parameters and their moments are gathered whole from the tensor-parallel group
  /// (every rank of it must call this), under ZeRO-1 each moment (under ZeRO-3 each
  /// master too) from the data-parallel rank that keeps it (then every rank must call
  /// this), and under pipeline parallelism
  /// each stage's from the first data-parallel rank of every stage; a rank that does not
  /// `write` only gives its parts. The file is the same with and without ZeRO or stages.
  /// `extra` adds metadata entries of the caller's (the run's plan).
  void save_checkpoint(const std::string& path, int64_t steps, const std::mt19937_64& rng, bool write = true,
                       const std::map<std::string, std::string>& extra = {}) const;
  /// Whether this rank must call save_checkpoint although it does not write: it holds a
  /// part another rank writes (a tensor-parallel part, ZeRO-1's moments, a stage).
  bool gives_to_checkpoint() const;
  /// Restores what save_checkpoint wrote into the model, the optimizer and `rng`, after
  /// checking all of it; returns the number of completed steps. Throws a sentence naming
  /// `path` when the file is not a checkpoint of this model. Under ZeRO-1 each rank takes
  /// the moments of its own parameters from the whole ones in the file, whatever
  /// parallel.zero wrote it.
  int64_t load_checkpoint(const std::string& path, std::mt19937_64& rng);

 private:
  Model& model_;
  TrainConfig train_;
  uint64_t seed_;
  dist::Comm* ranks_;
  /// Per parameter: whether this rank keeps its moments and updates it (all of them
  /// without ZeRO-1).
  std::vector<bool> owned_;
  /// ZeRO over more than one rank: the optimizer is sharded (and, below stage 3, the
  /// updated parameters are exchanged).
  bool sharded_;
  /// ZeRO-2 over more than one rank: the model keeps the owned gradients only, summed in
  /// its backward (Model::shard_gradients).
  bool grads_sharded_;
  /// The pipeline group when the model is one of several stages, else null.
  dist::Group* pipe_;
  pipeline::Schedule schedule_;
  /// The data-parallel all-reduce overlaps the last backward (asked for, and possible).
  bool overlap_;
  /// Where this stage's gradients stand in the whole model's order, for the gradient norm:
  /// the index of its first, and the model's count.
  int64_t norm_first_ = 0, norm_count_ = 0;
  /// Over the parameters this rank updates (owned_), in the model's order.
  AdamW optimizer_;

  /// The first parameter whose values (with `grads`: gradients) are not finite over every
  /// rank, "" when none; with stages, named with the stage and rank that hold it. Every
  /// rank must call it and gets the same answer, so that all of them stop together with
  /// the same sentence (a stage alone would leave the others waiting for its activations).
  /// `when` ("before", "after") and `step` name the check in a failure.
  std::string first_non_finite_of_job(bool grads, int64_t step, const char* when) const;
  /// Where a step with a non-finite loss or gradient norm went wrong first, over every
  /// rank: a weight, else a gradient, else the loss alone.
  std::string where_non_finite(int64_t step) const;
};

/// The training state a checkpoint's metadata records.
struct CheckpointState {
  int64_t steps = 0;       ///< completed steps
  int64_t adam_steps = 0;  ///< AdamW updates (one per step)
  std::mt19937_64 rng;     ///< the data sampler's generator after `steps` steps
};

/// Why the metadata of a file TrainStep::save_checkpoint wrote cannot be a checkpoint's
/// (its format, each count out of range, an unreadable rng state), as a clause ("its
/// 'steps' is ..."); "" when it can, and then `state` (if given) gets its values.
std::string checkpoint_metadata_problem(const std::map<std::string, std::string>& metadata,
                                        CheckpointState* state = nullptr);

/// The name of the first parameter, in model order, whose values (with `grads`: whose
/// gradients) hold a NaN or an infinity; empty when none does. One pass, one host read.
std::string first_non_finite(const Model& model, bool grads = false);

}  // namespace remat
