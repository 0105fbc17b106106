// A transformer as data, and the one model that runs any such declaration.
//
// An architecture (src/model/{gpt2,llama}.cpp) declares three graphs (remat/graph.h): the
// embedding (token ids to the first block's input), one block, and the head (final norm
// and loss), plus how its checkpoints name the parameters. TransformerModel runs them
// through the graph's walk (src/graph/walk.h): the embedding and head keep what their
// backward reads, the blocks keep what the activation plan says.
#pragma once

#include "graph/walk.h"
#include "remat/graph.h"
#include "remat/model.h"
#include "remat/ops.h"
#include "remat/schedule.h"
#include "remat/store.h"
#include "remat/trace.h"

#include <map>
#include <optional>
#include <tuple>
#include <unordered_set>

namespace remat::detail {

/// One architecture, declared once.
struct ArchDecl {
  using Graph = graph::BlockGraph (*)(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype);
  Graph embed;  ///< token ids [B, T] to the first block's input
  Graph block;  ///< one block
  /// The final norm and, for chunk > 0, the loss (graph::head_graph). A head parameter
  /// named like an embedding parameter is that parameter (a tied head).
  graph::BlockGraph (*head)(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype, int64_t chunk);
  /// Checkpoint name of a block parameter: prefix, layer index, ".", its name in the block.
  const char* layer_prefix;
  /// Whether a parameter is stored transposed ([in, out]) in Hugging Face files.
  bool (*hf_transposed)(const std::string& name);
  /// Names a checkpoint may carry that are not parameters (buffers, tied copies).
  bool (*ignorable)(const ModelConfig& cfg, const std::string& name);
  /// Which nodes tensor parallelism splits.
  graph::TensorParallelPlan tp_plan;
};

const ArchDecl& gpt2_decl();
const ArchDecl& llama_decl();
const ArchDecl& arch_decl(Arch arch);

/// Whether `s` ends with `suffix`.
inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// Bytes held by the distinct storages among `ts` not yet in `seen` (views share).
int64_t distinct_storage_bytes(const std::vector<at::Tensor>& ts, std::unordered_set<const void*>& seen);

/// Initial value of a parameter from its name: biases 0, norm weights 1, residual
/// output projections N(0, std / sqrt(2 layers)), other matrices N(0, std).
void init_param(const std::string& name, at::Tensor& t, const ModelConfig& cfg, at::Generator& gen);

/// The context a recompute draws its dropout masks from: the forward's own, or (RNG
/// preservation off) a different one, as frameworks that do not preserve RNG state do.
StepContext recompute_context(const StepContext& ctx, const ActivationStore& st);

/// Returns the recompute pool's idle buffers to the system when it goes out of scope, if
/// `active`. Declared before a microbatch's saved tensors, it runs after they are freed,
/// also when a recompute throws (a failed determinism check), so no buffer stays pooled.
struct PoolDrain {
  bool active;
  ~PoolDrain() {
    if (active) memory::release_pool();
  }
};

/// A graph at one shape with its lifetimes (cached per shape by the model).
struct GraphShape {
  graph::BlockGraph graph;
  graph::Lifetimes lifetimes;
  explicit GraphShape(graph::BlockGraph g) : graph(std::move(g)), lifetimes(graph) {}
};

/// Every parameter tensor of a model (a stage's: StageSpan), in checkpoint order, and which
/// of them each graph reads: one index per graph parameter (a tied head reads an embedding
/// parameter's index). The same layout holds the values, the gradients and, in bfloat16
/// runs, the compute copies.
struct Weights {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  std::vector<graph::Shard> shards;
  std::vector<bool> partial;             ///< graph::Param::partial
  std::vector<bool> vocab;               ///< Param::vocab
  std::vector<bool> tied;                ///< Param::tied
  std::vector<int> embed, head;          ///< empty where the stage does not hold the part
  std::vector<std::vector<int>> layers;  ///< the stage's layers, from its first
  /// The tensors of one graph's parameters, in the graph's order (handles: in-place
  /// accumulation into them reaches these tensors).
  std::vector<at::Tensor> of(const std::vector<int>& idx) const;
};

/// The engine's backend of the graph walk: runs the ops' kernels with one graph's
/// parameters, accumulating into their gradients, and reports to the store.
struct Engine {
  using Tensor = at::Tensor;
  const graph::BlockGraph& g;
  std::vector<at::Tensor> weights;
  std::vector<at::Tensor> grads;    ///< empty in a forward
  graph::RunContext ctx;            ///< the forward's keys
  graph::RunContext recompute_ctx;  ///< a recompute's (the same unless RNG preservation is off)
  ActivationStore* store;           ///< null outside the planned blocks
  int64_t layer;

  std::vector<at::Tensor> forward(int i, const std::vector<at::Tensor>& in, bool recompute);
  std::vector<at::Tensor> backward(int i, const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out);
  at::Tensor add(const at::Tensor& a, const at::Tensor& b) { return a + b; }
  void dropped(int v, const at::Tensor& t);
  void refilled(Slot s, const std::vector<at::Tensor>& ts) {
    if (store != nullptr) store->refilled(ctx.microbatch, layer, s, ts);
  }
  template <class F>
  void recompute(F&& f) {
    if (store == nullptr) return f();
    store->recompute([&] {
      const trace::Recompute r(layer);
      f();
    });
  }
  bool early_stop() const { return store == nullptr || store->options().early_stop; }
  at::Tensor shard(const at::Tensor& whole);
  at::Tensor gather(const at::Tensor& share);
  memory::HostPool::Moved offload(const std::vector<at::Tensor>& group);
  memory::HostPool::Moved fetch(const std::vector<at::Tensor>& group);
  void await(uint64_t ticket);
};

using Run = graph::BlockRun<Engine>;

class TransformerModel;

/// A microbatch between TransformerModel::forward and ::backward: the walks' runs of the
/// parts the model holds (null: not held; a layer's also once its backward ran).
struct TransformerMicrobatch final : Microbatch {
  const TransformerModel* model;  ///< whose forward made it
  StepContext ctx;
  const GraphShape* embed_shape = nullptr;
  std::vector<const GraphShape*> block_shapes;  ///< the stage's layers', from its first
  const GraphShape* head_shape = nullptr;
  std::unique_ptr<Run> embed;
  std::vector<std::unique_ptr<Run>> layers;  ///< the stage's layers, from its first
  std::unique_ptr<Run> head;
  /// Sharded values: the gathered weights of the stage's layers whose plan keeps them from
  /// their forward to their backward (LayerPlan::weights_kept), from its first; undefined
  /// where the backward gathers them again.
  std::vector<at::Tensor> weights;
  /// Sharded values: the loss head's, where its backward follows its forward at once
  /// (schedule::Action::weights_kept); else undefined.
  at::Tensor head_weights;
  bool consumed = false;  ///< its backward ran (or began and failed)

  TransformerMicrobatch(const TransformerModel* m, const StepContext& c) : model(m), ctx(c) {}
};

class TransformerModel final : public Model {
 public:
  TransformerModel(const ArchDecl& decl, const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype,
                   uint64_t seed, dist::Group* tp, bool sequence_parallel, StageSpan stage);

  std::unique_ptr<Microbatch> forward(at::Tensor input, const at::Tensor& targets, const StepContext& ctx,
                                      int64_t ce_chunk, ActivationBytes* measured) override;
  at::Tensor backward(Microbatch& mb, at::Tensor dy, double loss_scale) override;
  double evaluate(const at::Tensor& input, const at::Tensor& targets, int64_t ce_chunk, at::Tensor* output) override;
  at::Tensor last_logits(const at::Tensor& tokens) override;
  void cast_compute_copies() override;
  double forward_flops(int64_t seq) const override;
  void set_activation_plan(const ActivationPlan& plan, const StoreOptions& options) override;
  ActivationStore* store() override { return store_.get(); }
  ActivationBytes predict_activation_bytes(int64_t B, int64_t T) const override;
  void shard_gradients(const std::vector<bool>& owned, dist::Group& group) override;
  void shard_values(const std::vector<bool>& owned, dist::Group& group) override;

 protected:
  bool hf_transposed(const std::string& name) const override { return decl_.hf_transposed(name); }
  bool ignorable(const std::string& name) const override {
    return decl_.ignorable(cfg_, name) || other_stages_.count(name) > 0;
  }

 private:
  enum class Part { embed, block, head };

  // Sharded values (shard_values): the weights of `params` (the model's list of a part's,
  // which outlives it) gathered into gathered_, in the compute dtype, for as long as it
  // lives; nothing otherwise. `part` (layer `l`), `pass` and the training microbatch `ctx`
  // (null: outside training) name the gather in a failure. `kept`, for a part that keeps
  // its weights to its backward: empty, the gather is left in it as well; holding a
  // forward's gather, that is taken from it instead of gathering again.
  class Gathered {
   public:
    Gathered(TransformerModel& m, const std::vector<int>& params, Part part, int64_t l, const char* pass,
             const StepContext* ctx = nullptr, at::Tensor* kept = nullptr);
    ~Gathered();
    Gathered(const Gathered&) = delete;
    Gathered& operator=(const Gathered&) = delete;

   private:
    TransformerModel& m_;
    const std::vector<int>& params_;
    at::Tensor words_;  // the gathered bytes, as 64-bit words
  };

  // The microbatch's [B, T] from a forward's input (token ids on the first stage, an
  // activation elsewhere: with `sharded` under sequence parallelism this rank's share of
  // the positions, as training passes them; evaluation passes them whole), checked with the
  // targets on the last stage.
  std::pair<int64_t, int64_t> check_input(const at::Tensor& input, const at::Tensor& targets,
                                          bool sharded = true) const;
  // Refuses what needs every layer (evaluation, generation) on a pipeline stage.
  void check_whole(const char* what) const;
  // The stage's end layer (one past its last).
  int64_t end_layer() const { return stage_.first + stage_.count; }
  // A part's graph at [B, T] (the head's also per chunk) as this rank runs it; `sp`: with
  // the sequence parallelism a training step runs (Model::sequence_parallel); the block's
  // as layer l runs it (its attention op: LayerPlan::attention), -1: with the model's op.
  graph::BlockGraph graph_of(Part p, int64_t B, int64_t T, int64_t chunk = 0, bool sp = false, int64_t l = -1) const;
  // The same, built once per shape.
  const GraphShape& shaped(Part p, int64_t B, int64_t T, int64_t chunk = 0, bool sp = false, int64_t l = -1);
  // The attention op layer l runs: the plan's choice for it, else the model's.
  Attention attention(int64_t l) const;
  // Per slot, whether layer l's forward keeps it.
  std::vector<bool> keeps(int64_t l) const;
  // How layer l holds its kept input (LayerPlan::input_sharded).
  graph::InputHold hold(int64_t l) const;
  // The backend for one graph: the weights `W` (the compute copies) at `params`, layer l's
  // (or the embedding's, l = 0, or the head's), with their gradients for a `backward`, put
  // into them as it says; nullopt: a forward.
  Engine engine(const GraphShape& s, const Weights& W, const std::vector<int>& params,
                std::optional<ops::GradInto> backward, int64_t l, const StepContext& ctx, ActivationStore* store,
                bool train = true);
  // uniform:N (schedule::Kind::recompute): the forward of the chunk [first, last] again,
  // from its first layer's kept input, keeping everything, as one recompute. `shapes` and
  // `runs`: the stage's, from its first layer.
  void recompute_chunk(int64_t first, int64_t last, const StepContext& ctx,
                       const std::vector<const GraphShape*>& shapes, std::vector<std::unique_ptr<Run>>& runs);
  // The activation plan the model runs (plan_).
  const ActivationPlan& plan() const { return plan_; }
  // The part of the model this stage runs, as the step schedule names it.
  schedule::Stage parts() const { return {stage_.first, end_layer(), first_stage(), last_stage()}; }
  // The stage's last block's output [B, T, C] from its input (token ids on the first
  // stage) without dropout; nothing is kept for a backward.
  at::Tensor blocks_output(const at::Tensor& input);
  // The weights the ops compute with: the float32 masters themselves, or copies in the
  // compute dtype refreshed whenever the masters changed (once per optimizer step); with
  // sharded values, the parts' gathered ones (Gathered), undefined outside their parts.
  const Weights& compute_weights();
  // Layer l's backward of `mb` from its output's gradient `dx`: its gradients put `into`
  // theirs (sharded, summed over the ranks and the kept ones copied when `first`, else
  // added), and the gradient of its input returned.
  at::Tensor layer_backward(TransformerMicrobatch& mb, int64_t l, at::Tensor dx, ops::GradInto into, bool first);
  // Tells the gradients_ready_ hook that the backward of the part holding `part` is done.
  void part_ready(const std::vector<int>& part) const;
  // Model::added_only_: the embedding's parameters the head does not write first.
  void find_added_only();
  // Sharded gradients (shard_gradients): points the engine's gradients of `params` into one
  // new flat buffer, zeroing those the ops add into, and returns it.
  at::Tensor open_part_grads(const std::vector<int>& params);
  // Sums `flat` over the gradients' group, puts the kept gradients of `params` into
  // Param::grad (copied when `first`, else added) and lets go of the buffer. `part` and
  // `ctx` name the sum in a failure.
  void close_part_grads(const std::vector<int>& params, at::Tensor flat, bool first, const std::string& part,
                        const StepContext& ctx);
  // Refuses a later stage's output gradient `dy` that is missing or not `mb`'s output's shape.
  void check_output_gradient(const TransformerMicrobatch& mb, const at::Tensor& dy) const;
  // The index of the head's first own parameter: the parts below it hold those before.
  size_t head_own_params() const;

  const ArchDecl& decl_;
  std::optional<ops::RopeTables> rope_;  ///< rotation tables, when the block rotates
  std::map<std::tuple<Part, int64_t, int64_t, int64_t, bool, Attention>, std::unique_ptr<GraphShape>> parts_;
  std::unique_ptr<ActivationStore> store_;  ///< null: every slot kept
  /// The set plan, a LayerPlan per layer of the model; before one is set, every slot kept
  /// and each layer running the model's attention op.
  ActivationPlan plan_;
  /// The whole model's parameters another pipeline stage holds (a checkpoint carries them).
  std::unordered_set<std::string> other_stages_;
  Weights weights_;
  Weights grads_;
  Weights cast_;
  Weights gathered_;           ///< sharded values: the weights of the parts being gathered
  at::Tensor cast_buffer_;     ///< the flat buffer cast_ views; undefined until the first cast
  int head_weight_ = -1;       ///< the weight the loss's logits read (generation's logits too); -1: no head
  int64_t cast_version_ = -1;  ///< value_buffer_'s version when last cast
  /// Sharded gradients: the embedding's and the head's parameters (a tied table once), one
  /// buffer from the head's backward to the embedding's; on a pipeline stage that holds
  /// one of them, over its backward.
  std::vector<int> ends_;
};

}  // namespace remat::detail
