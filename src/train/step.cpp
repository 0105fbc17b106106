#include "train/step.h"

#include "remat/cost.h"
#include "remat/memory.h"
#include "remat/safetensors.h"
#include "remat/trace.h"
#include "remat/trainer.h"
#include "train/data_parallel.h"
#include "util/device.h"
#include "train/pipeline_step.h"
#include "util/utf8.h"

#include <fmt/format.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace remat {
namespace {

// Where a pipeline stage's gradients stand in the whole model's parameter order, for the
// norm: the index of the stage's first one and the model's count (the tied embedding's copy
// on the last stage is not one of them: the first stage holds the same gradient).
struct NormSlots {
  int64_t first = 0, count = 0;
};

bool counted_in_norm(const Model& model, const Param& p, bool pipelined) {
  return !(pipelined && p.tied && !model.first_stage());
}

// The slots of the whole (not tensor-parallel) parameters; a split one's squares are
// summed over the tensor-parallel group first, then over the stages.
NormSlots norm_slots(const Model& model, dist::Group* pipe) {
  if (pipe == nullptr) return {};
  int64_t own = 0;
  for (const auto& p : model.params()) own += counted_in_norm(model, p, true) && !p.shard.split() ? 1 : 0;
  std::vector<at::Tensor> counts{at::zeros({pipe->size()}, at::kLong)};
  counts[0][pipe->rank()] = own;
  pipe->all_reduce(counts, dist::Reduce::sum, "counting the stages' parameters");
  const at::Tensor before = counts[0].narrow(0, 0, pipe->rank()).sum();
  return {before.item<int64_t>(), counts[0].sum().item<int64_t>()};
}

// Scales gradients so their global L2 norm is at most max_norm; returns the norm before.
// A split parameter's squares are summed over the tensor-parallel group, a whole one's
// counted once (every rank of the group holds the same gradient). With `pipe`, every
// stage's squares of whole parameters are gathered into the whole model's order (`slots`:
// each slot is one stage's, the others add zeros, so the gather is exact) and summed as one
// process sums them: without tensor parallelism the same norm to the bit, and so the same
// clipping; the split ones' sums are added over the stages.
//
// With `shards` (sharded gradients) each rank squares its `owned` parameters' gradients
// (a tied table's, kept by every rank, too): the others' squares are zeros here, and the
// slots are summed over `shards` (one rank's value and zeros each, so exactly), then summed
// as without sharding: the same norm to the bit.
double clip_gradients(Model& model, double max_norm, int64_t step, dist::Group* pipe, const NormSlots& slots,
                      dist::Group* shards, const std::vector<bool>& owned) {
  const trace::Scope scope("clip gradients", trace::Category::step);
  // One reduction and one host read for all parameters (a sync per parameter on CUDA).
  std::vector<at::Tensor> whole, split;
  at::Tensor none;  // stands for the squares of a gradient another rank owns
  for (size_t i = 0; i < model.params().size(); ++i) {
    const Param& p = model.params()[i];
    if (!counted_in_norm(model, p, pipe != nullptr)) continue;
    const bool squared = shards == nullptr || owned[i];
    if (!squared && !none.defined()) none = at::zeros({}, model.grad_buffer().options());
    (p.shard.split() ? split : whole).push_back(squared ? p.grad.pow(2).sum() : none);
  }
  const auto total = [](const at::Tensor& squares) { return squares.to(at::kDouble).sum().reshape({1}); };
  at::Tensor split_squares = split.empty() ? at::Tensor() : at::stack(split).cpu();
  at::Tensor squares = whole.empty() ? at::Tensor() : at::stack(whole).cpu();
  if (shards != nullptr) {
    std::vector<at::Tensor> held;
    for (const at::Tensor& t : {split_squares, squares}) {
      if (t.defined()) held.push_back(t);
    }
    shards->all_reduce(held, dist::Reduce::sum, fmt::format("the gradient norm's sum of step {}", step + 1));
  }
  std::vector<at::Tensor> parts{split.empty() ? at::zeros({1}, at::kDouble) : total(split_squares)};
  if (model.tensor_group() != nullptr) {
    model.tensor_group()->all_reduce(parts, dist::Reduce::sum,
                                     fmt::format("the gradient norm's all-reduce of step {}", step + 1));
  }
  if (pipe != nullptr) {
    const std::string what = fmt::format("the gradient norm's gather over the pipeline of step {}", step + 1);
    if (model.tensor_group() != nullptr) pipe->all_reduce(parts, dist::Reduce::sum, what);
    std::vector<at::Tensor> all{at::zeros({slots.count}, squares.defined() ? squares.scalar_type() : at::kFloat)};
    if (squares.defined()) all[0].narrow(0, slots.first, squares.size(0)).copy_(squares);
    pipe->all_reduce(all, dist::Reduce::sum, what);
    squares = all[0];
  }
  const double norm = std::sqrt(parts[0].item<double>() + (squares.defined() ? total(squares).item<double>() : 0.0));
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (auto& p : model.params()) {
      if (p.grad.defined()) p.grad.mul_(scale);
    }
  }
  return norm;
}

// Which parameters this rank updates: every one, or under ZeRO-1 over several
// data-parallel ranks its share. Whole parameters rather than equal slices of their
// concatenation: each is then updated by the very LibTorch AdamW call, on the very tensor,
// as without ZeRO, so the weights are those of zero = 0 bit for bit by construction. With
// slices that rests on the kernels rounding an element alike whether it falls in a
// vectorized body, a scalar tail or another thread's chunk (it does in Debian's 1.13 AVX2
// build, measured: AdamW over two slices of 1e3 to 1e6 elements equals AdamW over the
// whole, bit for bit), which a build contracting multiply-adds differently would break.
// Whole moments also stay keyed as LibTorch keys them, for the checkpoint. The price is
// balance: a rank may hold up to the largest parameter more than the mean.
std::vector<bool> owned_params(const Model& model, dist::Comm* ranks, int64_t zero) {
  TORCH_CHECK(zero >= 0 && zero <= 3, "[TrainStep] zero must be 0 to 3 (parallel.zero), got ", zero);
  const int n = ranks != nullptr && zero >= 1 ? ranks->data().size() : 1;
  std::vector<int64_t> numels;
  for (const auto& p : model.params()) numels.push_back(p.value.numel());
  const std::vector<int> owner = cost::zero_owners(numels, n);
  const int me = n > 1 ? ranks->data().rank() : 0;
  std::vector<bool> owned;
  for (const int o : owner) owned.push_back(o == me);
  return owned;
}

// ZeRO-2 over several data-parallel ranks: the model keeps this rank's parameters'
// gradients only, and under ZeRO-3 their masters only, before the optimizer takes them.
// Returns whether it keeps the gradients so.
bool shard_model(Model& model, const std::vector<bool>& owned, dist::Comm* ranks, int64_t zero) {
  if (zero < 2 || ranks == nullptr || ranks->data().size() == 1) return false;
  model.shard_gradients(owned, ranks->data());
  if (zero >= 3) model.shard_values(owned, ranks->data());
  return true;
}

// Sums the step's loss over the data-parallel ranks, as GradientReduction does beside the
// gradients.
double loss_sum(double loss, dist::Group& group, const std::string& what) {
  std::vector<at::Tensor> total{at::full({1}, loss, at::kDouble)};
  group.all_reduce(total, dist::Reduce::sum, what);
  return total[0].item<double>();
}

// The parameters this rank updates, in the model's order.
std::vector<AdamWParam> adamw_params(Model& model, const std::vector<bool>& owned) {
  std::vector<AdamWParam> params;
  for (size_t i = 0; i < model.params().size(); ++i) {
    const Param& p = model.params()[i];
    if (owned[i]) params.push_back({p.value, p.grad, p.decay});
  }
  return params;
}

constexpr const char* kCheckpointFormat = "remat training checkpoint 1";

// The index of the first parameter of `model` whose values (with `grads`: gradients) hold
// a NaN or an infinity; -1 when none does. One pass, one host read.
int64_t first_non_finite_index(const Model& model, bool grads) {
  std::vector<at::Tensor> finite;
  for (const auto& p : model.params()) {
    // A gradient another rank keeps is undefined, a master it keeps (ZeRO-3) on the meta device.
    const at::Tensor& t = grads ? p.grad : p.value;
    const bool held = t.defined() && !t.is_meta();
    finite.push_back(held ? at::isfinite(t).all() : at::ones({}, at::kBool).to(model.device()));
  }
  const at::Tensor flags = at::stack(finite).to(at::kCPU);
  const bool* ok = flags.data_ptr<bool>();
  for (size_t i = 0; i < finite.size(); ++i) {
    if (!ok[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

std::string first_non_finite(const Model& model, bool grads) {
  const int64_t i = first_non_finite_index(model, grads);
  return i < 0 ? "" : model.params()[static_cast<size_t>(i)].name;
}

std::string TrainStep::first_non_finite_of_job(bool grads, int64_t step, const char* when) const {
  const int64_t own = first_non_finite_index(model_, grads);
  // Data-parallel replicas hold the same values and gradients, so a rank's own finding is
  // every rank's; only stages, tensor-parallel parts and sharded gradients differ and must
  // be gathered.
  if (pipe_ == nullptr && model_.tp_size() == 1 && !(grads ? model_.grads_sharded() : model_.values_sharded())) {
    return own < 0 ? "" : model_.params()[static_cast<size_t>(own)].name;
  }
  // The first in the whole model's order: the earliest stage's first, the lowest rank's
  // among equals (tensor-parallel ranks hold parts of the same parameters).
  const int64_t stage = pipe_ != nullptr ? pipe_->rank() : 0;
  const std::string what = fmt::format("the non-finite check {} the update of step {}", when, step + 1);
  const auto found = ranks_->all_gather({own < 0 ? 0 : 1, stage, own}, what);
  int first = -1;
  for (int r = 0; r < static_cast<int>(found.size()); ++r) {
    const auto& f = found[static_cast<size_t>(r)];
    if (f[0] == 0) continue;
    const auto& best = found[static_cast<size_t>(std::max(first, 0))];
    if (first < 0 || std::make_pair(f[1], f[2]) < std::make_pair(best[1], best[2])) first = r;
  }
  if (first < 0) return "";
  // Only the rank that holds it knows the parameter's name: it posts it for the others.
  const std::string key = fmt::format("non-finite/{}/{}/{}", grads ? "gradient" : "value", when, step);
  std::string name;
  if (first == ranks_->rank()) {
    name = model_.params()[static_cast<size_t>(own)].name;
    ranks_->post(key, name);
  } else {
    name = ranks_->await(key, what);
  }
  return pipe_ != nullptr
             ? fmt::format("{} (pipeline stage {}, rank {})", name, found[static_cast<size_t>(first)][1] + 1, first)
             : name;
}

// Where a non-finite step shows first: a weight, else a gradient, else the loss alone.
std::string TrainStep::where_non_finite(int64_t step) const {
  if (const std::string w = first_non_finite_of_job(false, step, "before"); !w.empty()) {
    return "parameter " + w + " holds non-finite values";
  }
  if (const std::string g = first_non_finite_of_job(true, step, "before"); !g.empty()) {
    return "the gradient of " + g + " is the first non-finite one";
  }
  return "every weight and gradient is finite, so the loss itself overflowed";
}

void apply_plan(Model& model, const ActivationPlan& plan, const AcConfig& ac) {
  StoreOptions options;
  options.check = parse_determinism_check(ac.check);
  options.early_stop = ac.early_stop;
  options.preserve_rng = ac.preserve_rng_state;
  options.pool = ac.pool;
  model.set_activation_plan(plan, options);
}

TrainStep::TrainStep(Model& model, const TrainConfig& train, uint64_t seed, dist::Comm* ranks, int64_t zero,
                     pipeline::Schedule schedule, bool overlap)
    : model_(model),
      train_(train),
      seed_(seed),
      ranks_(ranks),
      owned_(owned_params(model, ranks, zero)),
      sharded_(zero >= 1 && ranks != nullptr && ranks->data().size() > 1),
      grads_sharded_(shard_model(model, owned_, ranks, zero)),
      pipe_(ranks != nullptr && ranks->pipeline().size() > 1 ? &ranks->pipeline() : nullptr),
      schedule_(schedule),
      // Where nothing else must come first: partial gradients (sequence parallelism) are
      // summed over the tensor-parallel group before, and a pipeline's backwards interleave
      // with its transfers. Sharded gradients are summed in the backward already.
      overlap_(overlap && !grads_sharded_ && ranks != nullptr && ranks->data().size() > 1 &&
               ranks->pipeline().size() == 1 &&
               std::none_of(model.params().begin(), model.params().end(), [](const Param& p) { return p.partial; })),
      optimizer_(adamw_params(model, owned_),
                 AdamWSettings{.beta1 = train.beta1, .beta2 = train.beta2, .weight_decay = train.weight_decay}) {
  const NormSlots slots = norm_slots(model, pipe_);
  norm_first_ = slots.first;
  norm_count_ = slots.count;
}

StepResult TrainStep::run(int64_t step, const data::TokenDataset& data, std::mt19937_64& rng, bool traced) {
  const TrainConfig& t = train_;
  const at::Device device = model_.device();
  StepResult r;
  r.lr = learning_rate(t, step);
  memory::reset_peak(device);
  synchronize(device);
  if (traced) trace::start(device);
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<trace::Scope> step_scope(std::in_place, "step", trace::Category::step);

  {
    const trace::Scope scope("zero gradients", trace::Category::step);
    model_.zero_grad();
  }
  if (model_.store() != nullptr) model_.store()->reset_counters();
  const int ranks = ranks_ != nullptr ? ranks_->data().size() : 1;
  const int64_t first_row = ranks_ != nullptr ? ranks_->data().rank() * t.batch : 0;
  // Scaled by 1 / ranks here, the sum over the ranks is the mean over the global batch.
  const auto parts = static_cast<double>(t.grad_accum * ranks);
  // Microbatch m of the step, drawn from `rng` in order; this rank's rows of it, copied
  // out of the whole microbatch's (a view would keep the other ranks' rows alive too).
  const auto rows = [&](const at::Tensor& all) {
    const at::Tensor mine = all.narrow(0, first_row, t.batch);
    return (ranks > 1 ? mine.clone() : mine).to(device);
  };
  const auto draw = [&](int64_t m) {
    const data::Batch b = data.sample(t.batch * ranks, t.seq, rng);
    return MicrobatchData{rows(b.tokens), rows(b.targets),
                          StepContext{seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(m), first_row}};
  };
  if (pipe_ != nullptr) {
    for (const double loss :
         run_pipeline(model_, *pipe_, schedule_, t.grad_accum, draw, 1.0 / parts, t.ce_chunk, step, &r.activations)) {
      r.loss += loss / parts;  // in the order one process adds them
    }
    sum_tied_grads(model_, *pipe_, step);
  }
  // The data-parallel sum, overlapping the last microbatch's backward where it may.
  std::optional<GradientReduction> reduction;
  const std::string reduce_what = fmt::format("the gradient all-reduce of step {}", step + 1);
  if (pipe_ == nullptr) {
    for (int64_t m = 0; m < t.grad_accum; ++m) {
      const MicrobatchData d = draw(m);
      if (overlap_ && m == t.grad_accum - 1) reduction.emplace(model_, ranks_->data(), true, reduce_what);
      r.loss += model_.forward_backward(d.tokens, d.targets, d.ctx, 1.0 / parts, t.ce_chunk,
                                        m == 0 ? &r.activations : nullptr) /
                parts;
    }
  }
  model_.sum_partial_grads(fmt::format("the sequence-parallel gradient all-reduce of step {}", step + 1));
  if (grads_sharded_) {
    // Summed in the backward, a part at a time (Model::shard_gradients): the loss is left,
    // and a pipeline's tied table, summed between its stages above.
    const bool ends = model_.first_stage() || model_.last_stage();
    r.reduce_buckets = t.grad_accum * (model_.stage().count + (ends ? 1 : 0));
    std::vector<at::Tensor> tied;
    for (const Param& p : model_.params()) {
      if (p.tied) tied.push_back(p.grad);
    }
    if (!tied.empty()) {
      ranks_->data().all_reduce(tied, dist::Reduce::sum,
                                fmt::format("the tied table's gradient sum of step {}", step + 1));
      ++r.reduce_buckets;
    }
    r.loss = loss_sum(r.loss, ranks_->data(), reduce_what);
  } else if (ranks_ != nullptr) {
    const trace::Scope scope("gradient all-reduce", trace::Category::step);
    if (!reduction) reduction.emplace(model_, ranks_->data(), false, reduce_what);
    r.reduce_buckets = reduction->bucket_count();
    r.reduce_buckets_overlapped = reduction->started_early();
    reduction->finish(r.loss);
  }
  r.grad_norm = clip_gradients(model_, t.grad_clip, step, pipe_, {norm_first_, norm_count_},
                               grads_sharded_ ? &ranks_->data() : nullptr, owned_);
  // Checked before the update, so that a bad step leaves the weights as they were.
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
    const ModelConfig& m = model_.config();
    if (step == 0) {
      throw std::runtime_error(fmt::format(
          "The training loss is {} (gradient norm {}) at step 1, before any update, so the initial model is at fault, "
          "not the learning rate: {}; check model.init_std (now {}) and model.norm_eps (now {}).",
          r.loss, r.grad_norm, where_non_finite(step), m.init_std, m.norm_eps));
    }
    throw std::runtime_error(fmt::format(
        "The training loss became {} (gradient norm {}) at step {}: {}; lower train.lr (now {}), raise train.warmup "
        "(now {}) or set train.grad_clip (now {}).",
        r.loss, r.grad_norm, step + 1, where_non_finite(step), t.lr, t.warmup, t.grad_clip));
  }
  {
    const trace::Scope scope("optimizer step", trace::Category::step);
    optimizer_.step(r.lr);
  }
  if (sharded_ && !model_.values_sharded()) {  // sharded masters are gathered as each part needs them
    const trace::Scope scope("parameter exchange", trace::Category::step);
    std::vector<at::Tensor> values;
    for (const Param& p : model_.params()) values.push_back(p.value);
    dist::from_owners(values, owned_, model_.value_buffer(), ranks_->data(),
                      fmt::format("the parameter exchange of step {}", step + 1));
  }
  synchronize(device);
  step_scope.reset();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (traced) r.trace = trace::stop();
  const auto mem = memory::stats(device);
  r.current_bytes = mem.current;
  r.peak_bytes = mem.peak;
  r.reserved_peak_bytes = mem.reserved_peak;

  // After the peak is read: the check's temporaries are not the step's memory.
  if (const std::string w = first_non_finite_of_job(false, step, "after"); !w.empty()) {
    throw std::runtime_error(fmt::format(
        "The update of step {} made parameter {} non-finite (the loss was {}, the gradient norm {}); lower train.lr "
        "(now {}) or set train.grad_clip (now {}).",
        step + 1, w, r.loss, r.grad_norm, r.lr, t.grad_clip));
  }
  if (model_.store() != nullptr) {
    r.counters = model_.store()->counters();
    const memory::HostPool::Counts host = model_.store()->host().counts();
    r.host_peak_bytes = host.peak_in_use;
    r.host_pinned_bytes = host.pinned;
  }
  return r;
}

void TrainStep::save_checkpoint(const std::string& path, int64_t steps, const std::mt19937_64& rng, bool write,
                                const std::map<std::string, std::string>& extra) const {
  // A rank that does not write takes part in the gathers and keeps nothing, but for the
  // first data- and tensor-parallel rank of each later pipeline stage, which gives its
  // stage's tensors to the first stage's.
  const bool stage_giver = pipe_ != nullptr && ranks_->data().rank() == 0 && ranks_->tensor().rank() == 0;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const auto keep = [&](const std::string& name, const at::Tensor& t) {
    if (write || stage_giver) tensors.emplace_back(name, t);
  };
  for (size_t i = 0, k = 0; i < model_.params().size(); ++i) {
    const Param& p = model_.params()[i];
    keep("param." + p.name, model_.whole(i, model_.whole_value(i)));
    const bool own = owned_[i];
    k += own ? 1 : 0;                         // the optimizer's index of parameter i is k - 1
    if (optimizer_.updates() == 0) continue;  // no moments yet
    for (const bool second : {false, true}) {
      // The owner's own moment is summed with -0.0s in place, which leaves its bits as they are.
      at::Tensor m = own ? (second ? optimizer_.exp_avg_sq(k - 1) : optimizer_.exp_avg(k - 1))
                         : at::empty(p.value.sizes(), model_.value_buffer().options());
      if (sharded_) {
        dist::from_owners({m}, {owned_[i]}, m, ranks_->data(),
                          fmt::format("gathering the optimizer's moments of {} for the checkpoint", p.name));
      }
      keep((second ? "exp_avg_sq." : "exp_avg.") + p.name, model_.whole(i, m));
    }
  }
  if (!write && !stage_giver) return;
  std::ostringstream rng_state;
  rng_state << rng;
  std::map<std::string, std::string> metadata{{"format", kCheckpointFormat},
                                              {"steps", std::to_string(steps)},
                                              {"adam_steps", std::to_string(optimizer_.updates())},
                                              {"rng", rng_state.str()}};
  metadata.insert(extra.begin(), extra.end());  // never in place of the step's own
  if (stage_giver) {
    write_on_first_stage(*pipe_, std::move(tensors), path, metadata,
                         fmt::format("gathering the stages' tensors for the checkpoint after step {}", steps),
                         /*checksum=*/true);
  } else {
    model::save_safetensors(path, tensors, metadata, /*checksum=*/true);
  }
}

std::string checkpoint_metadata_problem(const std::map<std::string, std::string>& metadata, CheckpointState* state) {
  const auto field = [&](const std::string& key) -> const std::string* {
    const auto it = metadata.find(key);
    return it == metadata.end() ? nullptr : &it->second;
  };
  const std::string* format = field("format");
  if (format == nullptr) return "its metadata has no 'format': it is no remat training checkpoint";
  if (*format != kCheckpointFormat) {
    return fmt::format(
        "its format is {}, not '{}'",
        nlohmann::json(util::printable(*format)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
        kCheckpointFormat);
  }
  // A whole decimal count in [lowest, 2^30] (train.steps' bound), else why not.
  const auto count = [&](const std::string& key, int64_t lowest, int64_t& out) -> std::string {
    const std::string* text = field(key);
    if (text == nullptr) return "its metadata has no '" + key + "'";
    if (text->empty() || text->size() > 10 || text->find_first_not_of("0123456789") != std::string::npos ||
        (out = std::stoll(*text)) < lowest || out > (int64_t{1} << 30)) {
      return fmt::format("its '{}' is '{}', not a count from {} to 2^30", key, util::printable(*text, 40), lowest);
    }
    return "";
  };
  CheckpointState parsed;
  if (std::string why = count("steps", 1, parsed.steps); !why.empty()) return why;
  if (std::string why = count("adam_steps", 0, parsed.adam_steps); !why.empty()) return why;
  // Every step ends in one AdamW update (a non-finite one stops the run before it).
  if (parsed.adam_steps != parsed.steps) {
    return fmt::format("its 'adam_steps' ({}) is not its 'steps' ({}): every step makes one optimizer update",
                       parsed.adam_steps, parsed.steps);
  }
  const std::string* rng = field("rng");
  if (rng == nullptr) return "its metadata has no 'rng'";
  // The engine's text form: 312 words of state and the position, nothing else.
  std::istringstream in(*rng);
  in >> parsed.rng;
  if (in.fail() || !(in >> std::ws).eof()) return "its 'rng' is not the state of the data sampler's generator";
  if (state != nullptr) *state = std::move(parsed);
  return "";
}

int64_t TrainStep::load_checkpoint(const std::string& path, std::mt19937_64& rng) {
  // This rank's parameters and moments only: a stage reads its own share of the file.
  std::set<std::string> mine;
  for (const Param& p : model_.params()) {
    for (const char* kind : {"param.", "exp_avg.", "exp_avg_sq."}) mine.insert(kind + p.name);
  }
  const model::SafeTensors file =
      model::load_safetensors(path, [&](const std::string& name) { return mine.count(name) > 0; });
  const auto refuse = [&](const std::string& why) {
    return std::runtime_error(fmt::format("{} is not a training checkpoint of this model: {}.", path, why));
  };
  CheckpointState state;
  if (const std::string why = checkpoint_metadata_problem(file.metadata, &state); !why.empty()) throw refuse(why);
  // Everything is checked before anything is written.
  // Checked against the whole parameters (a tensor-parallel rank holds a part of each).
  const auto tensor = [&](const std::string& name, size_t i, bool required) -> const at::Tensor* {
    const at::Tensor* t = file.find(name);
    const at::Tensor& like = model_.params()[i].value;
    const std::vector<int64_t> sizes = model_.whole_sizes(i);
    if (t == nullptr && required) throw refuse("it has no tensor '" + name + "'");
    if (t != nullptr && (t->sizes() != at::IntArrayRef(sizes) || t->scalar_type() != like.scalar_type())) {
      throw refuse(fmt::format("'{}' is {} {} where the model has {} {}", name, c10::toString(t->scalar_type()),
                               c10::str(t->sizes()), c10::toString(like.scalar_type()), c10::str(sizes)));
    }
    return t;
  };
  const int64_t adam_steps = state.adam_steps;
  for (size_t i = 0; i < model_.params().size(); ++i) {
    const std::string& name = model_.params()[i].name;
    tensor("param." + name, i, true);
    tensor("exp_avg." + name, i, adam_steps > 0);
    tensor("exp_avg_sq." + name, i, adam_steps > 0);
  }
  // A non-finite value would be blamed on the learning rate a step later; it is the file's.
  for (const auto& [name, t] : file.tensors) {
    if (at::isFloatingType(t.scalar_type()) && !at::isfinite(t).all().item<bool>()) {
      throw std::runtime_error(fmt::format(
          "The checkpoint {} holds a NaN or an infinity in '{}', which training never saves, so the file was damaged "
          "after it was written (not by the learning rate); remove it to resume from an earlier checkpoint, or start "
          "the run again.",
          path, name));
    }
    // A square's running mean is never negative; sqrt of one would be NaN a step later.
    if (name.rfind("exp_avg_sq.", 0) == 0 && (t < 0).any().item<bool>()) {
      throw std::runtime_error(fmt::format(
          "The checkpoint {} holds a negative AdamW second moment in '{}', which training never saves (it is a mean "
          "of squares), so the file was damaged after it was written (not by the learning rate); remove it to resume "
          "from an earlier checkpoint, or start the run again.",
          path, name));
    }
  }
  const std::mt19937_64 restored = state.rng;
  const int64_t steps = state.steps;

  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> firsts, seconds;
  for (size_t i = 0; i < model_.params().size(); ++i) {
    Param& p = model_.params()[i];
    if (model_.values_sharded() && !owned_[i]) continue;  // another rank keeps its master
    p.value.copy_(model_.part(i, *file.find("param." + p.name)));
    if (adam_steps == 0 || !owned_[i]) continue;
    firsts.push_back(model_.part(i, *file.find("exp_avg." + p.name)));
    seconds.push_back(model_.part(i, *file.find("exp_avg_sq." + p.name)));
  }
  optimizer_.restore(adam_steps, firsts, seconds);
  rng = restored;
  return steps;
}

bool TrainStep::gives_to_checkpoint() const {
  return model_.tp_size() > 1 || sharded_ || (pipe_ != nullptr && ranks_->data().rank() == 0);
}

}  // namespace remat
