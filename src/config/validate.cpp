// validate_config: every number against its key's range (the key table's, one check for
// all), then the rules between keys, a section at a time.
#include "remat/config.h"

#include "util/utf8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace remat {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// Token ids are int32 wherever they are held (the encoder's output, TokenDataset).
constexpr int64_t kMaxVocab = int64_t{1} << 31;

// Refuses the value `c` holds for `k` where it lies outside k.range, with what was given,
// the range, why and values that work.
void check_range(const ConfigKey& k, const Config& c) {
  if (!k.range || !k.number) return;
  const KeyRange& r = *k.range;
  const double v = k.number(c);
  const bool above = !r.min || (r.above_min ? v > *r.min : v >= *r.min);
  const bool below = !r.max || (r.below_max ? v < *r.max : v <= *r.max);
  if (above && below && !std::isnan(v)) return;
  std::string msg = fmt::format("{} must be {}, got {}", k.name, r.text(), k.get(c));
  if (!r.why.empty()) msg += "; " + r.why;
  if (!r.example.empty()) msg += "; for example " + r.example;
  fail(msg + ".");
}

// The range check of one key, for the rules that need it before the others are checked.
void check_range(const std::string& name, const Config& c) {
  const auto& keys = config_keys();
  const auto k = std::find_if(keys.begin(), keys.end(), [&](const ConfigKey& key) { return key.name == name; });
  if (k == keys.end()) throw std::logic_error("no config key " + name);
  check_range(*k, c);
}

// The shape's parts must fit each other, and its sizes what remat counts.
void check_model(const ModelConfig& m) {
  if (m.d_model % m.n_head != 0) {
    fail(fmt::format("model.d_model ({}) must be divisible by model.n_head ({}).", m.d_model, m.n_head));
  }
  if (m.n_head % m.n_kv_head != 0) {
    fail(fmt::format("model.n_head ({}) must be a multiple of model.n_kv_head ({}).", m.n_head, m.n_kv_head));
  }
  if (m.arch == Arch::gpt2 && m.n_kv_head != m.n_head) {
    fail(
        fmt::format("gpt2 has no grouped-query attention: model.n_kv_head ({}) must equal "
                    "model.n_head ({}).",
                    m.n_kv_head, m.n_head));
  }
  if (m.arch == Arch::llama && m.head_dim() % 2 != 0) {
    fail(fmt::format("RoPE needs an even head dimension; d_model / n_head = {}.", m.head_dim()));
  }
  const RopeScaling& r = m.rope_scaling;
  if (r.scaled() && m.arch != Arch::llama) {
    fail(
        fmt::format("model.rope_scaling.factor = {} scales RoPE, which {} has none of (learned positions); leave it "
                    "at 1.",
                    r.factor, arch_name(m.arch)));
  }
  if (r.scaled() && r.low_freq_factor >= r.high_freq_factor) {
    fail(
        fmt::format("model.rope_scaling.low_freq_factor ({}) must be below model.rope_scaling.high_freq_factor ({}): "
                    "the wavelengths between original_max_seq / high and original_max_seq / low are the ones blended "
                    "(Llama 3.1: 1 and 4).",
                    r.low_freq_factor, r.high_freq_factor));
  }
  // Parameters, counted as the matrices alone: above 2^42 (16 TiB of float32) no machine
  // holds them, and the byte counts that follow would leave int64.
  const double d = static_cast<double>(m.d_model), vocab = static_cast<double>(std::max<int64_t>(m.vocab_size, 0));
  const double params =
      vocab * d + static_cast<double>(m.n_layer) * (4.0 * d * d + 3.0 * d * static_cast<double>(m.d_ff));
  if (params > 0x1p42) {
    fail(
        fmt::format("A model of {} layers, d_model {}, d_ff {} and {} vocabulary rows has about {:.3g} parameters "
                    "({:.3g} bytes in float32), more than remat trains or plans (2^42); lower model.n_layer, "
                    "model.d_model, model.d_ff or model.vocab_size.",
                    m.n_layer, m.d_model, m.d_ff, m.vocab_size, params, 4 * params));
  }
}

// A microbatch must fit the model's context and what the planner counts; the schedule
// must decay.
void check_step(const Config& c) {
  const auto& m = c.model;
  const auto& t = c.train;
  // The planner adds bytes in int64; its largest terms are the attention probabilities,
  // [batch, heads, seq, seq] per layer: all layers' worth in float64 must stay below 2^60.
  const double attention = 8.0 * static_cast<double>(t.batch) * static_cast<double>(m.n_head) *
                           static_cast<double>(t.seq) * static_cast<double>(t.seq) * static_cast<double>(m.n_layer);
  if (attention > 0x1p60) {
    fail(
        fmt::format("The attention probabilities of {} layers at train.batch = {} x train.seq = {} with {} heads "
                    "would take {:.3g} bytes, more than remat can count (2^60); lower train.seq or train.batch.",
                    m.n_layer, t.batch, t.seq, m.n_head, attention));
  }
  if (t.batch * t.seq > (int64_t{1} << 31)) {
    fail(
        fmt::format("train.batch x train.seq = {} x {} is more than 2^31 tokens per microbatch; lower one of them "
                    "(train.grad_accum adds microbatches to a step).",
                    t.batch, t.seq));
  }
  if (t.seq > m.max_seq) {
    fail(
        fmt::format("train.seq ({}) is longer than the model's context (model.max_seq = {}); "
                    "use train.seq <= {} or raise model.max_seq.",
                    t.seq, m.max_seq, m.max_seq));
  }
  if (t.min_lr > t.lr) {
    fail(
        fmt::format("train.min_lr = {} is above train.lr = {}; the cosine schedule decays from train.lr to "
                    "train.min_lr, so give a train.min_lr of at most {}.",
                    t.min_lr, t.lr, t.lr));
  }
}

// Each rank holds an equal share of the heads and the MLP's features; the vocabulary is
// padded instead (Megatron's padding), since real vocabularies (GPT-2's 50257) are odd.
void check_tensor_parallel(const Config& c) {
  const auto& m = c.model;
  const auto& p = c.parallel;
  for (const auto& [name, size] : {std::pair<const char*, int64_t>{"model.n_head", m.n_head},
                                   {"model.n_kv_head", m.n_kv_head},
                                   {"model.d_ff", m.d_ff}}) {
    if (size % p.tp != 0) {
      fail(
          fmt::format("parallel.tp = {} gives each tensor-parallel rank an equal share of {} = {}, but {} is not a "
                      "multiple of {}; choose a parallel.tp dividing model.n_head ({}), model.n_kv_head ({}) and "
                      "model.d_ff ({}).",
                      p.tp, name, size, size, p.tp, m.n_head, m.n_kv_head, m.d_ff));
    }
  }
  const int64_t padded = padded_vocab_size(c, m.vocab_size);
  if (padded != m.vocab_size) {
    fail(
        fmt::format("model.vocab_size = {} is not padded to a multiple of model.vocab_multiple x parallel.tp = {} x "
                    "{}, so the tensor-parallel ranks cannot share its rows equally; set it to {} (load_config and "
                    "the trainer pad it so; a Config built in code must call padded_vocab_size).",
                    m.vocab_size, m.vocab_multiple, p.tp, padded));
  }
  if (p.sp && p.tp < 2) {
    fail(
        "parallel.sp = true shares each sequence's positions over the tensor-parallel ranks, but parallel.tp = 1 "
        "has one rank; set parallel.tp to 2 or more, or parallel.sp = false.");
  }
  if (p.sp && c.train.seq % p.tp != 0) {
    fail(
        fmt::format("parallel.sp = true gives each of the parallel.tp = {} ranks an equal share of the {} positions "
                    "of a sequence (train.seq), but {} is not a multiple of {}; choose a train.seq that is.",
                    p.tp, c.train.seq, c.train.seq, p.tp));
  }
}

// The data-parallel ranks share the batch; every pipeline stage needs a layer; NCCL
// needs CUDA ranks.
void check_ranks(const Config& c) {
  const auto& p = c.parallel;
  if (p.dp > 0 && c.train.batch % p.dp != 0) {
    fail(
        fmt::format("train.batch = {} sequences cannot be split evenly over parallel.dp = {} data-parallel ranks; "
                    "make train.batch a multiple of {} (it counts the sequences of all ranks together).",
                    c.train.batch, p.dp, p.dp));
  }
  if (p.pp < 1 || p.pp > c.model.n_layer) {
    fail(
        fmt::format("parallel.pp = {} pipeline stages for {} layers: every stage needs at least one layer; use 1 "
                    "(no pipeline) to {}.",
                    p.pp, c.model.n_layer, c.model.n_layer));
  }
  if (p.pp > 1 && c.ac.stages != p.pp) {
    fail(
        fmt::format("ac.stages = {} but parallel.pp = {}: with a pipeline the per-stage policies count its real "
                    "stages; drop ac.stages or set it to {}.",
                    c.ac.stages, p.pp, p.pp));
  }
  if (p.backend == CommBackend::nccl && !c.run.device.is_cuda()) {
    fail(fmt::format(
        "parallel.backend = nccl moves CUDA tensors only, but run.device = {}; CPU ranks talk over Gloo: set "
        "parallel.backend = auto or gloo, or run.device = cuda.",
        c.run.device.str()));
  }
}

// The [ac] keys that act on tensor parallelism need it, and a budget leaves their choice
// to the planner.
void check_ac_parallel(const Config& c) {
  const bool allgather = c.ac.tp_recompute_allgather && *c.ac.tp_recompute_allgather;
  const bool distribute = c.ac.distribute_saved_activations && *c.ac.distribute_saved_activations;
  if (allgather && !c.parallel.sp) {
    fail(
        "ac.tp_recompute_allgather = true keeps the sequence-parallel input of each column-parallel linear and "
        "gathers it again in the backward, but without parallel.sp = true (and parallel.tp > 1) nothing is "
        "gathered; set parallel.sp = true, or drop ac.tp_recompute_allgather.");
  }
  if (distribute && c.parallel.tp < 2) {
    fail(
        "ac.distribute_saved_activations = true keeps each recomputed layer's input as a share per "
        "tensor-parallel rank, but parallel.tp = 1 has one rank; set parallel.tp to 2 or more, or drop "
        "ac.distribute_saved_activations.");
  }
  if (distribute && c.parallel.sp) {
    fail(
        "ac.distribute_saved_activations = true shares the layers' inputs over the tensor-parallel ranks, but "
        "with parallel.sp = true they already hold a share of the positions each; drop one of the two.");
  }
  if (c.ac.budget.empty()) return;
  if (allgather) {
    fail(
        fmt::format("ac.budget = \"{}\" lets the planner choose, per layer, whether to keep each gathered input "
                    "or gather it again, but ac.tp_recompute_allgather = true fixes that choice; keep one of them.",
                    c.ac.budget));
  }
  if (distribute) {
    fail(
        fmt::format("ac.budget = \"{}\" lets the planner choose, per layer, whether to keep its input whole or "
                    "as a share per tensor-parallel rank, but ac.distribute_saved_activations = true fixes that "
                    "choice; keep one of them.",
                    c.ac.budget));
  }
}

// The dtype must name one; paths and the run's name are written where a stray
// character would break them.
void check_run(const Config& c) {
  dtype_of(c.run.dtype);
  check_path("run.out_dir", c.run.out_dir);
  check_path("run.trace", c.run.trace);
  check_path("run.record_allocations", c.run.record_allocations);
  check_path("data.dir", c.data.dir);
  check_path("data.text", c.data.text);
  check_path("data.tokenizer", c.data.tokenizer);
  check_path("model.init", c.model.init);
  if (c.run.name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
          std::string::npos ||
      c.run.name == "." || c.run.name == "..") {
    fail(fmt::format("run.name may hold only letters, digits, '.', '_' and '-', got '{}'.",
                     util::printable(c.run.name)));
  }
  // A directory name holds at most 255 bytes, and remat may add a "-N" suffix.
  if (c.run.name.size() > 200) {
    fail(
        fmt::format("run.name is {} bytes long; a run directory's name holds at most 200 (file systems allow 255, and "
                    "remat may add a suffix): give a shorter name.",
                    c.run.name.size()));
  }
}

}  // namespace

std::string KeyRange::text() const {
  const auto n = [](double v) { return fmt::format("{}", v); };
  std::string out;
  if (min && max) {
    out = above_min ? fmt::format("above {} and {} {}", n(*min), below_max ? "below" : "at most", n(*max))
                    : fmt::format("from {} to {}{}", n(*min), below_max ? "below " : "", n(*max));
  } else if (min) {
    out = fmt::format("{} {}", above_min ? "above" : "at least", n(*min));
  } else if (max) {
    out = fmt::format("{} {}", below_max ? "below" : "at most", n(*max));
  }
  return unit.empty() ? out : out + " " + unit;
}

int64_t padded_vocab_size(const Config& c, int64_t vocab) {
  check_range("model.vocab_multiple", c);
  if (vocab <= 0) return vocab;
  // load_config pads before validate_config looks at the rest, so the factors are bounded
  // here: the rounding below stays far inside int64 (a vocabulary near 2^63, or a parallel.tp
  // near 2^62, had overflowed it).
  check_range("parallel.tp", c);
  if (vocab > kMaxVocab) {
    fail(
        fmt::format("model.vocab_size = {} is more than 2^31 tokens; token ids are 32-bit integers (the largest "
                    "real vocabularies hold a few hundred thousand): give the tokenizer's size, or 0 to take it.",
                    vocab));
  }
  const int64_t step = c.model.vocab_multiple * c.parallel.tp;
  return (vocab + step - 1) / step * step;
}

void resolve_vocab_size(Config& c, int64_t tokenizer_vocab) {
  if (c.model.vocab_size == 0) c.model.vocab_size = padded_vocab_size(c, tokenizer_vocab);
  if (c.model.vocab_size < tokenizer_vocab) {
    fail(
        fmt::format("model.vocab_size ({}) is smaller than the tokenizer's vocabulary ({}); use model.vocab_size=0 "
                    "to take the tokenizer's.",
                    c.model.vocab_size, tokenizer_vocab));
  }
}

void resolve_zero_stage(Config& c, bool zero_given) {
  auto& p = c.parallel;
  const auto& strategy = p.data_parallel_sharding_strategy;
  const auto& distributed = p.use_distributed_optimizer;
  if (!strategy && !distributed) return;
  const auto spelled = [&] {
    return strategy
               ? fmt::format("parallel.data_parallel_sharding_strategy = \"{}\"", sharding_strategy_name(*strategy))
               : fmt::format("parallel.use_distributed_optimizer = {}", *distributed ? "true" : "false");
  };
  // Megatron-FSDP shards nothing without the distributed optimizer, and the distributed
  // optimizer shards at least AdamW's state.
  const int64_t stage = strategy ? static_cast<int64_t>(*strategy) : (*distributed ? 1 : 0);
  if (strategy && distributed && (stage >= 1) != *distributed) {
    fail(fmt::format(
        "{} asks ZeRO stage {} but parallel.use_distributed_optimizer = {} asks {}; drop one of them, or make them "
        "agree (the distributed optimizer is stage 1 and above).",
        spelled(), stage, *distributed ? "true" : "false", *distributed ? "stage 1 or above" : "stage 0"));
  }
  // The distributed optimizer alone agrees with every stage from 1 on.
  const bool agrees = p.zero == stage || (!strategy && *distributed && p.zero >= 1);
  if (zero_given && !agrees) {
    fail(fmt::format(
        "parallel.zero = {} but {} asks ZeRO stage {}{}: they are two spellings of the same setting; drop one, or "
        "make them agree.",
        p.zero, spelled(), stage, !strategy && *distributed ? " or above" : ""));
  }
  if (!zero_given) p.zero = stage;
}

void resolve_reshard(Config& c, bool given) {
  auto& p = c.parallel;
  if (!p.fsdp_reshard_after_forward) return;
  if (given && p.reshard_after_forward != *p.fsdp_reshard_after_forward) {
    fail(fmt::format(
        "parallel.reshard_after_forward = \"{}\" but parallel.fsdp_reshard_after_forward = \"{}\" (torchtitan's "
        "spelling, its \"default\" remat's \"auto\"): they are two spellings of the same setting; drop one, or "
        "make them agree.",
        reshard_name(p.reshard_after_forward), reshard_name(*p.fsdp_reshard_after_forward)));
  }
  p.reshard_after_forward = *p.fsdp_reshard_after_forward;
}

// Only ZeRO-3 gathers weights, so only it can keep them or gather them again.
void check_reshard(const ParallelConfig& p) {
  if (p.reshard_after_forward == Reshard::automatic || p.zero == 3) return;
  fail(
      fmt::format("parallel.reshard_after_forward = \"{}\" chooses whether ZeRO-3's gathered weights stay from a "
                  "layer's forward to its backward, but parallel.zero = {} gathers none: set parallel.zero = 3, or "
                  "drop the setting.",
                  reshard_name(p.reshard_after_forward), p.zero));
}

// Formats other than text read the user's files, and token ids mean nothing without the
// tokenizer that wrote them.
void check_data(const DataConfig& d) {
  const char* format = data_format_name(d.format);
  if (d.format != DataFormat::text && d.text.empty()) {
    fail(
        fmt::format("data.format = \"{}\" reads the files data.text names, but data.text is unset (the default "
                    "corpus is text): set data.text to a file or a glob such as data/shards/*.{}.",
                    format, d.format == DataFormat::jsonl ? "jsonl" : "bin"));
  }
  if (d.format == DataFormat::tokens && d.tokenizer.empty()) {
    fail(
        "data.format = \"tokens\" reads token ids, which only the tokenizer that wrote them can decode and bound, but "
        "data.tokenizer is unset: set it to that tokenizer (its tokenizer.json, .model or model folder).");
  }
  if (d.format == DataFormat::jsonl && d.field.empty()) {
    fail(
        "data.field is empty; with data.format = \"jsonl\" it names the field holding each document's text, "
        "such as text.");
  }
}

void validate_config(const Config& c) {
  for (const auto& k : config_keys()) check_range(k, c);
  check_model(c.model);
  check_step(c);
  check_run(c);
  check_data(c.data);
  check_ranks(c);
  check_tensor_parallel(c);
  check_ac_parallel(c);
  check_reshard(c.parallel);
}

}  // namespace remat
