#include "train/pipeline_step.h"

#include "remat/safetensors.h"
#include "remat/trace.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <sstream>

namespace remat {

namespace {

// Activations of microbatch j travel under tag 2j, their gradients under 2j + 1; the tied
// gradients under a tag of their own.
int tag(int64_t microbatch, bool gradient) { return static_cast<int>(2 * microbatch + (gradient ? 1 : 0)); }
constexpr int kTiedTag = 1 << 30;
// An evaluation's activations; gathering named tensors: the header's length, the header,
// then the tensors in order.
constexpr int kEvalTag = kTiedTag + 1;
constexpr int kGatherTag = kTiedTag + 2;

}  // namespace

std::vector<double> run_pipeline(Model& model, dist::Group& pipe, pipeline::Schedule schedule, int64_t microbatches,
                                 const std::function<MicrobatchData(int64_t)>& draw, double loss_scale,
                                 int64_t ce_chunk, int64_t step, ActivationBytes* measured) {
  const int stage = pipe.rank(), stages = pipe.size();
  const bool first = stage == 0, last = stage == stages - 1;
  TORCH_CHECK(model.first_stage() == first && model.last_stage() == last, "[run_pipeline] the model holds layers ",
              model.stage().first + 1, " to ", model.stage().first + model.stage().count, " but is stage ", stage + 1,
              " of ", stages);
  const int64_t M = microbatches;
  std::vector<std::unique_ptr<Microbatch>> flight(static_cast<size_t>(M));
  std::vector<std::pair<int64_t, int64_t>> shape(static_cast<size_t>(M));  // each microbatch's [B, T]
  std::vector<at::Tensor> held(static_cast<size_t>(M));
  std::vector<std::unique_ptr<dist::Transfer>> sending;
  // Posts the receive, then waits for the sends under way (their peers may be waiting for
  // this receive to be posted before they post the one those sends need), then for it.
  const auto receive = [&](at::Tensor& into, int peer, int t, const std::string& what) {
    auto r = pipe.recv(into, peer, t, what);
    for (auto& s : sending) s->wait();
    sending.clear();
    r->wait();
  };
  // Each microbatch's loss: the last stage's, the others adding zeros to it.
  at::Tensor losses = at::zeros({M}, at::kDouble);
  const std::vector<pipeline::Action> order = pipeline::actions(schedule, stages, stage, M);
  for (size_t i = 0; i < order.size(); ++i) {
    const pipeline::Action& a = order[i];
    const at::TensorOptions act = at::TensorOptions().dtype(model.compute_dtype()).device(model.device());
    const int64_t C = model.config().d_model;
    if (!a.backward) {
      // Drawn as its forward comes, in order. Until its backward the stage holds what the
      // cost model counts (cost::StaticBytes::batch): the first stage its token ids, the
      // last its targets, the others neither.
      MicrobatchData d = draw(a.microbatch);
      d.ctx.backward_follows = pipeline::backward_follows(order, i);
      // Sequence parallel: the activations between stages are this rank's positions.
      const int64_t B = d.tokens.size(0), T = d.tokens.size(1) / (model.sequence_parallel() ? model.tp_size() : 1);
      shape[static_cast<size_t>(a.microbatch)] = {B, T};
      if (!first) d.tokens = at::Tensor();
      if (!last) d.targets = at::Tensor();
      held[static_cast<size_t>(a.microbatch)] = first ? d.tokens : d.targets;
      at::Tensor input = d.tokens;
      if (first) {
        // No receive comes first here to wait behind, so the previous forward's activations,
        // held by their send, would stay through this forward. The next stage posts their
        // receive at its forward of that microbatch, which waits for nothing this stage does
        // later (the previous stage's activations and the later stages' forwards only), so
        // waiting here closes no cycle.
        for (auto& s : sending) s->wait();
        sending.clear();
      } else {
        input = at::empty({B, T, C}, act);
        receive(input, stage - 1, tag(a.microbatch, false),
                fmt::format("the receive of microbatch {}'s activations from stage {} (step {})", a.microbatch + 1,
                            stage, step + 1));
      }
      auto& mb = flight[static_cast<size_t>(a.microbatch)];
      mb = model.forward(std::move(input), d.targets, d.ctx, ce_chunk, a.microbatch == 0 ? measured : nullptr);
      losses.data_ptr<double>()[a.microbatch] = mb->loss;
      if (!last) {
        sending.push_back(pipe.send(mb->output, stage + 1, tag(a.microbatch, false),
                                    fmt::format("the send of microbatch {}'s activations to stage {} (step {})",
                                                a.microbatch + 1, stage + 2, step + 1)));
        mb->output = at::Tensor();  // the send holds it until it is done
      }
    } else {
      const auto [B, T] = shape[static_cast<size_t>(a.microbatch)];
      at::Tensor dy;
      if (!last) {
        dy = at::empty({B, T, C}, act);
        receive(dy, stage + 1, tag(a.microbatch, true),
                fmt::format("the receive of microbatch {}'s gradients from stage {} (step {})", a.microbatch + 1,
                            stage + 2, step + 1));
      }
      auto& mb = flight[static_cast<size_t>(a.microbatch)];
      const at::Tensor dx = model.backward(*mb, std::move(dy), loss_scale);  // dy goes once used
      mb.reset();
      held[static_cast<size_t>(a.microbatch)] = at::Tensor();
      if (!first) {
        sending.push_back(pipe.send(dx, stage - 1, tag(a.microbatch, true),
                                    fmt::format("the send of microbatch {}'s gradients to stage {} (step {})",
                                                a.microbatch + 1, stage, step + 1)));
      }
    }
  }
  for (auto& s : sending) s->wait();
  std::vector<at::Tensor> shared{losses};
  pipe.all_reduce(shared, dist::Reduce::sum, fmt::format("sharing the losses of step {} over the pipeline", step + 1));
  return {losses.data_ptr<double>(), losses.data_ptr<double>() + M};
}

void sum_tied_grads(Model& model, dist::Group& pipe, int64_t step) {
  const int stages = pipe.size(), stage = pipe.rank();
  if (stages == 1 || (stage != 0 && stage != stages - 1)) return;
  const int peer = stage == 0 ? stages - 1 : 0;
  for (Param& p : model.params()) {
    if (!p.tied) continue;
    at::Tensor theirs = at::empty_like(p.grad);
    const std::string what =
        fmt::format("the exchange of {}'s gradient between the first and last stage (step {})", p.name, step + 1);
    auto r = pipe.recv(theirs, peer, kTiedTag, what);
    auto s = pipe.send(p.grad, peer, kTiedTag, what);
    r->wait();
    s->wait();
    p.grad.add_(theirs);
  }
}

double evaluate_pipeline(Model& model, dist::Group& pipe, const at::Tensor& tokens, const at::Tensor& targets,
                         int64_t ce_chunk, const std::string& what) {
  const int stage = pipe.rank(), stages = pipe.size();
  at::Tensor input = tokens;
  if (stage > 0) {
    input = at::empty({tokens.size(0), tokens.size(1), model.config().d_model},
                      at::TensorOptions().dtype(model.compute_dtype()).device(model.device()));
    pipe.recv(input, stage - 1, kEvalTag, fmt::format("{}: the receive from stage {}", what, stage))->wait();
  }
  at::Tensor output;
  std::vector<at::Tensor> loss{at::full({1}, model.evaluate(input, targets, ce_chunk, &output), at::kDouble)};
  if (stage + 1 < stages) {
    pipe.send(output, stage + 1, kEvalTag, fmt::format("{}: the send to stage {}", what, stage + 2))->wait();
  }
  pipe.all_reduce(loss, dist::Reduce::sum, fmt::format("{}: sharing the loss over the pipeline", what));
  return loss[0].item<double>();
}

void write_on_first_stage(dist::Group& pipe, std::vector<std::pair<std::string, at::Tensor>> mine,
                          const std::string& path, const std::map<std::string, std::string>& metadata,
                          const std::string& what, bool checksum) {
  const int stage = pipe.rank();
  if (stage > 0) {
    // One line per tensor: name, dtype, sizes.
    std::string header;
    for (auto& [name, t] : mine) {
      t = t.to(at::kCPU).contiguous();
      header += fmt::format("{}\t{}\t{}\n", name, static_cast<int>(t.scalar_type()), fmt::join(t.sizes(), ","));
    }
    const at::Tensor length = at::full({1}, static_cast<int64_t>(header.size()), at::kLong);
    const at::Tensor bytes = at::empty({static_cast<int64_t>(header.size())}, at::kByte);
    std::memcpy(bytes.data_ptr(), header.data(), header.size());
    std::vector<std::unique_ptr<dist::Transfer>> sends;
    sends.push_back(pipe.send(length, 0, kGatherTag, what));
    sends.push_back(pipe.send(bytes, 0, kGatherTag + 1, what));
    // Each moves only once the first stage posts its receive, as the file reaches it.
    for (const auto& named : mine) sends.push_back(pipe.send(named.second, 0, kGatherTag + 2, what));
    for (auto& s : sends) s->wait();
    return;
  }
  // Every stage's specs first: the header is written before any data.
  std::vector<model::TensorSpec> specs;
  std::set<std::string> seen;
  for (const auto& [name, t] : mine) {
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
    seen.insert(name);
  }
  struct Source {
    int stage = 0;
    size_t index = 0;  ///< in the stage's list; the first stage's own: into `mine`
  };
  std::vector<Source> sources;
  for (size_t i = 0; i < mine.size(); ++i) sources.push_back({0, i});
  std::vector<std::vector<model::TensorSpec>> sent(static_cast<size_t>(pipe.size()));
  for (int from = 1; from < pipe.size(); ++from) {
    at::Tensor length = at::empty({1}, at::kLong);
    pipe.recv(length, from, kGatherTag, what)->wait();
    at::Tensor bytes = at::empty({length.item<int64_t>()}, at::kByte);
    pipe.recv(bytes, from, kGatherTag + 1, what)->wait();
    std::istringstream lines(
        std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel())));
    for (std::string line; std::getline(lines, line);) {
      std::istringstream fields(line);
      std::string name, dtype, sizes_text;
      std::getline(fields, name, '\t');
      std::getline(fields, dtype, '\t');
      std::getline(fields, sizes_text);
      std::vector<int64_t> sizes;
      std::istringstream dims(sizes_text);
      for (std::string d; std::getline(dims, d, ',');) sizes.push_back(std::stoll(d));
      auto& theirs = sent[static_cast<size_t>(from)];
      theirs.push_back({name, static_cast<at::ScalarType>(std::stoi(dtype)), sizes});
      if (!seen.insert(name).second) continue;  // a copy the file already has
      specs.push_back(theirs.back());
      sources.push_back({from, theirs.size() - 1});
    }
  }
  // How many of each stage's tensors have been received: they come in the order sent, so
  // a copy left out of the file is received (and dropped) to reach the next.
  std::vector<size_t> received(static_cast<size_t>(pipe.size()), 0);
  const auto receive = [&](int from) {
    const model::TensorSpec& spec = sent[static_cast<size_t>(from)][received[static_cast<size_t>(from)]++];
    at::Tensor t = at::empty(spec.sizes, spec.dtype);
    pipe.recv(t, from, kGatherTag + 2, what)->wait();
    return t;
  };
  model::save_safetensors(
      path, specs,
      [&](size_t i) -> at::Tensor {
        const Source& src = sources[i];
        if (src.stage == 0) return mine[src.index].second;
        while (received[static_cast<size_t>(src.stage)] < src.index) receive(src.stage);
        return receive(src.stage);
      },
      metadata, checksum);
  // The copies after each stage's last written tensor.
  for (int from = 1; from < pipe.size(); ++from) {
    while (received[static_cast<size_t>(from)] < sent[static_cast<size_t>(from)].size()) receive(from);
  }
}

}  // namespace remat
