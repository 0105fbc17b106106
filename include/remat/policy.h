// Recompute policies: the `[ac]` configuration and its compilation to one ActivationPlan.
//
// A policy is given either as one canonical string (`ac.policy`) or through the spellings
// of other training frameworks (torchtune, Megatron-LM, ColossalAI, nanotron), which are
// accepted as aliases and mapped one-to-one to a canonical policy. compile_policy()
// resolves every spelling, checks that they agree, validates the result against the model
// and returns the plan; nothing runs before it has succeeded.
//
// Grammar of `ac.policy` (whitespace is ignored):
//
//   policy    := recompute ('+' offload)?
//   recompute := term | select '+' selective
//   term      := 'none' | 'full' | 'every:' K | 'uniform:' N | 'block:' N | 'ratio:' R
//              | selective | 'layers:[' entry (',' entry)* ']'
//   select    := 'every:' K | 'block:' N | 'ratio:' R        (layer-selecting policies)
//   selective := 'modules:[' module (',' module)* ']' | 'ops:[' op (',' op)* ']'
//   entry     := 'full' | 'none' | 'modules:' module | selective
//   module    := core_attn | qkv | norm | attn | act | mlp   (see block_modules())
//   op        := matmul | matmul/2 | attention | softmax | dropout | norm | act | add
//   offload   := 'offload' ('(' select ')')? ':[' name (',' name)* ']'
//   name      := input | a slot of block_slots() | module
//
//   none          every layer keeps every slot
//   full          every layer drops every slot (the block input stays)
//   every:K       layers K, 2K, 3K, ... (counted from 1) are full; 1 <= K <= layers
//   uniform:N     consecutive chunks of N layers within each pipeline stage; every layer
//                 of a chunk drops every slot, the chunk's first layer keeps its input
//                 (chunk_begin -1, like full) and the others have chunk_begin = that
//                 layer: the chunk is recomputed from its input (the stage's last chunk
//                 may be shorter; uniform:1 is the same plan as full)
//   block:N       the first N layers of each pipeline stage are full
//   ratio:R       the first ceil(R x layers of the stage) layers of each stage are full;
//                 0 <= R <= 1
//   modules:[..]  every layer drops the union of those submodules' slots
//   ops:[..]      every layer KEEPS the outputs of the listed op kinds and drops every other
//                 slot. `matmul/2` keeps the matmul outputs only in the odd layers (1, 3,
//                 5, ... counted from 1) and drops them in the even ones: decided by the
//                 layer's position alone, so the same model always gets the same plan.
//   layers:[..]   one entry per layer, in order; the count must equal the layer count
//   X+Y           the layers X selects are full, every other layer follows Y
//   P+offload:[..]    every layer moves the named slots P keeps (a module: its slots) to
//                     host memory between its forward and its backward
//   P+offload(S):[..] only the layers S selects do (offload(block:2): the first two of
//                     each stage, TransformerEngine's num_layers = 2)
//
// Canonical spelling (ActivationPlan::policy): no whitespace, module and op lists in the
// order of the tables above without duplicates, single modules in brackets
// (`layers:[modules:[core_attn],full]`), R printed shortest (`ratio:0.5`). A framework
// spelling that cannot be written as one of the uniform policies (per-stage checkpoint
// counts that differ, uneven stage sizes) compiles to its explicit `layers:[...]` form.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "remat/plan.h"

namespace remat {

/// `[ac]`: the recompute policy. Every alias field is unset unless given; a set alias must
/// agree with `policy` and with every other set alias (they must compile to the same plan).
struct AcConfig {
  /// Canonical policy string (grammar above). Unset: "none", unless another spelling
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
  /// it), the share the compute loses (a run measures its own): 0.17, an H200's matmuls'.
  double offload_slowdown = 0.17;
  int64_t stages = 1;  ///< pipeline stages the layers are split across
};

/// Resolves the aliases to one canonical policy, validates it for a model of `n_layers`
/// blocks with dropout probability `dropout` and returns its plan (plan.policy is the
/// canonical spelling). Throws std::invalid_argument with a sentence that says what was
/// given, why it cannot work and what would.
ActivationPlan compile_policy(const AcConfig& ac, int64_t n_layers, double dropout);

/// The layers of each pipeline stage the ac settings give: ac.num_layers_per_stage, else
/// ac.stages parts as even as they go, the first stages taking one more
/// (pipeline::even_split). Throws std::invalid_argument with a sentence on a bad split.
std::vector<int64_t> stage_sizes(const AcConfig& ac, int64_t n_layers);

/// Compiles a canonical policy string alone (no aliases, default options, one stage).
ActivationPlan compile_policy(const std::string& policy, int64_t n_layers, double dropout = 0.0);

/// A readable table of the plan: the canonical policy line, then one row per run of
/// identical consecutive layers with the slots kept and dropped and chunk membership.
std::string explain_plan(const ActivationPlan& plan);

/// Plans are equal when every layer drops the same slots with the same chunk structure
/// and holds its input the same way (the policy spelling is not compared).
bool same_layers(const ActivationPlan& a, const ActivationPlan& b);

}  // namespace remat
