// One step's microbatches through a pipeline: this rank's stage model (Model::stage) runs
// its forwards and backwards in the schedule's order, receiving the previous stage's
// activations and the next stage's gradients over the pipeline group, and sending its own.
#pragma once

#include "remat/dist.h"
#include "remat/model.h"
#include "remat/pipeline.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <map>
#include <utility>
#include <vector>

namespace remat {

/// A microbatch as every stage samples it: the first stage reads the tokens, the last the
/// targets, and every stage the context (its dropout keys).
struct MicrobatchData {
  at::Tensor tokens, targets;
  StepContext ctx;
};

/// Runs `microbatches` microbatches through `model`, this rank's stage, in the order of
/// pipeline::actions, over `pipe` (whose rank is the stage), accumulating the stage's
/// parameter gradients of the loss scaled by `loss_scale`. `draw(j)` gives microbatch j
/// (0, 1, ... in order, each once) when its forward comes, so that a stage holds the
/// tokens of no more microbatches than it has in flight. Before each forward or backward
/// its input is received (an activation from the previous stage, a gradient from the
/// next), the sends still under way are waited for only after that receive is posted, so
/// two neighbours sending to each other cannot wait on each other, and at the end of the
/// step nothing is under way. Returns each microbatch's mean loss, in order, on every stage
/// (the last stage's, shared over `pipe`). `step` names the transfers in a failure.
/// `measured`, when given, receives the bytes the first microbatch's forward kept here.
std::vector<double> run_pipeline(Model& model, dist::Group& pipe, pipeline::Schedule schedule, int64_t microbatches,
                                 const std::function<MicrobatchData(int64_t)>& draw, double loss_scale,
                                 int64_t ce_chunk, int64_t step, ActivationBytes* measured = nullptr);

/// The mean loss of `tokens` against `targets` (Model::evaluate: no dropout, nothing kept)
/// through the stages of `pipe`, each stage's output sent to the next; returned on every
/// stage. Every stage gives the same tokens and targets. `what` names the transfers in a
/// failure ("the validation of step 40").
double evaluate_pipeline(Model& model, dist::Group& pipe, const at::Tensor& tokens, const at::Tensor& targets,
                         int64_t ce_chunk, const std::string& what);

/// Writes the named tensors (a checkpoint's, the exported weights) of every stage of
/// `pipe` as one safetensors file at `path` with `metadata` (model::save_safetensors), on
/// the first stage: its own `mine` followed by each later stage's, in stage order, a name
/// given by two stages (the tied embedding's copies) once, the first stage's. The later
/// stages send their names, dtypes and shapes first, then each tensor as the file reaches
/// it, so the first stage holds its own tensors and one received at a time, never the
/// whole model; they ignore `path` and `metadata`. `what` names the transfers in a failure.
/// `checksum`: as model::save_safetensors's.
void write_on_first_stage(dist::Group& pipe, std::vector<std::pair<std::string, at::Tensor>> mine,
                          const std::string& path, const std::map<std::string, std::string>& metadata,
                          const std::string& what, bool checksum = false);

/// Sums the gradient of each tied parameter (Param::tied: GPT-2's embedding, read by the
/// first stage's embedding and the last stage's head) between the first and the last
/// stage of `pipe`, so that both hold the whole model's; each adds the other's to its own,
/// and as float addition commutes both get the same bits. The other stages do nothing.
void sum_tied_grads(Model& model, dist::Group& pipe, int64_t step);

}  // namespace remat
