// The activation store: applies an ActivationPlan to the Saved structs of each block,
// records what it dropped, and accounts for every recompute.
//
// A block's forward produces all of its slots; the store drops the ones the plan says
// to drop (remembering their shape, dtype and, with the `values` check, a hash). In the
// block's backward, asking for a dropped slot re-executes only the forward ops that lead
// to it, from the tensors that were kept, and stops there (early stop); dropout masks are
// regenerated from their counter keys, so the recomputed tensors are bitwise the
// originals. The store checks that, counts it, and never runs a nested backward.
// Recomputes run in a memory::RecomputeScope, so a layer's recompute reuses the buffers
// the previous recompute's tensors released once their backward consumed them.
#pragma once

#include "remat/memory.h"
#include "remat/plan.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace remat {

enum class DeterminismCheck { none, meta, values };

/// Parses "none" / "meta" / "values"; throws std::invalid_argument with the valid names.
DeterminismCheck parse_determinism_check(const std::string& s);

struct StoreOptions {
  DeterminismCheck check = DeterminismCheck::none;
  bool early_stop = true;  ///< false: a recompute runs the block's whole forward
  /// Recompute dropout with the forward's keys (true), or with other keys (false), which
  /// changes the masks the way frameworks that do not preserve RNG state do; only for
  /// demonstrating what the determinism check catches.
  bool preserve_rng = true;
  /// Profiling: time each recompute node (one group of forward ops, named as the cost
  /// model's nodes) into StoreCounters::node_seconds. On CUDA a node's time is its work's on
  /// the stream, between two timing events, so the kernels queue as in any step;
  /// ActivationStore::settle_node_times reads them.
  bool time_nodes = false;
  /// Serve recompute allocations from the recompute buffer pool (memory::RecomputeScope)
  /// instead of fresh memory; false allocates them from the system as any tensor.
  bool pool = true;
};

/// What the store did over the microbatches since reset().
struct StoreCounters {
  int64_t bytes_kept = 0;                      ///< saved bytes held after each forward (distinct storages), summed
  int64_t bytes_dropped = 0;                   ///< bytes the plan dropped at forward
  int64_t bytes_recomputed = 0;                ///< bytes recompute wrote back into slots
  int64_t ops_recomputed = 0;                  ///< forward ops re-executed
  std::map<std::string, int64_t> ops_by_kind;  ///< "linear", "layernorm", "attention", ...
  std::map<std::string, double> node_seconds;  ///< with time_nodes: seconds per node, summed
  std::map<std::string, int64_t> node_runs;    ///< with time_nodes: executions per node
  memory::PoolCounts pool;                     ///< recompute allocations served from the pool, or not
};

class ActivationStore {
 public:
  /// Executes `plan` (one LayerPlan per layer of the whole model) for a model that runs
  /// the layers [first, end) (a pipeline stage's; end -1: up to the last).
  ActivationStore(ActivationPlan plan, StoreOptions options, int64_t first = 0, int64_t end = -1);

  const ActivationPlan& plan() const { return plan_; }
  const StoreOptions& options() const { return options_; }
  const StoreCounters& counters() const { return counters_; }
  void reset_counters();
  /// With time_nodes on CUDA: waits for the timed nodes' work and adds their times to
  /// counters().node_seconds and node_runs, which hold them from then on.
  void settle_node_times();

  /// Forward of microbatch `mb` (StepContext::microbatch): tensor `index` of `slot` of
  /// layer `l` is being dropped; records what the determinism check needs and counts its
  /// bytes unless `view_of_dropped` (a view of another tensor of the slot, whose drop counts
  /// the memory; the caller releases it). Records of several microbatches in flight at
  /// once (a pipeline stage's) stay apart by `mb`.
  void drop(uint64_t mb, int64_t l, Slot slot, size_t index, const at::Tensor& t, bool view_of_dropped);
  /// Backward of microbatch `mb`: the recompute refilled `slot` of layer `l` with
  /// `tensors`; checks them against the record and counts their bytes (a view of all of
  /// another counted once).
  void refilled(uint64_t mb, int64_t l, Slot slot, const std::vector<at::Tensor>& tensors);
  /// Counts one re-executed forward op of `kind`.
  void count_op(const std::string& kind);
  void add_kept_bytes(int64_t bytes) { counters_.bytes_kept += bytes; }

  /// While it lives, times the recompute node `name` (when options().time_nodes).
  class NodeTimer {
   public:
    NodeTimer(ActivationStore& store, const char* name, at::Device device);
    ~NodeTimer();
    NodeTimer(const NodeTimer&) = delete;
    NodeTimer& operator=(const NodeTimer&) = delete;

   private:
    ActivationStore* store_;  ///< null when not timing
    const char* name_;
    at::Device device_;
    std::chrono::steady_clock::time_point start_;
    size_t event_ = 0;  ///< CUDA: the node's pair in store_->node_events_
  };

  /// Runs `recompute()`, a recompute of dropped slots, with its allocations pooled (when
  /// options().pool) and counted in counters().pool.
  template <class F>
  void recompute(F&& recompute) {
    if (!options_.pool) return recompute();
    const memory::RecomputeScope scope(counters_.pool);
    recompute();
  }
  /// A microbatch's backward has finished layer `l`. After the last layer of the model's
  /// range that recomputes (the lowest), no recompute of this backward is left to reuse the
  /// pool's idle buffers: they go back to the system. Until then they are kept, also across
  /// layers that recompute nothing (every:K), which costs no peak (see
  /// memory::RecomputeScope). Between two backwards nothing is pooled: another microbatch's
  /// forward may run there (a pipeline), and it does not recompute.
  void finished_backward(int64_t l);
  /// Where the plan's offloaded slots (LayerPlan::offloaded) wait between a layer's forward
  /// and its backward.
  memory::HostPool& host() { return host_; }
  const memory::HostPool& host() const { return host_; }

 private:
  struct Record {
    std::vector<std::vector<int64_t>> sizes;  ///< per tensor of the slot, in slot order
    std::vector<at::ScalarType> dtypes;
    std::vector<uint64_t> hashes;
  };
  ActivationPlan plan_;
  StoreOptions options_;
  StoreCounters counters_;
  std::map<std::tuple<uint64_t, int64_t, Slot>, Record> records_;  ///< by microbatch, layer, slot
  int64_t lowest_recompute_ = -1;  ///< lowest layer of the model's range whose plan drops anything
  memory::HostPool host_;
  /// CUDA: the timed nodes' event pairs not yet settled (defined in store.cpp, which
  /// alone includes the CUDA runtime).
  struct NodeEvents;
  std::shared_ptr<NodeEvents> node_events_;
};

}  // namespace remat
