// Recompute policies: the `[ac]` configuration's (AcConfig, remat/config.h) compilation to
// one ActivationPlan.
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

#include "remat/config.h"
#include "remat/plan.h"

namespace remat {

/// What validate_config cannot check below the policy and the ops, for a config that has
/// passed it: the attention op must run the model on run.device in run.dtype
/// (ops::attention_refusal), c.ac must compile for model.n_layer layers and model.dropout
/// (compile_policy), ac.budget and ac.host_budget must be sizes, and a budget must not come
/// with a policy. Throws std::invalid_argument with the sentence of the first that fails;
/// returns the plan c.ac compiles to. `remat prepare`, `train` and `bench` load their configs
/// through load_run_config, and resolve_config (every run, `remat plan`'s too) calls it, so
/// that a bad config is refused before anything runs.
ActivationPlan validate_plan(const Config& c);

/// A config as `remat prepare`, `train` and `bench` load it: load_config (the keys, their
/// ranges and the rules between them), then validate_plan.
Config load_run_config(const std::string& toml_path, const std::vector<std::string>& overrides);

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
