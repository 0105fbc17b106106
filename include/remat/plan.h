// The activation plan: per layer, which saved-tensor slots are kept through the forward,
// which are dropped and recomputed in that layer's backward, and which of the kept ones
// wait in host memory.
//
// Every recompute policy (none, full, every:K, uniform:N, block:N, ratio:R, modules:[..],
// ops:[..], explicit per-layer lists and the seed frameworks' spellings) compiles to this
// one structure; the engine executes only this.
#pragma once

#include "remat/attention.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace remat {

/// The slots of one transformer block, in forward order. Both architectures use the same
/// names; a slot an architecture or a configuration does not have (GPT-2's residual
/// dropout masks in Llama, any dropout slot when p == 0) simply holds nothing.
///   attn.norm     statistics of the attention-side norm (its input is the block input)
///   attn.qkv_in   the norm's output, input of the q/k/v projections (sequence
///                 parallelism: this rank's positions, kept only to gather again)
///   attn.gathered sequence parallelism: attn.qkv_in gathered over the tensor-parallel
///                 group, what the projections read; dropped alone, it is gathered again
///                 from the kept attn.qkv_in (nanotron's tp_recompute_allgather)
///   attn.qkv      q, k, v as attention reads them (after RoPE in Llama)
///   attn.probs    softmax output (tiled attention: the per-row log-sum-exp)
///   attn.dropout  attention-probability dropout mask and output (math attention only:
///                 tiled attention redraws the mask from its key)
///   attn.proj_in  attention output, input of the output projection (tiled attention's
///                 backward reads it too)
///   attn.resid    residual-branch dropout mask (GPT-2)
///   mlp.norm      the mid-block residual stream and the MLP-side norm's statistics
///   mlp.fc_in     the norm's output, input of c_fc / gate and up projections
///   mlp.gathered  sequence parallelism: mlp.fc_in gathered, as attn.gathered
///   mlp.act_in    the activation's input (c_fc output; gate and up)
///   mlp.proj_in   the activation's output, input of c_proj / down_proj
///   mlp.resid     residual-branch dropout mask (GPT-2)
const std::vector<std::string>& block_slots();

/// Submodule names of `modules:[...]` and the slots each one's recompute drops.
///   core_attn -> attn.probs, attn.dropout           (Megatron's default selective)
///   qkv       -> attn.qkv
///   norm      -> attn.qkv_in, mlp.fc_in  (and the norms' statistics and gathered copies)
///   gathered  -> attn.gathered, mlp.gathered (sequence parallelism: gather them again)
///   attn      -> every attn.* slot
///   act       -> mlp.proj_in
///   mlp       -> every mlp.* slot but mlp.norm
const std::vector<std::pair<std::string, std::vector<std::string>>>& block_modules();

/// Slot identities, as the block graphs name them (compiler-checked), in forward order;
/// `input` is the block input (kept unless a uniform chunk owns it), the others are the
/// droppable slots of block_slots(), in that order.
enum class Slot : int {
  input,
  attn_norm,
  attn_qkv_in,
  attn_gathered,
  attn_qkv,
  attn_probs,
  attn_dropout,
  attn_proj_in,
  attn_resid,
  mlp_norm,
  mlp_fc_in,
  mlp_gathered,
  mlp_act_in,
  mlp_proj_in,
  mlp_resid,
};
constexpr int kSlotCount = static_cast<int>(Slot::mlp_resid) + 1;
/// The slot's name as plans spell it ("attn.norm"; "input" for Slot::input).
const std::string& slot_name(Slot s);
/// The slot a name denotes ("input" too); throws std::invalid_argument naming the slots.
Slot slot_of_name(const std::string& name);

/// A set of slots, a bit each. Plans hold these; slot names appear only where a policy is
/// read or a plan is printed (names(), of_names()).
class SlotMask {
 public:
  constexpr SlotMask() = default;
  constexpr SlotMask(std::initializer_list<Slot> slots) {
    for (Slot s : slots) add(s);
  }
  /// Every slot of block_slots() (the block input is not one of them).
  static SlotMask droppable();
  /// The slots `names` name (block_slots() spellings); throws std::invalid_argument naming
  /// the slots at the first name that is not one.
  static SlotMask of_names(const std::vector<std::string>& names);
  /// The names of its slots, in forward order.
  std::vector<std::string> names() const;
  /// Its slots, in forward order.
  std::vector<Slot> slots() const;

  constexpr bool has(Slot s) const { return (bits_ >> static_cast<int>(s) & 1u) != 0; }
  constexpr void add(Slot s) { bits_ |= 1u << static_cast<int>(s); }
  constexpr void remove(Slot s) { bits_ &= ~(1u << static_cast<int>(s)); }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr uint32_t bits() const { return bits_; }
  constexpr SlotMask& operator|=(SlotMask o) {
    bits_ |= o.bits_;
    return *this;
  }
  friend constexpr SlotMask operator|(SlotMask a, SlotMask b) { return a |= b; }
  friend constexpr bool operator==(SlotMask a, SlotMask b) { return a.bits_ == b.bits_; }
  friend constexpr bool operator!=(SlotMask a, SlotMask b) { return a.bits_ != b.bits_; }
  friend constexpr bool operator<(SlotMask a, SlotMask b) { return a.bits_ < b.bits_; }

 private:
  uint32_t bits_ = 0;
};
static_assert(kSlotCount <= 32, "a SlotMask holds a bit per slot");

struct LayerPlan {
  SlotMask dropped;  ///< slots recomputed in this layer's backward
  /// uniform:N: the first layer of this layer's chunk. When it differs from this layer,
  /// the layer's input is not kept either; the chunk's backward recomputes the whole
  /// chunk from its first layer's input. -1: not in a chunk.
  int64_t chunk_begin = -1;
  /// Tensor parallelism without sequence parallelism (Megatron's
  /// distribute_saved_activations): the kept block input, which every rank of the
  /// tensor-parallel group holds whole, is held as this rank's 1/tp share of its elements
  /// from its last forward reader on, and all-gathered at the start of the layer's backward
  /// (or of its chunk's recompute). Only for a layer that keeps its input.
  bool input_sharded = false;
  /// model.attention = auto chosen per layer: the attention op this layer runs where it is
  /// not the model's (ModelConfig::attention, math or tiled); unset: the model's. The
  /// planner sets it only with both ops' measured times, and never in a uniform chunk
  /// (a chunk's layers run the model's op).
  std::optional<Attention> attention;
  /// Slots (Slot::input too) the forward moves to host memory once the layer's forward
  /// ends, and that come back to the device when its backward (or its chunk's recompute)
  /// starts: kept, but not on the device in between. Never a dropped slot; memory a kept
  /// slot outside the set shares stays on the device (BlockGraph::offload_groups).
  SlotMask offloaded;
  /// Its offloaded slots start their copies back when the backward of the layer above
  /// begins, behind that layer's own, not when its own backward does: they hide behind that
  /// backward too, and their device memory is held through it. Only where
  /// ActivationPlan::may_prefetch allows; the planner sets it where the step is then faster
  /// and still fits the budget.
  bool prefetch = false;
  /// Sharded weights (ZeRO-3): the layer's weights, gathered for its forward, stay on the
  /// device until its backward instead of being gathered again for it (FSDP's
  /// reshard_after_forward = False for this layer). Never in a uniform chunk, whose
  /// recompute gathers them again anyway.
  bool weights_kept = false;
  bool keeps_all() const { return dropped.empty() && chunk_begin < 0 && !input_sharded && offloaded.empty(); }
};

struct ActivationPlan {
  std::vector<LayerPlan> layers;
  std::string policy = "none";  ///< canonical spelling of the policy that produced it
  /// `layers` layers keeping everything (the policy `none`).
  static ActivationPlan none(int64_t layers) {
    ActivationPlan p;
    p.layers.resize(static_cast<size_t>(layers));
    return p;
  }
  /// The first layer of layer l's uniform chunk (a chunk's first layer has chunk_begin -1
  /// and is recognised by the next layer pointing at it), or -1 outside a chunk.
  int64_t chunk_of(int64_t l) const;
  /// The last layer of the chunk that begins at `first` (chunk_of(first) == first).
  int64_t chunk_end(int64_t first) const;
  /// Whether layer l may start its copies back before the backward of layer l + 1 in a
  /// stage whose layers end before `end`: a layer that offloads, outside a uniform chunk,
  /// below a layer of its stage outside one.
  bool may_prefetch(int64_t l, int64_t end) const;
  /// Whether it does: may_prefetch, and its LayerPlan::prefetch is set.
  bool prefetches(int64_t l, int64_t end) const {
    return layers.at(static_cast<size_t>(l)).prefetch && may_prefetch(l, end);
  }
  /// Whether layer l keeps its gathered weights from its forward to its backward: its
  /// LayerPlan::weights_kept, outside a uniform chunk.
  bool keeps_weights(int64_t l) const { return layers.at(static_cast<size_t>(l)).weights_kept && chunk_of(l) < 0; }
  /// Whether some layer offloads a slot to host memory.
  bool offloads() const {
    return std::any_of(layers.begin(), layers.end(), [](const LayerPlan& l) { return !l.offloaded.empty(); });
  }
};

}  // namespace remat
