// GPT-2 and Llama models composed of the explicit ops.
//
// A model owns its parameters (float32 master copies, named as in Hugging Face
// checkpoints) and their gradient accumulators. forward_backward() runs one microbatch
// through the ops' forward, keeps each op's Saved struct, and runs the ops' backward in
// reverse, accumulating parameter gradients. LibTorch autograd is not involved.
#pragma once

#include "remat/config.h"
#include "remat/graph.h"
#include "remat/plan.h"
#include "remat/store.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat {

/// One named parameter.
struct Param {
  std::string name;  ///< Hugging Face name, e.g. "h.0.attn.c_attn.weight"
  at::Tensor value;  ///< master copy (float32; float64 in float64 models), on the model's device
  at::Tensor grad;   ///< accumulator of the same shape and dtype; zeroed by zero_grad()
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
};

/// Identifies one microbatch's randomness; dropout keys derive from it.
struct StepContext {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t microbatch = 0;
  int64_t first_row = 0;  ///< global batch row of the microbatch's first row (a data-parallel
                          ///< rank's shard), so its dropout draws the single-process elements
};

/// Saved-activation bytes of one microbatch, measured on the live Saved structs.
struct ActivationBytes {
  int64_t embedding = 0;
  std::vector<int64_t> blocks;  ///< per layer
  int64_t head = 0;             ///< final norm and loss head
  int64_t total() const;
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
  /// `sequence_parallel` (a group of more than one rank): forward_backward() runs with
  /// Megatron's sequence parallelism (graph::tensor_parallel's `sp`; the sequence length
  /// a multiple of the group's size); evaluation and generation run without it.
  static std::unique_ptr<Model> create(const ModelConfig& cfg, at::Device device,
                                       at::ScalarType compute_dtype, uint64_t seed, dist::Group* tp = nullptr,
                                       bool sequence_parallel = false);
  virtual ~Model() = default;

  const ModelConfig& config() const { return cfg_; }
  /// The tensor-parallel group (null: one rank) and its size.
  dist::Group* tensor_group() const { return tp_; }
  int64_t tp_size() const;
  bool sequence_parallel() const { return sp_; }
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
  /// that a collective reduces all gradients in place, without copying them into buckets.
  const at::Tensor& grad_buffer() const { return grad_buffer_; }
  /// Parameters of the whole model (split ones counted whole, once).
  int64_t num_params() const;
  void zero_grad();
  /// Sums the partial gradients (Param::partial) over the tensor-parallel group, in one
  /// collective; once per step, after the last microbatch's backward. Nothing to do
  /// without sequence parallelism. `what` names the collective in a failure.
  void sum_partial_grads(const std::string& what);

  /// One microbatch: tokens and targets [B, T] int64 (targets -1 are ignored).
  /// Accumulates d(loss * loss_scale)/d(params) into the gradients and returns the
  /// mean loss. `measured`, when given, receives the bytes the Saved structs held.
  virtual double forward_backward(const at::Tensor& tokens, const at::Tensor& targets,
                                  const StepContext& ctx, double loss_scale, int64_t ce_chunk,
                                  ActivationBytes* measured = nullptr) = 0;
  /// Mean loss without dropout; nothing is kept for a backward.
  virtual double evaluate(const at::Tensor& tokens, const at::Tensor& targets, int64_t ce_chunk) = 0;
  /// Logits of the last position of each sequence, [B, V] float32.
  virtual at::Tensor last_logits(const at::Tensor& tokens) = 0;

  /// Applies an activation plan (one LayerPlan per layer) to the following
  /// forward_backward calls; a plan that keeps everything removes the store.
  virtual void set_activation_plan(const ActivationPlan& plan, const StoreOptions& options) = 0;
  /// The store executing the plan (its counters), or null when every slot is kept.
  virtual ActivationStore* store() = 0;

  /// Saved-activation bytes one [B, T] microbatch keeps under the current plan, predicted
  /// from the ops' byte reports without allocating; equals what forward_backward measures.
  virtual ActivationBytes predict_activation_bytes(int64_t B, int64_t T) const = 0;

  /// Forward FLOPs of one sequence of `seq` tokens, from the ops' own counts.
  virtual double forward_flops(int64_t seq) const = 0;

  /// Every parameter, whole, named and laid out as in Hugging Face files, on the CPU
  /// (split ones gathered: every rank of the tensor-parallel group must call it). With
  /// `vocab_rows` > 0 the vocabulary parameters (Param::vocab) keep only their first
  /// `vocab_rows` rows: the padding rows (model.vocab_multiple) dropped, so the file has the
  /// shapes a Hugging Face model of the tokenizer's vocabulary expects.
  std::vector<std::pair<std::string, at::Tensor>> whole_params(int64_t vocab_rows = 0) const;
  /// Writes whole_params() to a .safetensors file.
  void save(const std::string& path, const std::map<std::string, std::string>& metadata = {}) const;
  /// Loads every parameter from a .safetensors file (ours or a Hugging Face checkpoint of
  /// the same shape; each rank takes its part of the split ones). The vocabulary
  /// parameters (Param::vocab) may have fewer rows in the file, all of them the same number
  /// (an unpadded checkpoint in a padded model): the rows above are set to the mean of the
  /// file's rows, so that each padding row's logit is the mean of the real ones and, by
  /// Jensen's inequality, the padding rows together take at most (padding rows) /
  /// (file rows) of the softmax (HF's resize_token_embeddings initialises new rows so
  /// too). All names, shapes and dtypes are checked before any parameter is written: on
  /// error (naming the tensor) the model is unchanged.
  void load(const std::string& path);

 protected:
  Model(const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype, dist::Group* tp, bool sp)
      : cfg_(cfg), device_(device), compute_dtype_(compute_dtype), tp_(tp), sp_(sp) {}
  /// Whether `name` is stored transposed ([in, out]) in Hugging Face files (GPT-2's Conv1D).
  virtual bool hf_transposed(const std::string& name) const = 0;
  /// Names a checkpoint may carry that are not parameters (buffers, tied copies).
  virtual bool ignorable(const std::string& name) const = 0;

  ModelConfig cfg_;
  at::Device device_;
  at::ScalarType compute_dtype_;
  dist::Group* tp_;
  bool sp_;
  std::vector<Param> params_;
  at::Tensor grad_buffer_;
};

}  // namespace remat
