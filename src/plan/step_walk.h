// The step walk (remat/cost.h): one stage's actions of schedule::step on the block
// simulator, for the two ledgers of src/plan/step.cpp.
#pragma once

#include "plan/statics.h"

#include "remat/schedule.h"

#include <fmt/format.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat::cost {

// A graph with its lifetimes and folded events, at a stable address for the runs that
// refer to them.
struct Shaped {
  graph::BlockGraph g;
  graph::Lifetimes lt;
  Folds folds;
  explicit Shaped(graph::BlockGraph graph) : g(std::move(graph)), lt(g), folds(g, lt) {}
};

// One microbatch's layer between its forward and its backward: walked by its events (a
// run), or held as the bytes its plan was priced at (a layer outside a uniform chunk, on
// the peak ledger): kept on the device, away in host memory, or fetched back.
struct Held {
  std::unique_ptr<SimRun> run;
  SimTensor kept, away, fetched;
  SimTensor weights;  // its gathered weights, where its plan keeps them (LayerPlan::weights_kept)
  int64_t bytes = 0;  // device bytes it holds, for the working set
};

// A microbatch's parts between its forward and its backward, and the tensor between parts.
struct Microbatch {
  std::unique_ptr<SimRun> embed, head;
  int64_t embed_bytes = 0, head_bytes = 0;
  std::vector<Held> layers;  // from the stage's first layer
  SimTensor x, dx;
  SimTensor ends_grads;    // sharded gradients: the embedding's and the head's, in the backward
  SimTensor head_weights;  // the head's gathered weights, from its forward to the backward that follows at once
};

// ZeRO-3: the gathered weights live at one moment, those layers keep to their backward
// and the running part's.
struct GatheredLive {
  int64_t kept = 0, running = 0;
};

// Where a walk's live bytes first reached their highest, how far above what the step held
// there (its statics and the activations kept by every other layer and microbatch), and
// the gathered weights live then.
struct PeakMark {
  int64_t peak = 0;
  std::string at;
  int64_t working_set = 0;
  GatheredLive gathered;
};

// The step walk (cost.h): one stage's actions of schedule::step on the simulator.
class StepWalk {
 public:
  // `priced`: the stage's layers as predict_step prices them, which the layers outside
  // uniform chunks are held as (the peak ledger); null: every layer walked by its events.
  StepWalk(const ModelConfig& cfg, const StepShape& shape, const Layout& layout, const ActivationPlan& plan,
           bool early_stop, Live& live, Live& host, const std::vector<LayerCost>* priced)
      : cfg_(cfg),
        shape_(shape),
        layout_(layout),
        plan_(plan),
        early_(early_stop),
        live_(live),
        host_(host),
        priced_(priced),
        first_(layout.first_layer(cfg.n_layer)),
        end_(first_ + layout.stage_layers(cfg.n_layer)),
        embed_(graph::embed_graph(cfg, shape.batch, shape.seq, shape.dtype, layout)),
        head_(graph::head_graph(cfg, shape.batch, shape.seq, shape.dtype, shape.ce_chunk, layout)),
        params_(stage_params(cfg, layout)),
        share_(optimizer_share(cfg, params_, layout)),
        master_(master_dtype(shape.dtype)),
        grad_buffers_(gradient_buffers(cfg, layout, master_)),
        gathered_(gathered_weights(cfg, layout, shape.dtype)) {}

  // What the step holds throughout, as the model and trainer allocate it: the masters' one
  // flat buffer (the walked rank's own, sharded), the rotary tables, the gradients' one
  // flat buffer (the walked rank's own, sharded), the batches in flight, the BLAS
  // workspace; AdamW's moments (and the fused kernel's step count) where `moments_made` (a
  // step after the first), then also the moments (and sharded gradients and masters) the
  // busiest rank holds beyond the rank walked (OptimizerShare), until the update, which is
  // that rank's; `outside` bytes the device's requests do not list.
  void hold_statics(int64_t workspace, bool moments_made, int64_t outside);

  // One step's actions.
  // The compute dtype's copies of the parameters, cast again after every update.
  void step();

  const PeakMark& peak() const { return peak_; }

 private:
  SimTensor make(int64_t bytes) { return std::make_shared<Buffer>(&live_, bytes); }
  // The caller's inputs (token ids, targets) are in the batch bytes.
  SimTensor input(const Shaped& s, int v) { return make(s.g.values[v].external ? 0 : s.g.values[v].info.bytes()); }
  Simulator sim(const Shaped& s) {
    return Simulator{s.g, live_, untimed_, early_, scratch_, live_.lists() ? nullptr : &s.folds, &host_};
  }
  // The block layer l runs: the model's attention op or the one its plan names.
  const Shaped& block_of(int64_t l) {
    const Attention op = plan_.layers[static_cast<size_t>(l)].attention.value_or(cfg_.attention);
    auto& b = blocks_[op];
    if (!b) {
      ModelConfig c = cfg_;
      c.attention = op;
      b = std::make_unique<Shaped>(shape_block(c, shape_, layout_));
    }
    return *b;
  }
  static int64_t bytes_of(const SimTensor& t) { return t ? t->bytes : 0; }
  // A part's weights gathered for one of its passes (GatheredWeights; none: null), counted
  // in gathered_live_ while they live.
  SimTensor gather(int64_t bytes) {
    if (bytes == 0) return nullptr;
    note_gathered();
    gathered_live_.running += bytes;
    return {new Buffer(&live_, bytes), [this](Buffer* b) {
              note_gathered();
              gathered_live_.running -= b->bytes;
              delete b;
            }};
  }
  // A layer's gathered weights held from its forward to its backward, and taken back there.
  void keep_weights(Held& h, SimTensor weights) {
    note_gathered();
    h.bytes += bytes_of(weights);
    gathered_live_.kept += bytes_of(weights);
    gathered_live_.running -= bytes_of(weights);
    h.weights = std::move(weights);
  }
  SimTensor take_weights(Held& h) {
    note_gathered();
    gathered_live_.kept -= bytes_of(h.weights);
    gathered_live_.running += bytes_of(h.weights);
    return std::move(h.weights);
  }
  // Before the gathered weights live change: a height the live bytes reached since the last
  // change was reached with them as they are.
  void note_gathered() {
    if (live_.peak() > gathered_peak_) {
      gathered_peak_ = live_.peak();
      gathered_at_peak_ = gathered_live_;
    }
  }
  // Ends the segment of the walk under way, noting it where the live bytes reached a new
  // height in it, and starts the next, `where`, above `held` bytes.
  void mark(std::string where, int64_t held) {
    note_gathered();
    if (live_.peak() > peak_.peak) peak_ = {live_.peak(), std::move(at_), live_.peak() - held_, gathered_at_peak_};
    at_ = std::move(where);
    held_ = held;
  }
  static std::string of_layer(const char* what, int64_t l) { return fmt::format("{} of layer {}", what, l + 1); }

  void act(const schedule::Action& a, Microbatch* mb);
  void forward(Microbatch& mb, int64_t l);
  void recompute(Microbatch& mb, int64_t first, int64_t last);
  void backward(Microbatch& mb, int64_t l);
  // Runs `run`'s forward from `x` and notes in `bytes` what it then holds.
  SimTensor run_forward(SimRun& run, Simulator& s, SimTensor x, int64_t& bytes, bool recompute = false,
                        std::vector<SimTensor> side = {}) {
    const int64_t before = live_.current() - bytes_of(x);
    SimTensor out = run.forward(s, std::move(x), recompute, std::move(side));
    bytes = live_.current() - before - bytes_of(out);
    return out;
  }

  const ModelConfig& cfg_;
  const StepShape& shape_;
  const Layout& layout_;
  const ActivationPlan& plan_;
  bool early_;
  Live& live_;
  Live& host_;
  const std::vector<LayerCost>* priced_;
  int64_t first_, end_;
  Shaped embed_, head_;
  std::map<Attention, std::unique_ptr<Shaped>> blocks_;
  std::vector<graph::Param> params_;
  OptimizerShare share_;
  at::ScalarType master_;
  GradientBuffers grad_buffers_;
  GatheredWeights gathered_;
  const NodeTimes untimed_;
  LayerCost scratch_;  // the simulator's recompute counts: the peak ledger prices them per layer
  std::vector<SimTensor> statics_, moments_;
  SimTensor copies_;
  SimTensor busiest_;
  PeakMark peak_;
  GatheredLive gathered_live_, gathered_at_peak_;
  int64_t gathered_peak_ = 0;  // the live bytes' height gathered_at_peak_ was noted at
  std::string at_;
  int64_t held_ = 0;
};

}  // namespace remat::cost
