// GPT-2 and Llama models composed of the explicit ops.
//
// A model owns its parameters (float32 master copies, named as in Hugging Face
// checkpoints) and their gradient accumulators. forward() runs one microbatch through the
// ops' forward, keeping each op's Saved struct in a Microbatch; backward() runs the ops'
// backward in reverse from it, accumulating parameter gradients; forward_backward() is the
// one followed by the other. LibTorch autograd is not involved.
//
// A model is the whole transformer or one pipeline stage of it (StageSpan): a stage holds
// its layers' parameters and passes activations [B, T, C] forward and their gradients back
// through the same two calls, several microbatches in flight at once (1F1B).
#pragma once

#include "remat/config.h"
#include "remat/layout.h"
#include "remat/graph.h"
#include "remat/plan.h"
#include "remat/store.h"

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat {

/// One named parameter.
struct Param {
  std::string name;  ///< Hugging Face name, e.g. "h.0.attn.c_attn.weight"
  at::Tensor value;  ///< master copy (float32; float64 in float64 models), on the model's device
  at::Tensor grad;   ///< accumulator of the same shape and dtype; started afresh by zero_grad()
  bool decay;        ///< whether weight decay applies (matrices, not norms or biases)
  /// How the tensor-parallel group splits it (value and grad alike); not split: every rank
  /// of the group holds it whole, with equal gradients (once the partial ones are summed).
  graph::Shard shard;
  /// Sequence parallelism: each rank's gradient is its positions' part (graph::Param::partial);
  /// sum_partial_grads() makes it the whole one.
  bool partial = false;
  /// Its rows (dimension 0) are the vocabulary's, padding rows included: the token
  /// embedding and the output head (whose tensor-parallel split is a vocabulary split).
  bool vocab = false;
  /// Another pipeline stage holds a copy of it: GPT-2's token embedding, which the first
  /// stage's embedding and the last stage's tied loss head both read (Megatron keeps such a
  /// copy too). Each stage's gradient is its own part; the executor sums the two (between
  /// the first and the last stage) before the optimizer step, so both copies stay equal. A
  /// model of every layer has no copy: its embedding and head share one tensor, not tied.
  bool tied = false;
};

/// The layers a model holds: all of them (the default), or one pipeline stage's
/// consecutive range. A stage holds the parameters of layers [first, first + count), the
/// embedding's only when first == 0 and the head's (final norm and loss) only when the
/// range ends at the last layer, each with the value the whole model has for the same
/// seed and under the whole model's name ("h.5.attn.c_attn.weight" for layer 5 in any
/// stage). Layer indices stay global (dropout keys, activation plans, trace slices), so a
/// stage draws the whole model's dropout masks; ActivationBytes::blocks lists its layers.
struct StageSpan {
  int64_t first = 0;   ///< the stage's first layer, counted from 0
  int64_t count = -1;  ///< its number of layers; -1: every layer from `first` on
};

/// Identifies one microbatch's randomness (dropout keys derive from it) and its place in
/// the step.
struct StepContext {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t microbatch = 0;
  int64_t first_row = 0;  ///< global batch row of the microbatch's first row (a data-parallel
                          ///< rank's shard), so its dropout draws the single-process elements
  /// Its backward is the model's next pass after its forward (pipeline::backward_follows;
  /// forward_backward sets it): sharded values keep the loss head's gathered weights from
  /// its forward for its backward.
  bool backward_follows = false;
};

/// Saved-activation bytes of one microbatch, measured on the live Saved structs; of a
/// pipeline stage, its own parts (0 for an embedding or head it does not hold).
struct ActivationBytes {
  int64_t embedding = 0;
  std::vector<int64_t> blocks;  ///< per layer the model holds, from its first
  int64_t head = 0;             ///< final norm and loss head
  int64_t total() const;
};

/// One microbatch between its forward and its backward (Model::forward, Model::backward):
/// what the forward kept for the backward, opaque, and the forward's output. It holds
/// that memory until its backward runs (once) or it is destroyed. It must not outlive its
/// model.
class Microbatch {
 public:
  virtual ~Microbatch() = default;
  Microbatch(const Microbatch&) = delete;
  Microbatch& operator=(const Microbatch&) = delete;

  /// The last layer's output [B, T, C] (sequence parallel: this rank's [B, T / tp, C]) in
  /// the compute dtype, the next stage's input; undefined on the last stage.
  at::Tensor output;
  /// The mean loss on the last stage (what forward_backward returns); 0 elsewhere.
  double loss = 0;

 protected:
  Microbatch() = default;
};

class Model {
 public:
  /// Builds and initialises a model (deterministic for a seed). `compute_dtype` is the
  /// dtype of activations: float32, or bfloat16 where the device supports it, with
  /// float32 master weights, gradients and optimizer state; or float64 throughout (for
  /// gradient checks). vocab_size must be set.
  ///
  /// With a tensor-parallel group `tp` of more than one rank, the model is this rank's
  /// share (Megatron's tensor parallelism, graph::tensor_parallel): split parameters hold
  /// the rank's part of the very values one process initialises for the seed, and every
  /// forward runs the group's collectives, so every rank of the group must make the same
  /// calls. The group must outlive the model.
  ///
  /// `layout` says which share: layout.tp must be the group's size (one rank without a
  /// group); with layout.sp (a group of more than one rank), forward_backward() runs with
  /// Megatron's sequence parallelism (graph::tensor_parallel's `sp`; the sequence length a
  /// multiple of the group's size), while evaluation and generation run without it; the
  /// model holds the layers of layout.stage (StageSpan) of layout.split (even when empty),
  /// at least one.
  static std::unique_ptr<Model> create(const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype,
                                       uint64_t seed, const Layout& layout = {}, dist::Group* tp = nullptr);
  virtual ~Model() = default;

  const ModelConfig& config() const { return cfg_; }
  /// The tensor-parallel group (null: one rank) and its size.
  dist::Group* tensor_group() const { return tp_; }
  int64_t tp_size() const;
  bool sequence_parallel() const { return sp_; }
  /// The layers the model holds, `count` resolved (>= 1).
  const StageSpan& stage() const { return stage_; }
  /// Whether it holds the embedding (the first stage) and the head (the last stage); a
  /// model of every layer holds both.
  bool first_stage() const { return stage_.first == 0; }
  bool last_stage() const { return stage_.first + stage_.count == cfg_.n_layer; }
  /// Parameter i whole, from `part` (its value, or a tensor of its value's shape such as
  /// an optimizer moment): gathered over the tensor-parallel group when the parameter is
  /// split (every rank of the group must call it), else `part` itself.
  at::Tensor whole(size_t i, const at::Tensor& part) const;
  /// This rank's part of `full`, a tensor of parameter i's whole shape.
  at::Tensor part(size_t i, const at::Tensor& full) const;
  /// Parameter i's sizes on one rank.
  std::vector<int64_t> whole_sizes(size_t i) const;
  at::Device device() const { return device_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  /// The one flat buffer every parameter's gradient is a view of, in params() order, so
  /// that a collective reduces all gradients in place, without copying them into buckets
  /// (with sharded gradients: every kept one's, shard_gradients).
  const at::Tensor& grad_buffer() const { return grad_buffer_; }
  /// The one flat buffer every parameter's master (Param::value) is a view of, in params()
  /// order, so that one collective moves them all (ZeRO's exchange after the update).
  const at::Tensor& value_buffer() const { return value_buffer_; }
  /// Parameters of the model (split ones counted whole, once; a stage's own, its tied
  /// copy included).
  int64_t num_params() const;
  /// Starts the gradients afresh: the next backward writes each gradient whose ops write it
  /// whole (graph::OpDef::writes_grads) instead of adding to it, so only those the ops add
  /// into by rows (an embedding's) are zeroed here.
  void zero_grad();
  /// Sums the partial gradients (Param::partial) over the tensor-parallel group, in one
  /// collective; once per step, after the last microbatch's backward. Nothing to do
  /// without sequence parallelism, nor with sharded gradients (shard_gradients sums them
  /// per part). `what` names the collective in a failure.
  void sum_partial_grads(const std::string& what);
  /// Called in backward() each time a part's gradients of the microbatch are all in, with
  /// the index into params() from which on every parameter's are: after the loss head's
  /// backward, after each layer's, and 0 after the embedding's. A caller may reduce those
  /// gradients while the rest of the backward runs (data parallelism overlapping its
  /// all-reduce with the last microbatch's backward). Empty: nothing is called.
  void set_gradients_ready(std::function<void(size_t first)> hook) { gradients_ready_ = std::move(hook); }
  /// ZeRO stage 2: from now on this rank keeps the gradients of the parameters `owned`
  /// marks (one per params()) and no others: theirs in one flat buffer (grad_buffer()),
  /// Param::grad undefined for the rest. Each backward then writes each part's gradients
  /// (every layer's; the embedding's with the loss head's, from the head's backward to the
  /// embedding's) into a flat buffer of their own, sums it over `group` once the part's
  /// backward is done, puts the owned ones into their gradients (copied by the first
  /// backward since zero_grad(), added by the next) and frees it. With sequence
  /// parallelism the part's partial gradients are summed over the tensor-parallel group
  /// just before, in place. On a pipeline stage, a table tied to another stage's
  /// (Param::tied) keeps its whole gradient on every rank, added up over the microbatches
  /// and not summed here: the trainer sums it between the stages, then over `group`, as
  /// without sharding. `group` must outlive the model.
  virtual void shard_gradients(const std::vector<bool>& owned, dist::Group& group) = 0;
  /// Whether shard_gradients() was called.
  bool grads_sharded() const { return grad_group_ != nullptr; }
  /// ZeRO stage 3, after shard_gradients(): from now on this rank keeps the masters of the
  /// parameters `owned` marks and no others: theirs in one flat buffer (value_buffer()),
  /// Param::value of the rest a tensor of its shape on the meta device, which holds no
  /// values. Each part (a layer; the embedding; the loss head) then gathers its weights in
  /// the compute dtype over `group` just before its forward, and again before its
  /// backward (and a uniform chunk's recompute), and frees them after: an all-reduce of
  /// the part's bytes as 64-bit integers, to which every rank but a weight's owner gives
  /// zeros, so the weights computed with are those without sharding to the bit. Every rank of `group` must then run the same
  /// forwards, backwards and evaluations. `group` must outlive the model.
  virtual void shard_values(const std::vector<bool>& owned, dist::Group& group) = 0;
  /// Whether shard_values() was called.
  bool values_sharded() const { return value_group_ != nullptr; }
  /// Parameter i's master on every rank: Param::value itself, or with sharded values
  /// gathered from its owner (every rank of the group must call it), on the device.
  at::Tensor whole_value(size_t i) const;

  /// One microbatch on a model of every layer: tokens and targets [B, T] int64 (targets
  /// -1 are ignored). Accumulates d(loss * loss_scale)/d(params) into the gradients and
  /// returns the mean loss. `measured`, when given, receives the bytes the Saved structs
  /// held. It is forward() followed by backward().
  double forward_backward(const at::Tensor& tokens, const at::Tensor& targets, const StepContext& ctx,
                          double loss_scale, int64_t ce_chunk, ActivationBytes* measured = nullptr);

  /// The forward of one microbatch through the layers the model holds, keeping what the
  /// activation plan says for its backward. `input`: token ids [B, T] int64 on the first
  /// stage, else the previous stage's Microbatch::output; moved in, a layer that drops or
  /// offloads it frees it. `targets` [B, T] int64 (-1 ignored): read on the last stage
  /// only (elsewhere they may be undefined). `ctx` keys the dropout masks, as in
  /// forward_backward; microbatches in flight at once on a model must differ in
  /// ctx.microbatch (the store's determinism check tells them apart by it).
  /// `ce_chunk`: the loss head's chunk (positions per chunk), read on the last stage.
  /// `measured`, when given, receives the bytes this forward's Saved structs hold. Any
  /// number of microbatches may be in flight; each holds its memory until its backward.
  virtual std::unique_ptr<Microbatch> forward(at::Tensor input, const at::Tensor& targets, const StepContext& ctx,
                                              int64_t ce_chunk, ActivationBytes* measured = nullptr) = 0;
  /// The backward of a microbatch this model's forward made, once, in any order among the
  /// microbatches in flight: adds into the parameters' gradients (the first since
  /// zero_grad() writes those its ops write whole) and returns the
  /// gradient of the forward's input (the previous stage's `dy`; undefined on the first
  /// stage). On the last stage it starts from d(loss * loss_scale)/d(loss) and `dy` is
  /// ignored; elsewhere `dy` is the gradient of Microbatch::output from the next stage
  /// (which already carries the loss scale) and `loss_scale` is ignored. What the
  /// microbatch kept is freed as the backward consumes it, `dy` too once the top layer's
  /// backward is done with it when the caller moves it in (a copy the caller keeps would
  /// stay through the lower layers' backwards, above what the cost model counts).
  virtual at::Tensor backward(Microbatch& mb, at::Tensor dy, double loss_scale) = 0;

  /// The forward without dropout, keeping nothing for a backward. `input` as in forward
  /// (token ids on the first stage, else the previous stage's `output`); `targets` read on
  /// the last stage only. Returns the mean loss on the last stage; elsewhere 0, and the
  /// stage's output goes to `output` (which must then be given).
  virtual double evaluate(const at::Tensor& input, const at::Tensor& targets, int64_t ce_chunk,
                          at::Tensor* output = nullptr) = 0;
  /// Logits of the last position of each sequence, [B, V] float32. A model of every layer only.
  virtual at::Tensor last_logits(const at::Tensor& tokens) = 0;
  /// Casts the masters into their copies in the compute dtype now, as the first forward
  /// after an update does, in one pass; nothing where the model computes in the masters'
  /// dtype. The profile times the step's part around the passes by it.
  virtual void cast_compute_copies() = 0;

  /// Applies an activation plan (one LayerPlan per layer of the whole model, a stage
  /// too: it runs its layers' plans) to the following forwards; a plan that keeps every
  /// slot of the model's layers removes the store. A stage refuses a plan whose uniform
  /// chunk starts in an earlier stage (compile the policy with the stage split).
  virtual void set_activation_plan(const ActivationPlan& plan, const StoreOptions& options) = 0;
  /// The store executing the plan (its counters), or null when every slot is kept.
  virtual ActivationStore* store() = 0;

  /// Saved-activation bytes one [B, T] microbatch keeps under the current plan, predicted
  /// from the ops' byte reports without allocating; equals what forward measures.
  virtual ActivationBytes predict_activation_bytes(int64_t B, int64_t T) const = 0;

  /// Forward FLOPs of one sequence of `seq` tokens through the model's parts (a stage's
  /// own), from the ops' own counts.
  virtual double forward_flops(int64_t seq) const = 0;

  /// Every parameter, whole, named and laid out as in Hugging Face files, on the CPU
  /// (split ones gathered: every rank of the tensor-parallel group must call it; with
  /// sharded values every rank of their group too, whole_value). With
  /// `vocab_rows` > 0 the vocabulary parameters (Param::vocab) keep only their first
  /// `vocab_rows` rows: the padding rows (model.vocab_multiple) dropped, so the file has the
  /// shapes a Hugging Face model of the tokenizer's vocabulary expects.
  std::vector<std::pair<std::string, at::Tensor>> whole_params(int64_t vocab_rows = 0) const;
  /// Writes whole_params() to a .safetensors file.
  void save(const std::string& path, const std::map<std::string, std::string>& metadata = {}) const;
  /// Loads every parameter from a .safetensors file (ours or a Hugging Face checkpoint of
  /// the same shape), or from the files a model.safetensors.index.json names (a model saved
  /// in shards; `path` ends in .index.json). Each rank takes its part of the split ones; a
  /// stage takes its own parameters from a checkpoint of the whole model. The vocabulary
  /// parameters (Param::vocab) may have fewer rows in the file, all of them the same number
  /// (an unpadded checkpoint in a padded model): the rows above are set to the mean of the
  /// file's rows, so that each padding row's logit is the mean of the real ones and, by
  /// Jensen's inequality, the padding rows together take at most (padding rows) /
  /// (file rows) of the softmax (HF's resize_token_embeddings initialises new rows so
  /// too). All names, shapes and dtypes are checked before any parameter is written: on
  /// error (naming the tensor) the model is unchanged. With sharded values each rank
  /// writes the masters it keeps.
  void load(const std::string& path);

 protected:
  Model(const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype, dist::Group* tp, bool sp,
        StageSpan stage)
      : cfg_(cfg), device_(device), compute_dtype_(compute_dtype), tp_(tp), sp_(sp), stage_(stage) {}
  /// Whether `name` is stored transposed ([in, out]) in Hugging Face files (GPT-2's Conv1D).
  virtual bool hf_transposed(const std::string& name) const = 0;
  /// Names a checkpoint may carry that are not this model's parameters (buffers, tied
  /// copies, another pipeline stage's).
  virtual bool ignorable(const std::string& name) const = 0;

  ModelConfig cfg_;
  at::Device device_;
  at::ScalarType compute_dtype_;
  dist::Group* tp_;
  bool sp_;
  StageSpan stage_;
  std::vector<Param> params_;
  at::Tensor value_buffer_;
  at::Tensor grad_buffer_;
  std::vector<int> added_only_;  ///< the parameters whose gradients zero_grad() zeroes
  bool fresh_grads_ = false;     ///< zero_grad() ran, and no backward since
  /// shard_gradients(): the parameters whose gradients this rank keeps (its own and the
  /// tied ones), and the group the parts' gradients are summed over (null: every gradient
  /// kept, none summed here).
  std::vector<bool> kept_grads_;
  dist::Group* grad_group_ = nullptr;
  /// shard_values(): the parameters whose masters this rank keeps, and the group the parts'
  /// weights are gathered over (null: every master kept).
  std::vector<bool> kept_values_;
  dist::Group* value_group_ = nullptr;
  std::function<void(size_t)> gradients_ready_;
};

}  // namespace remat
