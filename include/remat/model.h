// GPT-2 and Llama models composed of the explicit ops.
//
// A model owns its parameters (float32 master copies, named as in Hugging Face
// checkpoints) and their gradient accumulators. forward_backward() runs one microbatch
// through the ops' forward, keeps each op's Saved struct, and runs the ops' backward in
// reverse, accumulating parameter gradients. LibTorch autograd is not involved.
#pragma once

#include "remat/config.h"
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
  static std::unique_ptr<Model> create(const ModelConfig& cfg, at::Device device,
                                       at::ScalarType compute_dtype, uint64_t seed);
  virtual ~Model() = default;

  const ModelConfig& config() const { return cfg_; }
  at::Device device() const { return device_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  /// The one flat buffer every parameter's gradient is a view of, in params() order, so
  /// that a collective reduces all gradients in place, without copying them into buckets.
  const at::Tensor& grad_buffer() const { return grad_buffer_; }
  int64_t num_params() const;
  void zero_grad();

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

  /// Writes every parameter to a .safetensors file in Hugging Face layout.
  void save(const std::string& path, const std::map<std::string, std::string>& metadata = {}) const;
  /// Loads every parameter from a .safetensors file (ours or a Hugging Face checkpoint of
  /// the same shape). All names, shapes and dtypes are checked before any parameter is
  /// written: on error (naming the tensor) the model is unchanged.
  void load(const std::string& path);

 protected:
  Model(const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype)
      : cfg_(cfg), device_(device), compute_dtype_(compute_dtype) {}
  /// Whether `name` is stored transposed ([in, out]) in Hugging Face files (GPT-2's Conv1D).
  virtual bool hf_transposed(const std::string& name) const = 0;
  /// Names a checkpoint may carry that are not parameters (buffers, tied copies).
  virtual bool ignorable(const std::string& name) const = 0;

  ModelConfig cfg_;
  at::Device device_;
  at::ScalarType compute_dtype_;
  std::vector<Param> params_;
  at::Tensor grad_buffer_;
};

}  // namespace remat
