#include "run/run.h"

#include "remat/budget.h"
#include "remat/memory.h"
#include "remat/policy.h"
#include "util/device.h"
#include "dist/ranks.h"
#include "util/stop_signals.h"
#include "util/utf8.h"

#include <fmt/format.h>

namespace remat {

namespace {

// What a rank's tensors may take of the memory it has free: on the CPU, the heap holds
// more than the tensors' bytes (fragmentation, the process's own), which the cost model
// does not count; an eighth of the tensors' peak and 256 MiB are left to it.
struct Room {
  int64_t bytes = -1;  ///< -1: unchecked
  std::string what;    ///< as the sentences below name it
};

Room room_of(const RunSpec& spec, int64_t available) {
  if (available < 0) return {};
  if (on_cuda(spec.cfg.run)) {
    return {available, fmt::format("the {} free on {}", memory::format_bytes(available), spec.cfg.run.device.str())};
  }
  const int64_t bytes = std::max<int64_t>(0, available - (int64_t{256} << 20)) / 9 * 8;
  return {bytes, fmt::format("the {} this rank's tensors can take on this machine (its share of MemAvailable, {}, "
                             "less an eighth and 256 MiB for the heap)",
                             memory::format_bytes(bytes), memory::format_bytes(available))};
}

// Throws where the parameters, gradients and AdamW moments alone exceed the room: no
// plan fits, and a time profile would allocate the model first. (A pipeline stage's
// profile measures a probe of two layers, and its layers may be the plan's to choose: its
// peak is checked after.)
void check_statics_fit(const RunSpec& spec, const Room& room) {
  const bool whole_model = spec.layout.has_embedding() && spec.layout.has_head();
  if (room.bytes < 0 || !whole_model) return;
  const cost::StaticBytes statics = cost::static_bytes(spec.local.model, spec.shape, spec.layout);
  if (statics.total() <= room.bytes) return;
  throw std::invalid_argument(fmt::format(
      "{} ({} layers, d_model {}, d_ff {}) needs {} per rank for its parameters, gradients and AdamW moments alone, "
      "more than {}: no recompute plan fits; lower model.n_layer, model.d_model or model.d_ff, or share the model "
      "over more ranks (parallel.tp, parallel.pp, parallel.zero=1 to 3).",
      spec.cfg.model.preset, spec.cfg.model.n_layer, spec.cfg.model.d_model, spec.cfg.model.d_ff,
      memory::format_bytes(statics.total()), room.what));
}

// Throws where no plan fits the room, before a time profile runs a step of the batch (it
// allocated gigabytes for a minute before check_plan_fits refused a batch of a million).
void check_some_plan_fits(const RunSpec& spec, const Room& room, int64_t host_budget) {
  const bool whole_model = spec.layout.has_embedding() && spec.layout.has_head();
  if (room.bytes < 0 || !whole_model) return;
  const std::optional<int64_t> least = least_peak_above(spec.local, spec.dtype, host_budget, room.bytes);
  if (!least) return;
  throw std::invalid_argument(fmt::format(
      "A step of train.batch={} x train.seq={} tokens peaks at {} per rank under the plan that needs least memory "
      "(predicted, `remat plan`'s minimum feasible budget), more than {}: no plan fits; lower train.batch or "
      "train.seq (train.grad_accum keeps the tokens of a step with smaller microbatches).",
      spec.local.train.batch, spec.local.train.seq, memory::format_bytes(*least), room.what));
}

// Throws where the plan's predicted peak (on CUDA: the allocator's reserved bytes)
// exceeds the room.
void check_plan_fits(const RunSpec& spec, const Room& room) {
  const bool cuda = on_cuda(spec.cfg.run);
  const int64_t peak = cuda ? spec.plan.device_peak().reserved_peak : spec.plan.peak();
  if (room.bytes < 0 || peak <= room.bytes) return;
  const std::string fits = fmt::format("ac.budget={}MiB", room.bytes >> 20);
  throw std::invalid_argument(fmt::format(
      "The plan {} peaks at {} per rank (predicted{}), more than {}; {} for the fastest plan that fits, or lower "
      "train.batch or train.seq.",
      spec.plan.plan.policy, memory::format_bytes(peak), cuda ? ", the caching allocator's reserved bytes" : "",
      room.what,
      spec.cfg.ac.budget.empty()
          ? fmt::format("give a memory budget of at most that, {}{},", fits,
                        spec.cfg.ac.policy ? " in place of ac.policy" : "")
          : fmt::format("ac.budget={} is more than that: give at most {}", spec.cfg.ac.budget, fits)));
}

// ac.host_budget in bytes: as given (a fraction of the host memory free), else all of that
// free memory on a CUDA device or for a policy that offloads, and none for a CPU budget's
// plan, the CPU's host memory being its device's.
int64_t host_budget_bytes(const Config& cfg, int64_t host_available, bool policy_offloads) {
  const int64_t free = std::max<int64_t>(0, host_available >= 0 ? host_available : memory_available(at::kCPU));
  if (!cfg.ac.host_budget.empty()) return parse_host_budget(cfg.ac.host_budget, free);
  return on_cuda(cfg.run) || policy_offloads ? free : 0;
}

// Throws where the plan's offloaded slots would need more host memory at once than this
// rank has free (the host pool would fail in the middle of a step), or than an
// ac.host_budget given beside a policy (once ignored there).
void check_host_fits(const RunSpec& spec, int64_t host_available, const std::string& given, int64_t host_budget) {
  const int64_t host = spec.plan.predicted.host_peak;
  if (!given.empty() && spec.cfg.ac.budget.empty() && host > host_budget) {
    throw std::invalid_argument(fmt::format(
        "The policy {} keeps {} of offloaded slots in host memory at once (predicted), more than ac.host_budget = "
        "\"{}\" ({}); offload fewer slots, raise ac.host_budget, or lower train.batch or train.seq.",
        spec.plan.plan.policy, memory::format_bytes(host), util::printable(given), memory::format_bytes(host_budget)));
  }
  if (host_available < 0 || host <= host_available) return;
  throw std::invalid_argument(fmt::format(
      "The plan {} keeps {} of offloaded slots in host memory at once (predicted), more than the {} this rank has "
      "free; offload fewer slots{}, or lower train.batch or train.seq.",
      spec.plan.plan.policy, memory::format_bytes(host), memory::format_bytes(host_available),
      spec.cfg.ac.budget.empty() ? "" : " (a smaller ac.host_budget)"));
}

}  // namespace

Config resolve_config(const Config& cfg, const std::optional<data::CorpusInfo>& corpus) {
  Config out = cfg;
  if (corpus) {
    resolve_vocab_size(out, corpus->vocab_size);
  } else if (out.model.vocab_size == 0) {
    // What `remat prepare` will train, padded as a run pads it.
    out.model.vocab_size = padded_vocab_size(out, out.data.vocab_size);
  }
  validate_config(out);
  validate_plan(out);
  return out;
}

RunSpec resolve_run(const Config& cfg, const RunInputs& in) {
  const util::Phase phase("planning");
  RunSpec spec;
  spec.cfg = resolve_config(cfg, in.corpus);
  const std::string given_host_budget = spec.cfg.ac.host_budget;
  const bool policy_offloads = compile_policy(spec.cfg.ac, spec.cfg.model.n_layer, spec.cfg.model.dropout).offloads();
  const int64_t host_budget = host_budget_bytes(spec.cfg, in.host_available, policy_offloads);
  // The run records the bytes it planned with (config.toml), so that its plan can be made again.
  spec.cfg.ac.host_budget = host_budget == 0 ? "0" : fmt::format("{}B", host_budget);
  spec.corpus = in.corpus;
  spec.corpus_dir = in.corpus_dir;
  spec.local = rank_share(spec.cfg);
  spec.layout = layout_of(spec.local, in.stage);
  spec.dtype = in.dtype;
  spec.shape = step_shape(spec.local, in.dtype);
  const Room room = room_of(spec, in.memory_available);
  check_statics_fit(spec, room);
  check_some_plan_fits(spec, room, host_budget);
  // The prices hold the host copies' where the policy offloads or a budget plan may.
  const bool host_copies = (!spec.local.ac.budget.empty() && host_budget > 0) || policy_offloads;
  TORCH_CHECK(in.prices != nullptr, "[resolve_run] a run is resolved against a source of prices");
  const PricesOf prices_of = [&](const Config& local) { return in.prices->of(local, host_copies); };
  spec.plan = plan_run_auto(spec.cfg, spec.local, in.dtype, prices_of, in.stage, in.saved, host_budget);
  spec.layout.split = spec.plan.split;
  check_plan_fits(spec, room);
  check_host_fits(spec, in.host_available, given_host_budget, host_budget);
  return spec;
}

}  // namespace remat
