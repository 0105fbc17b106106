#include "train/pipeline_step.h"

#include "remat/trace.h"

#include <fmt/format.h>

#include <memory>

namespace remat {

std::vector<PipelineAction> pipeline_actions(pipeline::Schedule schedule, int64_t stages, int64_t stage,
                                             int64_t microbatches) {
  std::vector<PipelineAction> out;
  const int64_t warmup = schedule == pipeline::Schedule::gpipe ? microbatches
                                                                : std::min(stages - stage - 1, microbatches);
  int64_t forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) out.push_back({false, forwards});
  for (; forwards < microbatches; ++forwards, ++backwards) {
    out.push_back({false, forwards});
    out.push_back({true, backwards});
  }
  for (; backwards < microbatches; ++backwards) out.push_back({true, backwards});
  return out;
}

namespace {

// Activations of microbatch j travel under tag 2j, their gradients under 2j + 1; the tied
// gradients under a tag of their own.
int tag(int64_t microbatch, bool gradient) { return static_cast<int>(2 * microbatch + (gradient ? 1 : 0)); }
constexpr int kTiedTag = 1 << 30;

}  // namespace

double run_pipeline(Model& model, dist::Group& pipe, pipeline::Schedule schedule,
                    const std::vector<MicrobatchData>& micro, double loss_scale, int64_t ce_chunk, int64_t step) {
  const int stage = pipe.rank(), stages = pipe.size();
  const bool first = stage == 0, last = stage == stages - 1;
  TORCH_CHECK(model.first_stage() == first && model.last_stage() == last, "[run_pipeline] the model holds layers ",
              model.stage().first + 1, " to ", model.stage().first + model.stage().count, " but is stage ", stage + 1,
              " of ", stages);
  const auto M = static_cast<int64_t>(micro.size());
  std::vector<std::unique_ptr<Microbatch>> flight(static_cast<size_t>(M));
  std::vector<std::unique_ptr<dist::Transfer>> sending;
  // Posts the receive, then waits for the sends under way (their peers may be waiting for
  // this receive to be posted before they post the one those sends need), then for it.
  const auto receive = [&](at::Tensor& into, int peer, int t, const std::string& what) {
    auto r = pipe.recv(into, peer, t, what);
    for (auto& s : sending) s->wait();
    sending.clear();
    r->wait();
  };
  double losses = 0;
  for (const PipelineAction& a : pipeline_actions(schedule, stages, stage, M)) {
    const MicrobatchData& d = micro[static_cast<size_t>(a.microbatch)];
    const int64_t B = d.tokens.size(0), T = d.tokens.size(1), C = model.config().d_model;
    const at::TensorOptions act = at::TensorOptions().dtype(model.compute_dtype()).device(model.device());
    if (!a.backward) {
      at::Tensor input = d.tokens;
      if (!first) {
        input = at::empty({B, T, C}, act);
        receive(input, stage - 1, tag(a.microbatch, false),
                fmt::format("the receive of microbatch {}'s activations from stage {} (step {})", a.microbatch + 1,
                            stage, step + 1));
      }
      auto& mb = flight[static_cast<size_t>(a.microbatch)];
      mb = model.forward(input, d.targets, d.ctx, ce_chunk);
      losses += mb->loss;
      if (!last) {
        sending.push_back(pipe.send(mb->output, stage + 1, tag(a.microbatch, false),
                                    fmt::format("the send of microbatch {}'s activations to stage {} (step {})",
                                                a.microbatch + 1, stage + 2, step + 1)));
        mb->output = at::Tensor();  // the send holds it until it is done
      }
    } else {
      at::Tensor dy;
      if (!last) {
        dy = at::empty({B, T, C}, act);
        receive(dy, stage + 1, tag(a.microbatch, true),
                fmt::format("the receive of microbatch {}'s gradients from stage {} (step {})", a.microbatch + 1,
                            stage + 2, step + 1));
      }
      auto& mb = flight[static_cast<size_t>(a.microbatch)];
      const at::Tensor dx = model.backward(*mb, dy, loss_scale);
      mb.reset();
      if (!first) {
        sending.push_back(pipe.send(dx, stage - 1, tag(a.microbatch, true),
                                    fmt::format("the send of microbatch {}'s gradients to stage {} (step {})",
                                                a.microbatch + 1, stage, step + 1)));
      }
    }
  }
  for (auto& s : sending) s->wait();
  // Every stage reports the step's loss: the last stage's, the others adding nothing.
  std::vector<at::Tensor> loss{at::full({1}, last ? losses : 0.0, at::kDouble)};
  pipe.all_reduce(loss, dist::Reduce::sum, fmt::format("sharing the loss of step {} over the pipeline", step + 1));
  return loss[0].item<double>();
}

void sum_tied_grads(Model& model, dist::Group& pipe, int64_t step) {
  const int stages = pipe.size(), stage = pipe.rank();
  if (stages == 1 || (stage != 0 && stage != stages - 1)) return;
  const int peer = stage == 0 ? stages - 1 : 0;
  for (Param& p : model.params()) {
    if (!p.tied) continue;
    at::Tensor theirs = at::empty_like(p.grad);
    const std::string what = fmt::format("the exchange of {}'s gradient between the first and last stage (step {})",
                                         p.name, step + 1);
    auto r = pipe.recv(theirs, peer, kTiedTag, what);
    auto s = pipe.send(p.grad, peer, kTiedTag, what);
    r->wait();
    s->wait();
    p.grad.add_(theirs);
  }
}

}  // namespace remat
