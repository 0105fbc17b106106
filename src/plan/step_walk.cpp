#include "plan/step_walk.h"

#include "remat/ops.h"

namespace remat::cost {

using ops::nbytes;

void StepWalk::hold_statics(int64_t workspace, bool moments_made, int64_t outside) {
  // The masters, then their gradients: a flat buffer each.
  const int64_t P = numel(params_);
  const bool values = layout_.values_sharded();
  statics_.push_back(make(nbytes(values ? share_.rank_moments : P, master_)));
  if (block_of(first_).g.uses(graph::op::rope())) {
    statics_.push_back(make(ops::rope_tables_bytes(cfg_.max_seq, cfg_.head_dim(), shape_.dtype)));
  }
  statics_.push_back(make(nbytes(share_.own_grads ? share_.rank_grads : P, master_)));
  const int64_t ends = (layout_.has_embedding() ? 1 : 0) + (layout_.has_head() ? 1 : 0);
  for (int64_t b = 0; b < layout_.in_flight(shape_.grad_accum) * ends; ++b) {
    statics_.push_back(make(nbytes(shape_.batch * shape_.seq, at::kLong)));
  }
  statics_.push_back(make(workspace));
  if (moments_made) {
    for (const size_t i : share_.updated) {
      moments_.push_back(make(nbytes(numel(params_[i]), master_)));
      moments_.push_back(make(nbytes(numel(params_[i]), master_)));
    }
    if (step_count_bytes(!share_.updated.empty()) > 0) moments_.push_back(make(step_count_bytes(true)));
  }
  if (moments_made || share_.own_grads) {
    busiest_ = make(share_copies(layout_, moments_made) * nbytes(share_.moments - share_.rank_moments, master_) +
                    nbytes(share_.grads - share_.rank_grads, master_));
  }
  statics_.push_back(make(outside));
}

void StepWalk::step() {
  std::vector<Microbatch> mbs(static_cast<size_t>(shape_.grad_accum));
  for (auto& mb : mbs) mb.layers.resize(static_cast<size_t>(end_ - first_));
  // The compute dtype's copies of the parameters: one flat buffer, made by the first step's
  // first forward and cast into again after every update; with sharded values none, each
  // part gathers its own.
  if (shape_.dtype != master_ && !layout_.values_sharded() && !copies_) {
    copies_ = make(nbytes(numel(params_), shape_.dtype));
  }
  const schedule::Stage stage{first_, end_, layout_.has_embedding(), layout_.has_head()};
  for (const schedule::Action& a :
       schedule::step(plan_, stage, layout_.schedule, layout_.pp, layout_.stage, shape_.grad_accum)) {
    act(a, a.microbatch >= 0 ? &mbs[static_cast<size_t>(a.microbatch)] : nullptr);
  }
  mark("", 0);
}

void StepWalk::act(const schedule::Action& a, Microbatch* mb) {
  const std::vector<bool> keep_all(kSlotCount, true);
  switch (a.kind) {
    case schedule::Kind::embed_forward: {
      mark("embedding forward", live_.current());
      Simulator s = sim(embed_);
      mb->embed = std::make_unique<SimRun>(embed_.g, embed_.lt, keep_all);
      const SimTensor weights = gather(gathered_.embed);
      mb->x = run_forward(*mb->embed, s, input(embed_, embed_.g.input), mb->embed_bytes);
      break;
    }
    case schedule::Kind::forward:
      forward(*mb, a.layer);
      break;
    case schedule::Kind::head_forward: {
      mark("loss head", live_.current() - bytes_of(mb->x));
      Simulator s = sim(head_);
      std::vector<SimTensor> side;
      for (const int v : head_.g.side_inputs) side.push_back(input(head_, v));
      mb->head = std::make_unique<SimRun>(head_.g, head_.lt, keep_all);
      SimTensor weights = gather(gathered_.head);
      run_forward(*mb->head, s, std::move(mb->x), mb->head_bytes, false, std::move(side)).reset();
      if (a.weights_kept) mb->head_weights = std::move(weights);
      break;
    }
    case schedule::Kind::head_backward: {
      // Its forward's gather, held through nothing else, counts in the working set.
      mark("loss head", live_.current() - mb->head_bytes - bytes_of(mb->head_weights));
      Simulator s = sim(head_);
      const SimTensor weights = mb->head_weights ? std::move(mb->head_weights) : gather(gathered_.head);
      if (grad_buffers_.ends > 0) mb->ends_grads = make(grad_buffers_.ends);
      mb->dx = mb->head->backward(s, make(head_.g.output_bytes()));
      mb->head.reset();
      if (!layout_.has_embedding()) mb->ends_grads.reset();  // summed over the ranks, then freed
      break;
    }
    case schedule::Kind::fetch: {
      Held& h = mb->layers[static_cast<size_t>(a.layer - first_)];
      if (h.run) {
        Simulator s = sim(block_of(a.layer));
        const int64_t before = live_.current();
        h.run->start_fetch(s);
        h.bytes += live_.current() - before;
      } else {
        h.fetched = make(bytes_of(h.away));
        h.bytes += bytes_of(h.away);
        h.away.reset();
      }
      break;
    }
    case schedule::Kind::recompute:
      recompute(*mb, a.layer, a.last);
      break;
    case schedule::Kind::backward:
      backward(*mb, a.layer);
      break;
    case schedule::Kind::embed_backward: {
      mark("embedding backward", live_.current() - bytes_of(mb->dx) - mb->embed_bytes - bytes_of(mb->ends_grads));
      Simulator s = sim(embed_);
      const SimTensor weights = gather(gathered_.embed);
      if (grad_buffers_.ends > 0 && !layout_.has_head()) mb->ends_grads = make(grad_buffers_.ends);
      mb->embed->backward(s, std::move(mb->dx)).reset();
      mb->embed.reset();
      mb->ends_grads.reset();  // summed over the ranks, then freed
      break;
    }
    case schedule::Kind::optimizer:
      TORCH_INTERNAL_ASSERT(host_.current() == 0, "the simulated step ends its microbatches with ", host_.current(),
                            " bytes in host memory");
      busiest_.reset();
      mark("optimizer step", live_.current());
      simulate_update(live_, params_, share_, master_, &moments_);
      break;
  }
}

void StepWalk::forward(Microbatch& mb, int64_t l) {
  const Shaped& b = block_of(l);
  if (!mb.x) mb.x = input(b, b.g.input);  // a later stage receives its input
  mark(of_layer("forward", l), live_.current() - bytes_of(mb.x));
  Held& h = mb.layers[static_cast<size_t>(l - first_)];
  const LayerPlan& lp = plan_.layers[static_cast<size_t>(l)];
  SimTensor weights = gather(gathered_.layer);
  if (priced_ != nullptr && plan_.chunk_of(l) < 0) {
    // Held as priced: from its input, which the pricing counts from the start, to the
    // bytes it keeps on the device and in host memory, and its output.
    const LayerCost& c = (*priced_)[static_cast<size_t>(l - first_)];
    TORCH_INTERNAL_ASSERT(mb.x.use_count() == 1 && mb.x->bytes == b.g.values[b.g.input].info.bytes(),
                          "a priced layer's input is its own");
    mb.x.reset();
    live_.rise(c.forward_peak);
    h.kept = make(c.kept);
    h.bytes = c.kept;
    if (c.host > 0) h.away = std::make_shared<Buffer>(&host_, c.host);
    mb.x = make(b.g.output_bytes());
  } else {
    Simulator s = sim(b);
    std::vector<bool> keep = keep_flags(first_forward_drops(plan_, l));
    h.run =
        std::make_unique<SimRun>(b.g, b.lt, std::move(keep), true,
                                 lp.input_sharded ? graph::InputHold::sharded : graph::InputHold::whole, lp.offloaded);
    mb.x = run_forward(*h.run, s, std::move(mb.x), h.bytes);
  }
  if (plan_.keeps_weights(l)) keep_weights(h, std::move(weights));
  if (l == end_ - 1 && !layout_.has_head()) mb.x.reset();  // sent to the next stage
}

void StepWalk::recompute(Microbatch& mb, int64_t first, int64_t last) {
  // With the output gradient live, the chunk's layers are rebuilt whole, each over the
  // ones under it, from its first layer's input (gathered first where kept as a share).
  const Shaped& b = block_of(first);  // a chunk's layers run the model's op
  Simulator s = sim(b);
  if (!mb.dx) mb.dx = make(b.g.output_bytes());  // an earlier stage receives its output's gradient
  int64_t base = live_.current() - bytes_of(mb.dx) - bytes_of(mb.ends_grads);
  for (int64_t j = first; j <= last; ++j) base -= mb.layers[static_cast<size_t>(j - first_)].bytes;
  mark(of_layer("recompute", first), base);
  SimRun& run = *mb.layers[static_cast<size_t>(first - first_)].run;
  run.restore(s);
  run.settle(s);
  SimTensor x = run.value(b.g.input);
  for (int64_t j = first; j <= last; ++j) {
    Held& h = mb.layers[static_cast<size_t>(j - first_)];
    if (j > first) mark(of_layer("recompute", j), base);
    auto fresh = std::make_unique<SimRun>(b.g, b.lt, std::vector<bool>(kSlotCount, true));
    const SimTensor weights = gather(gathered_.layer);
    x = run_forward(*fresh, s, std::move(x), h.bytes, /*recompute=*/true);
    h.run = std::move(fresh);
    base += h.bytes;
  }
}

void StepWalk::backward(Microbatch& mb, int64_t l) {
  const Shaped& b = block_of(l);
  if (!mb.dx) mb.dx = make(b.g.output_bytes());  // an earlier stage receives its output's gradient
  Held& h = mb.layers[static_cast<size_t>(l - first_)];
  // The gradient buffers are the backward's working set too.
  mark(of_layer("backward", l), live_.current() - bytes_of(mb.dx) - h.bytes - bytes_of(mb.ends_grads));
  // Sharded values: the layer's weights, kept from its forward or gathered again. Sharded
  // gradients: the layer's own buffer, summed over the ranks after its backward.
  SimTensor weights = h.weights ? take_weights(h) : gather(gathered_.layer);
  SimTensor grads = grad_buffers_.layer > 0 ? make(grad_buffers_.layer) : nullptr;
  if (h.run) {
    Simulator s = sim(b);
    mb.dx = h.run->backward(s, std::move(mb.dx));
  } else {
    // As priced: from its kept bytes and the output gradient, which the pricing counts, to
    // its input's gradient.
    TORCH_INTERNAL_ASSERT(mb.dx.use_count() == 1, "a priced layer's output gradient is its own");
    mb.dx.reset();
    h.kept.reset();
    h.fetched.reset();
    h.away.reset();
    live_.rise((*priced_)[static_cast<size_t>(l - first_)].backward_peak);
    mb.dx = make(b.g.values[b.g.input].info.bytes());
  }
  h = Held{};
  grads.reset();
  weights.reset();
  if (l == first_ && !layout_.has_embedding()) mb.dx.reset();  // sent to the previous stage
}

}  // namespace remat::cost
