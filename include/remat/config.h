// Typed configuration: every setting is a field of a struct, filled from defaults, a
// preset, a TOML file and `key=value` overrides, in that order (later wins).
//
// Keys are dotted `section.field` names (`train.lr`, `model.n_layer`). One table
// (config_keys()) declares every key once, with the range a number key accepts; TOML
// parsing, overrides, the range checks, the resolved-config dump, `remat train
// --help-config` and "did you mean" suggestions all read it, so they cannot drift apart.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "remat/attention.h"
#include "remat/layout.h"

namespace remat {

/// The block architectures: gpt2 (pre-LN, learned positions, GELU MLP, dropout) and llama
/// (RMSNorm, RoPE, grouped-query attention, SwiGLU); either head may be tied.
enum class Arch { gpt2, llama };
/// "gpt2" / "llama", as configs spell it.
const char* arch_name(Arch a);

/// How the loss head gets the gradient of its [tokens x vocab] logits, a chunk at a time
/// (remat/ops/cross_entropy.h): `fused` computes it in the forward, as soon as a chunk's
/// logits exist, and keeps the gradients of the hidden states and of the output weight;
/// `recompute` keeps the hidden states and one log-sum-exp per token and recomputes the
/// logits in the backward (one more [tokens x d_model x vocab] product, vocab x d_model
/// fewer bytes kept). `automatic` ("auto") leaves the choice to the planner
/// (src/run/auto.h): the fused head unless a budget is better served by the other.
enum class LossHead { fused, recompute, automatic };
/// "fused" / "recompute" / "auto", as configs spell it.
const char* loss_head_name(LossHead h);

/// The library that carries the ranks' collectives (parallel.backend): NCCL moves CUDA
/// tensors between GPUs, one rank per GPU; Gloo moves CPU tensors, and CUDA tensors
/// through the host, so that several ranks may share one GPU. `automatic` ("auto") takes
/// NCCL for ranks on distinct GPUs where the build has it, Gloo otherwise (dist::choose_backend).
enum class CommBackend { automatic, nccl, gloo };
/// "auto" / "nccl" / "gloo", as configs spell it.
const char* comm_backend_name(CommBackend b);

/// Megatron-FSDP's data_parallel_sharding_strategy: what the data-parallel ranks shard,
/// ZeRO stages 0 to 3 in order.
enum class ShardingStrategy { no_shard, optim, optim_grads, optim_grads_params };
/// "no_shard" / "optim" / "optim_grads" / "optim_grads_params", as configs spell it.
const char* sharding_strategy_name(ShardingStrategy s);

/// Under ZeRO-3, whether a layer's weights are freed after its forward and gathered again
/// for its backward (parallel.reshard_after_forward, torchtitan's fsdp_reshard_after_forward):
/// `automatic` ("auto", torchtitan's "default") lets a budget plan choose per layer and
/// gathers again under a named policy; `always` gathers every layer's again; `never` keeps
/// them (LayerPlan::weights_kept), but in a uniform chunk.
enum class Reshard { automatic, always, never };
/// "auto" / "always" / "never", as configs spell it.
const char* reshard_name(Reshard r);

/// RoPE's frequencies stretched for a longer context, as Llama 3.1 and 3.2 were trained
/// (transformers' rope_type "llama3"): wavelengths longer than original_max_seq /
/// low_freq_factor are stretched by `factor`, those shorter than original_max_seq /
/// high_freq_factor kept, those between blended linearly in original_max_seq / wavelength.
struct RopeScaling {
  double factor = 1.0;  ///< 1: RoPE unscaled, the other fields unused
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_seq = 8192;  ///< the context the model was first trained at

  bool scaled() const { return factor != 1.0; }
};

/// Transformer shape.
struct ModelConfig {
  std::string preset = "gpt2-demo";  ///< the preset the other fields started from
  Arch arch = Arch::gpt2;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_kv_head = 4;  ///< key/value heads (llama GQA); equals n_head for gpt2
  int64_t d_model = 128;
  int64_t d_ff = 512;          ///< MLP hidden width
  int64_t vocab_size = 0;      ///< rows of the embedding and the loss head; 0: the prepared
                               ///< corpus's tokenizer's. Padded (padded_vocab_size) wherever it
                               ///< is resolved, so it may exceed the tokenizer's
  int64_t vocab_multiple = 1;  ///< the vocabulary is padded to a multiple of this times
                               ///< parallel.tp (Megatron's make_vocab_size_divisible_by); 1:
                               ///< only as far as the tensor-parallel split needs
  int64_t max_seq = 256;       ///< context length (learned positions / RoPE tables)
  Attention attention = Attention::math;
  int64_t attention_tile = 64;  ///< tiled attention: query and key positions per tile
                                ///< (ops::AttentionTiles' default; docs/attention.md)
  LossHead loss_head = LossHead::fused;
  double dropout = 0.1;  ///< gpt2: embedding, attention-probability and residual dropout;
                         ///< llama: attention-probability dropout only
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;    ///< llama
  bool tie_embeddings = true;  ///< the head's matrix is the embedding's (GPT-2, Llama 3.2 1B
                               ///< and 3B); false: a head of its own (lm_head.weight)
  double init_std = 0.02;
  /// Weights to start from instead of fresh ones: a .safetensors file, or a Hugging Face
  /// model's folder (its config.json gives the shape, as a preset would; its tokenizer
  /// becomes data.tokenizer's default); empty: fresh weights.
  std::string init;

  int64_t head_dim() const { return d_model / n_head; }
};

struct TrainConfig {
  int64_t steps = 600;
  int64_t batch = 16;         ///< sequences per microbatch, over all data-parallel ranks
  int64_t seq = 128;          ///< tokens per sequence
  int64_t grad_accum = 1;     ///< microbatches per optimizer step
  double lr = 3e-3;           ///< peak learning rate
  double min_lr = 3e-4;       ///< cosine floor
  int64_t warmup = 50;        ///< linear warmup steps
  double weight_decay = 0.1;  ///< on matrices only (not norms, biases)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;          ///< global L2 norm; 0 disables
  int64_t eval_every = 100;        ///< steps between validation passes; 0: only at the end
  int64_t eval_batches = 8;        ///< validation microbatches per pass
  int64_t ce_chunk = 1024;         ///< tokens per chunk of the loss head
  int64_t checkpoint_every = 200;  ///< steps between training checkpoints (about a minute of
                                   ///< the default run); one is also written at the end and on
                                   ///< SIGINT or SIGTERM
  int64_t keep_checkpoints = 2;    ///< the newest checkpoints kept; older ones are removed
};

/// What data.text holds: `text`, UTF-8 text files (several: one document each); `jsonl`,
/// one JSON object per line, its data.field a document; `tokens`, token ids already
/// encoded (llm.c's or nanoGPT's .bin shards, Megatron's indexed dataset).
enum class DataFormat { text, jsonl, tokens };
/// "text" / "jsonl" / "tokens", as configs spell it.
const char* data_format_name(DataFormat f);

struct DataConfig {
  /// The file to train on, or a glob of files (read in name order); empty: the King James
  /// Bible.
  std::string text;
  DataFormat format = DataFormat::text;
  /// jsonl: the field holding each document's text.
  std::string field = "text";
  std::string dir = "data";   ///< where prepared corpora are cached
  int64_t vocab_size = 2048;  ///< SentencePiece BPE vocabulary trained when no tokenizer is given
  /// A tokenizer to use instead of training one: a Hugging Face tokenizer.json, a
  /// SentencePiece .model, or a model's folder holding one; empty: train one.
  std::string tokenizer;
  double val_fraction = 0.05;
};

struct RunConfig {
  std::string out_dir = "runs";  ///< run directories are created under it
  std::string name;              ///< run directory name; empty: timestamp + preset
  int64_t threads = 0;           ///< intra-op threads; 0: all cores
  int64_t seed = 1337;
  c10::Device device{c10::kCPU};  ///< cpu or cuda[:N] (device_of), typed where it is read
  std::string dtype = "float32";  ///< activation/compute dtype: float32 or bfloat16
  int64_t sample_tokens = 120;    ///< tokens generated at the end of training
  std::string prompt = "And God said";
  bool progress = true;  ///< progress bar on a terminal
  std::string trace;     ///< Chrome-trace JSON of step 3 (or the last) goes here; empty: none
  /// CUDA: the caching allocator grows one segment per stream instead of rounding each new
  /// segment up (PyTorch's expandable_segments), which reserves less beside the same tensors.
  bool expandable_segments = false;
  /// Every allocation and free of the run's device up to the end of its second step, with
  /// the allocator's allocated and reserved bytes after each, goes here as an allocation
  /// trace (remat/caching_allocator.h); empty: none.
  std::string record_allocations;
};

/// run.dtype's "float32" / "bfloat16" -> dtype, wherever it runs (remat plan prices
/// either); a sentence otherwise.
at::ScalarType dtype_of(const std::string& name);

/// run.device's "cpu", "cuda" or "cuda:N" -> the device (whether it exists here is checked
/// where a run starts: util/device.h); a sentence otherwise.
c10::Device device_of(const std::string& name);

/// Several processes (ranks) training one model; see include/remat/dist.h.
struct ParallelConfig {
  int64_t dp = 0;        ///< data-parallel ranks; 0: every rank the launcher started (over tp)
  int64_t tp = 1;        ///< tensor-parallel ranks sharing each layer (Megatron); must divide
                         ///< the heads, KV heads and d_ff (the vocabulary is padded to it)
  bool sp = false;       ///< sequence parallelism over the tp ranks (Megatron): norms, dropout
                         ///< and residuals on a rank's share of the positions
  double timeout = 300;  ///< seconds the rendezvous or any collective may take before every
                         ///< rank stops with a sentence naming the lost rank
  int64_t zero = 0;      ///< 1: ZeRO stage 1, each data-parallel rank keeps AdamW's moments of
                         ///< its share of the parameters only (TrainStep); 2: their gradients
                         ///< too; 3: their master weights too; 0: every rank keeps them all.
                         ///< With one data-parallel rank none changes anything.
  int64_t pp = 1;        ///< pipeline stages (remat/pipeline.h): the layers split by
                         ///< ac.num_layers_per_stage, else by the planner under ac.budget, else
                         ///< evenly; sets ac.stages, so per-stage policies count real stages
  /// The order each stage runs its microbatches (train.grad_accum) in.
  pipeline::Schedule schedule = pipeline::Schedule::one_f_one_b;
  /// What `remat plan`, which runs no ranks, prices a collective at: the rate in GB/s
  /// (10^9 bytes per second) each rank sends at in a ring all-gather of a large tensor (the
  /// "bus bandwidth" nccl-tests' all_gather_perf prints), and the rate in TFLOP/s one
  /// rank's matmuls reach, which turns those seconds into the plan's FLOPs, and the
  /// microseconds each ring step of a collective waits on the link whatever its size
  /// (graph::LinkTraffic's messages). A run measures the rate and the latency on its own
  /// ranks instead (docs/planning.md). The latency's default, 2 us, lies
  /// within what NCCL's own tuning model (src/graph/tuning.cc, hwLat) charges a ring step
  /// over NVLink: about 0.6 us with its protocol for small messages, 3.4 us for large ones.
  double link_rate = 100;
  double compute_rate = 400;
  double link_latency = 2;
  /// The same two for the data-parallel group's links, which its gradient sums, ZeRO's
  /// parameter exchange and stage 3's weight gathers cross: often a network between hosts
  /// where the tensor-parallel group is within one (cost::DataParallelTraffic).
  double dp_link_rate = 100;
  double dp_link_latency = 2;
  CommBackend backend = CommBackend::automatic;
  bool overlap_grad_reduce = false;  ///< all-reduce data-parallel gradients during the last
                                     ///< backward (Megatron's --overlap-grad-reduce); off by
                                     ///< default: on few cores Gloo's threads take the
                                     ///< backward's (docs/results.md)
  /// Megatron-LM's spellings of parallel.zero, unset unless given (resolve_zero_stage):
  /// true asks stage 1 or above, false stage 0.
  std::optional<bool> use_distributed_optimizer;
  /// The stage by Megatron-FSDP's name for it.
  std::optional<ShardingStrategy> data_parallel_sharding_strategy;
  /// ZeRO-3: which layers gather their weights again for their backward (Reshard).
  Reshard reshard_after_forward = Reshard::automatic;
  /// The same by torchtitan's name, unset unless given (resolve_reshard).
  std::optional<Reshard> fsdp_reshard_after_forward;
};

/// `[ac]`: the recompute policy (compiled by remat/policy.h's compile_policy). Every alias
/// field is unset unless given; a set alias must agree with `policy` and with every other
/// set alias (they must compile to the same plan).
struct AcConfig {
  /// Canonical policy string (the grammar in remat/policy.h). Unset: "none", unless another spelling
  /// below chooses; set, even to "none", it is a choice the other spellings must agree with.
  std::optional<std::string> policy;

  // torchtune
  std::optional<bool> enable_activation_checkpointing;  ///< true alone: full
  std::optional<std::string> ac_mode;                   ///< "full" | "selective"
  std::optional<std::string> ac_option;                 ///< selective: K (every:K) or "op" (ops:[matmul,attention])
  std::optional<bool> enable_activation_offloading;     ///< true: every slot the policy keeps waits in host memory

  // Megatron-LM
  std::optional<std::string> recompute_granularity;  ///< "full" | "selective"
  std::optional<std::string> recompute_method;       ///< "uniform" | "block" (full only)
  std::optional<int64_t> recompute_num_layers;       ///< chunk size (uniform) / count (block)
  std::optional<std::string> recompute_modules;      ///< comma list; selective default core_attn
  std::optional<bool> recompute_activations;         ///< true: selective core_attn
  std::optional<bool> distribute_saved_activations;  ///< true: layers that keep only their input shard it over TP
  std::optional<std::string> offload_modules;        ///< comma list: the saved inputs of those modules in host memory
  std::optional<int64_t> cpu_offloading_num_layers;  ///< N: the first N layers of each stage offload every kept slot

  // ColossalAI
  std::optional<double> gradient_checkpointing_ratio;    ///< ratio:R
  std::optional<std::string> num_ckpt_layers_per_stage;  ///< comma list, one per stage
  std::optional<std::string> num_layers_per_stage;       ///< comma list, sums to the layers

  // nanotron
  std::optional<bool> recompute_layer;         ///< true: full; false: none
  std::optional<bool> tp_recompute_allgather;  ///< true: gather the column-parallel inputs again (sp)

  /// A memory budget ("12GiB", "96MiB", or "0.6" of the no-recompute peak): the planner
  /// chooses the plan (remat/planner.h). Empty: the policy above decides.
  std::string budget;
  /// Host memory the budget's plan may fill with offloaded slots: bytes ("64GiB"), a
  /// fraction of the host memory free ("0.5"), or "0" (offload nothing). Empty: on a CUDA
  /// device the rank's share of the host memory free, on the CPU nothing, as its host
  /// memory is the device's. A resolved run's config holds it in bytes.
  std::string host_budget;
  /// Measure a time profile (cached per device and shape) before training, so recompute
  /// and the step time are predicted from measured node times; false: FLOPs only.
  bool profile = true;

  // Options
  bool preserve_rng_state = true;   ///< replay dropout's RNG in recompute
  bool allow_rng_mismatch = false;  ///< permit dropout > 0 with preserve_rng_state = false
  std::string check = "none";       ///< "none" | "meta" | "values": verify recompute
  bool early_stop = true;           ///< stop a recompute once the needed tensors exist
  bool pool = true;                 ///< recompute into recycled buffers (StoreOptions::pool)
  /// Each layer that offloads starts its copies back when the backward of the layer above
  /// begins, not its own (LayerPlan::prefetch), where ActivationPlan::may_prefetch allows. A
  /// budget's plan chooses that per layer itself.
  bool offload_prefetch = false;
  /// GB/s each way between the device and host memory that `remat plan` prices offloaded
  /// slots' copies at (a run measures its own); 25: about a PCIe 4 x16 link, 55 PCIe 5.
  double offload_rate = 25;
  /// Of each second such a copy runs beside the compute (on a device whose copies overlap
  /// it), the share the compute loses (a run measures its own); the default is what an
  /// H200's matmuls lost beside such copies (docs/results.md).
  double offload_slowdown = 0.17;
  int64_t stages = 1;  ///< pipeline stages the layers are split across
};

struct Config {
  ModelConfig model;
  TrainConfig train;
  DataConfig data;
  RunConfig run;
  ParallelConfig parallel;
  AcConfig ac;  ///< recompute policy (compiled by include/remat/policy.h)
};

/// The values a number key accepts, what they count and values that work. validate_config
/// refuses a value outside with one sentence built from these: the key, the range and its
/// unit, the value given, why, and the example.
struct KeyRange {
  std::optional<double> min;  ///< the least value accepted; unset: no lower bound
  std::optional<double> max;  ///< the largest value accepted; unset: no upper bound
  bool above_min = false;     ///< min itself is refused: a value must lie above it
  bool below_max = false;     ///< max itself is refused: a value must lie below it
  std::string unit;           ///< what the number counts ("layers", "GB/s"); empty: a bare number
  std::string why;            ///< a clause on why the bounds lie where they do, or what a bound means
  std::string example;        ///< values that work, as a user would choose them ("0.02", "200 for NVLink 3")
  /// The range in words, with its unit: "from 1 to 1024 layers", "above 0 and at most
  /// 1000000 GB/s", "at least 0".
  std::string text() const;
};

/// One settable key.
struct ConfigKey {
  std::string name;  ///< "section.field"
  std::string help;
  std::function<void(Config&, const std::string&)> set;  ///< parses and stores; throws on bad value
  std::function<std::string(const Config&)> get;         ///< TOML literal of the current value;
                                                         ///< empty: unset (an optional alias key)
  /// A number key's value, which `range` bounds; absent for the other keys.
  std::function<double(const Config&)> number;
  std::optional<KeyRange> range;  ///< the values a number key accepts; unset: any it parses
};

/// The vocabulary a model of `c` is built with for `vocab` tokens: `vocab` rounded up to a
/// multiple of model.vocab_multiple x parallel.tp, as Megatron-LM pads it, so that every
/// tensor-parallel rank holds an equal share of the embedding's and the loss head's rows.
/// The rows added are no token's: the data never holds them and generation never samples
/// them, but the loss's softmax runs over them (as Megatron's does). 0 stays 0 (the
/// tokenizer's, resolved later); a padded size is its own padding. Throws a sentence for
/// a model.vocab_multiple outside its key's range, and where `vocab` > 0 for a parallel.tp
/// outside its key's range or a `vocab` above 2^31.
int64_t padded_vocab_size(const Config& c, int64_t vocab);

/// Sets model.vocab_size for a tokenizer of `tokenizer_vocab` pieces: the tokenizer's,
/// padded, where it is 0 (a given size was padded by load_config); refuses, with a
/// sentence, a given size below the tokenizer's.
void resolve_vocab_size(Config& c, int64_t tokenizer_vocab);

/// Sets parallel.zero from Megatron's spellings of it where one is set
/// (ParallelConfig::use_distributed_optimizer, data_parallel_sharding_strategy); refuses,
/// with a sentence, spellings that ask different stages, or a parallel.zero given
/// (`zero_given`) that differs from theirs.
void resolve_zero_stage(Config& c, bool zero_given);
/// Sets parallel.reshard_after_forward from torchtitan's spelling of it where that is set;
/// refuses, with a sentence, a parallel.reshard_after_forward given (`given`) that differs.
void resolve_reshard(Config& c, bool given);

/// Every key, in documentation order.
const std::vector<ConfigKey>& config_keys();

/// Names of the model presets, smallest first.
std::vector<std::string> preset_names();
/// The model shape of a preset; throws listing the valid names if unknown.
ModelConfig model_preset(const std::string& name);

/// The shape a Hugging Face config.json (GPT-2's or Llama's) at `path` gives a model, over
/// `base` for what it does not say (attention op, loss head); refuses, with a sentence
/// naming the file and the key, a model type or a setting remat's blocks do not have.
ModelConfig hf_model_config(const std::string& path, const ModelConfig& base);
/// The config.json text that loads a model of `m`'s shape, with `vocab_size` rows (the
/// tokenizer's) and its begin and end of text (-1: none), into Hugging Face's transformers.
std::string hf_config_json(const ModelConfig& m, int64_t vocab_size, int bos_id, int eos_id);

/// Builds a Config: defaults, then the TOML file (if non-empty), then `key=value`
/// overrides. `model.preset` is applied before the other model keys wherever it is set,
/// then `model.init`'s config.json where it names a Hugging Face model (hf_model_config).
/// Errors (unknown key with the nearest valid one, bad value, bad TOML) are thrown as
/// std::invalid_argument sentences. A model.vocab_size (given or the preset's) is padded
/// (padded_vocab_size); the result is validated (validate_config).
Config load_config(const std::string& toml_path, const std::vector<std::string>& overrides);

/// Refuses, with a sentence, a number outside its key's range (ConfigKey::range) and
/// settings that contradict each other (heads not dividing d_model, ...). What needs the
/// layers above the configuration, the recompute policy's grammar and the attention ops'
/// limits, is validate_plan's (remat/policy.h), which commands call beside it.
void validate_config(const Config& c);

/// Refuses a path holding a control character (a newline, a tab, an escape), with a
/// sentence naming `what` (a key such as "run.out_dir", or an option such as "--plot"):
/// paths are written into plot scripts, logs and tables, where such a character ends a
/// line, and it is almost always a stray line break in a shared config or a variable.
void check_path(const std::string& what, const std::string& path);

/// The resolved configuration as TOML (every key, with its value; unset alias keys are
/// written as comments, `# key = (unset)`). List keys are written as TOML arrays.
std::string config_to_toml(const Config& c);

}  // namespace remat
