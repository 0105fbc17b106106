// The cost model's backend of the block walk (src/graph/walk.h): byte counters instead
// of tensors, each op replaying the allocations it declares, and a clock for the copies
// of offloaded slots. The layer pricer and the step walk both run blocks on it.
#pragma once

#include "remat/caching_allocator.h"
#include "remat/cost.h"

#include "graph/walk.h"

#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace remat::cost {

/// Live bytes of a simulated timeline and the highest total they reached; given a list,
/// also each allocation and free of a nonzero size, in order (the caching allocator's view).
class Live {
 public:
  explicit Live(std::vector<memory::AllocatorEvent>* events = nullptr) : events_(events) {}
  /// Returns the allocation's id in the event list (-1 when not listed).
  int64_t alloc(int64_t bytes) {
    current_ += bytes;
    peak_ = std::max(peak_, current_);
    if (events_ == nullptr || bytes == 0) return -1;
    events_->push_back({memory::AllocatorEvent::Kind::malloc, next_id_, bytes, 0});
    return next_id_++;
  }
  void free(int64_t id, int64_t bytes) {
    current_ -= bytes;
    if (id >= 0) events_->push_back({memory::AllocatorEvent::Kind::free, id, 0, 0});
  }
  /// A rise of `bytes` above the live bytes and back, counted but not listed (a folded
  /// node, a priced layer).
  void rise(int64_t bytes) {
    TORCH_INTERNAL_ASSERT(events_ == nullptr, "a timeline that lists its allocations replays every one");
    peak_ = std::max(peak_, current_ + bytes);
  }
  void reset_peak() { peak_ = current_; }
  int64_t current() const { return current_; }
  int64_t peak() const { return peak_; }
  bool lists() const { return events_ != nullptr; }

 private:
  std::vector<memory::AllocatorEvent>* events_;
  int64_t next_id_ = 0;
  int64_t current_ = 0;
  int64_t peak_ = 0;
};

/// A simulated tensor: its bytes count as live from construction to destruction, so the
/// walk's handles free simulated memory exactly where the engine's tensors die.
struct Buffer {
  Live* live;
  int64_t bytes;
  int64_t id;
  Buffer(Live* l, int64_t b) : live(l), bytes(b), id(l->alloc(b)) {}
  ~Buffer() { live->free(id, bytes); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};
using SimTensor = std::shared_ptr<Buffer>;

/// A node's declared allocations as a timeline that only counts bytes sees them: how far
/// they rise above the live bytes they start from, and the results they leave, in order.
struct Folded {
  int64_t rise = 0;
  std::vector<std::pair<int64_t, int64_t>> results;  ///< result index, bytes
};

/// Every node's forward and backward folded once, for walks that price many slot choices.
struct Folds {
  std::vector<Folded> forward, backward;
  Folds(const graph::BlockGraph& g, const graph::Lifetimes& lt);
};

/// Node i's forward allocations as its op declares them; `bytes`: each output's.
graph::Events forward_events(const graph::BlockGraph& g, int i, std::vector<int64_t>& bytes);
/// Node i's backward allocations; `bytes`: each input gradient's.
graph::Events backward_events(const graph::BlockGraph& g, int i, std::vector<int64_t>& bytes);

/// One layer's copies of offloaded slots against its compute: the compute's clock (its
/// nodes' times; of each second a copy runs beside it, it loses `slowdown`), when the
/// copies started so far run (one after another, beside the compute where they `overlap`
/// it, else in its place), how long the compute waited for them and how much longer it ran.
struct CopyClock {
  bool overlap = true;
  double slowdown = 0;
  double now = 0;
  double free = 0;                              ///< when the copies started so far end
  double ahead = 0;                             ///< seconds before `now` from which a copy may start (fetch_ahead)
  std::vector<std::pair<double, double>> runs;  ///< per ticket, from 1: when it starts and ends
  size_t running = 0;                           ///< the first of `runs` not over at `now`
  double copies = 0, waited = 0, slowed = 0;
  /// The copies started next may run from `seconds` before now, one after another (a
  /// prefetch: the backward above, once its own copies back end), the compute beside them
  /// slowed as beside any other.
  void fetch_ahead(double seconds) {
    ahead = seconds;
    free = now - seconds;
  }
  uint64_t start(double seconds);
  /// `seconds` of compute, alone on the device: slower where a copy runs.
  void compute(double seconds);
  void await(uint64_t ticket);
};

/// Seconds each node's backward takes: the layer's measured pass less its forward, shared
/// in proportion to the nodes' forward times; without a measured pass, twice its forward.
std::vector<double> backward_seconds(const graph::BlockGraph& g, const graph::Lifetimes& lt, const NodeTimes& times);

/// The cost model's backend of the block walk: each op replays its declared allocations,
/// event by event, or folded where `folds` is given (a timeline that only counts).
struct Simulator {
  using Tensor = SimTensor;
  const graph::BlockGraph& g;
  Live& live;
  const NodeTimes& times;
  bool early;
  LayerCost& cost;
  const Folds* folds = nullptr;
  Live* host = nullptr;                                 ///< where offloaded memory waits (LayerPlan::offloaded)
  CopyClock* clock = nullptr;                           ///< null: copies untimed
  const std::vector<double>* backward_times = nullptr;  ///< per node: its backward's seconds (backward_seconds)

  Tensor make(int64_t bytes) { return std::make_shared<Buffer>(&live, bytes); }
  std::vector<Tensor> forward(int i, const std::vector<Tensor>& in, bool recompute);
  std::vector<Tensor> backward(int i, const std::vector<Tensor>& dy, const std::vector<Tensor>&,
                               const std::vector<Tensor>&);
  Tensor add(const Tensor& a, const Tensor&) { return make(a->bytes); }
  void dropped(int, const Tensor&) {}
  void refilled(Slot s, const std::vector<Tensor>&) { cost.recomputed_bytes += g.slot_bytes(s); }
  template <class F>
  void recompute(F&& f) {
    f();
  }
  bool early_stop() const { return early; }
  Tensor shard(const Tensor& whole) { return make(whole->bytes / g.tp); }
  Tensor gather(const Tensor&);
  struct Moved {
    std::vector<Tensor> tensors;
    uint64_t ticket = 0;
  };
  Moved offload(const std::vector<Tensor>& group) { return relocate(group, *host, &cost.host_storages); }
  Moved fetch(const std::vector<Tensor>& group) { return relocate(group, live); }
  void await(uint64_t ticket) {
    if (clock != nullptr) clock->await(ticket);
  }

 private:
  // The results of a folded node: their bytes come after its rise, which covers them.
  void replay(const Folded& f, std::vector<Tensor>& results);
  // Replays `e`; result i that the events allocate takes `bytes[i]`.
  void replay(const graph::Events& e, std::vector<Tensor>& results, const std::vector<int64_t>& bytes);
  // A buffer per distinct buffer of `group` on `to`, as the engine copies per storage, and
  // the copy started on the clock; `storages`, when given, counts them.
  Moved relocate(const std::vector<Tensor>& group, Live& to, int64_t* storages = nullptr);
};
using SimRun = graph::BlockRun<Simulator>;

/// The walk of `g` on the simulator: its forward from its inputs (the caller's take no
/// bytes here), keeping by `keep`, and, when `backward`, its backward from the output
/// gradient. `kept`: what the forward leaves live for the backward. `folds`: g's, or null
/// to replay every declared event. `backward_times`: backward_seconds(g, lt, times).
LayerCost simulate(const graph::BlockGraph& g, const graph::Lifetimes& lt, const Folds* folds,
                   const std::vector<bool>& keep, bool early_stop, const NodeTimes& times,
                   const std::vector<double>& backward_times, bool backward,
                   graph::InputHold hold = graph::InputHold::whole, SlotMask offloaded = {}, double fetch_ahead = 0);

/// The walk of a graph no plan applies to (the embedding, the loss head): every value kept.
LayerCost simulate_kept(const graph::BlockGraph& g);

/// The keep flags (by Slot) of a block that drops `dropped`.
std::vector<bool> keep_flags(SlotMask dropped);

}  // namespace remat::cost
