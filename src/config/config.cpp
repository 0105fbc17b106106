#include "remat/config.h"

#include "util/atomic_file.h"
#include "util/number.h"
#include "util/utf8.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

namespace remat {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// A whole-string integer or finite number; anything else is refused naming the key.
template <class T>
T parse_number(const std::string& key, const std::string& v) {
  const std::optional<T> out = [&] {
    if constexpr (std::is_integral_v<T>) {
      return util::parse_int(v);
    } else {
      return util::parse_real(v);
    }
  }();
  if (!out) {
    fail(
        fmt::format("{} must be {}, got '{}'.", key, std::is_integral_v<T> ? "an integer" : "a number", util::clip(v)));
  }
  return *out;
}

bool parse_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "1" || v == "on") return true;
  if (v == "false" || v == "0" || v == "off") return false;
  fail(fmt::format("{} must be true or false, got '{}'.", key, util::clip(v)));
}

Arch parse_arch(const std::string& key, const std::string& v) {
  if (v == "gpt2") return Arch::gpt2;
  if (v == "llama") return Arch::llama;
  fail(fmt::format("{} must be gpt2 or llama, got '{}'.", key, util::clip(v)));
}

Attention parse_attention(const std::string& key, const std::string& v) {
  if (v == "math") return Attention::math;
  if (v == "tiled") return Attention::tiled;
  if (v == "sdpa") return Attention::sdpa;
  if (v == "auto") return Attention::automatic;
  fail(
      fmt::format("{} must be tiled (online softmax over tiles, keeps one log-sum-exp per row), math "
                  "(keeps the [T x T] probabilities), sdpa (ATen's fused attention, keeps what tiled keeps; "
                  "LibTorch 2.9 and later, no attention dropout) or auto (the planner chooses one of them for the "
                  "run), got '{}'.",
                  key, util::clip(v)));
}

LossHead parse_loss_head(const std::string& key, const std::string& v) {
  if (v == "fused") return LossHead::fused;
  if (v == "recompute") return LossHead::recompute;
  if (v == "auto") return LossHead::automatic;
  fail(
      fmt::format("{} must be fused (the logits' gradient computed in the forward: one product fewer), "
                  "recompute (the logits recomputed in the backward: vocab x d_model fewer bytes kept) or auto "
                  "(the planner chooses one of them for the run's budget), got '{}'.",
                  key, util::clip(v)));
}

// `text` quoted as a JSON string, its control characters escaped and any byte that is not
// UTF-8 shown as U+FFFD (a plain dump() throws on those), for a message about that text.
// At most 200 bytes of it: a message never repeats a huge value.
std::string printable(const std::string& text) {
  return nlohmann::json(util::clip(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Token ids are int32 wherever they are held (the encoder's output, TokenDataset).
constexpr int64_t kMaxVocab = int64_t{1} << 31;

void check_tp(const Config& c) {
  if (c.parallel.tp < 1 || c.parallel.tp > 1024) {
    fail(fmt::format("parallel.tp must be from 1 to 1024 tensor-parallel ranks, got {}.", c.parallel.tp));
  }
}

// A TOML basic string: quotes, backslashes and control characters escaped.
std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20 || u == 0x7f) {
      out += fmt::format("\\u{:04X}", u);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string number(double v) { return fmt::format("{}", v); }

// Member-pointer adaptors: one line per key in the table below.
template <class S, class T>
ConfigKey key(std::string name, S Config::*section, T S::*field, std::string help) {
  ConfigKey k;
  k.name = name;
  k.help = std::move(help);
  k.set = [name, section, field](Config& c, const std::string& v) {
    T& dst = c.*section.*field;
    if constexpr (std::is_same_v<T, std::string>) {
      dst = v;
    } else if constexpr (std::is_same_v<T, Arch>) {
      dst = parse_arch(name, v);
    } else if constexpr (std::is_same_v<T, Attention>) {
      dst = parse_attention(name, v);
    } else if constexpr (std::is_same_v<T, LossHead>) {
      dst = parse_loss_head(name, v);
    } else if constexpr (std::is_same_v<T, pipeline::Schedule>) {
      dst = pipeline::schedule_of_name(v);
    } else if constexpr (std::is_same_v<T, bool>) {
      dst = parse_bool(name, v);
    } else if constexpr (std::is_integral_v<T>) {
      dst = parse_number<int64_t>(name, v);
    } else {
      dst = parse_number<double>(name, v);
    }
  };
  k.get = [section, field](const Config& c) {
    const T& src = c.*section.*field;
    if constexpr (std::is_same_v<T, std::string>) {
      return quote(src);
    } else if constexpr (std::is_same_v<T, Arch>) {
      return quote(arch_name(src));
    } else if constexpr (std::is_same_v<T, Attention>) {
      return quote(attention_name(src));
    } else if constexpr (std::is_same_v<T, LossHead>) {
      return quote(loss_head_name(src));
    } else if constexpr (std::is_same_v<T, pipeline::Schedule>) {
      return quote(pipeline::schedule_name(src));
    } else if constexpr (std::is_same_v<T, bool>) {
      return std::string(src ? "true" : "false");
    } else if constexpr (std::is_integral_v<T>) {
      return std::to_string(src);
    } else {
      return number(src);
    }
  };
  return k;
}

// TOML literal of a comma list: numbers bare, words quoted.
std::string list_literal(const std::string& v) {
  std::vector<std::string> items;
  std::string cur;
  auto push = [&] {
    const auto b = cur.find_first_not_of(" \t");
    const auto e = cur.find_last_not_of(" \t");
    const std::string item = b == std::string::npos ? "" : cur.substr(b, e - b + 1);
    if (!item.empty()) items.push_back(item);
    cur.clear();
  };
  std::string body = v;
  if (body.size() >= 2 && body.front() == '[' && body.back() == ']') body = body.substr(1, body.size() - 2);
  for (char ch : body) {
    if (ch == ',') {
      push();
    } else {
      cur += ch;
    }
  }
  push();
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& it = items[i];
    const bool num = it.find_first_not_of("+-0123456789") == std::string::npos &&
                     it.find_first_of("0123456789") != std::string::npos;
    out += (i ? ", " : "") + (num ? it : quote(it));
  }
  return out + "]";
}

// How an optional [ac] alias key is written back.
enum class Literal { Plain, List, WordOrInt };

// An optional alias key: unset until given; an empty value unsets it again.
template <class T>
ConfigKey ac_key(std::string name, std::optional<T> AcConfig::*field, std::string help,
                 Literal literal = Literal::Plain) {
  ConfigKey k;
  k.name = name;
  k.help = std::move(help);
  k.set = [name, field](Config& c, const std::string& v) {
    std::optional<T>& dst = c.ac.*field;
    if (v.empty()) {
      dst.reset();
    } else if constexpr (std::is_same_v<T, std::string>) {
      dst = v;
    } else if constexpr (std::is_same_v<T, bool>) {
      dst = parse_bool(name, v);
    } else if constexpr (std::is_integral_v<T>) {
      dst = parse_number<int64_t>(name, v);
    } else {
      dst = parse_number<double>(name, v);
    }
  };
  // [=], not [field, literal]: only the string instantiation reads `literal`, and clang warns
  // of an unused capture in the others (the fuzz build).
  k.get = [=](const Config& c) -> std::string {
    const std::optional<T>& src = c.ac.*field;
    if (!src) return "";
    if constexpr (std::is_same_v<T, std::string>) {
      if (literal == Literal::List) return list_literal(*src);
      if (literal == Literal::WordOrInt && !src->empty() && src->find_first_not_of("0123456789") == std::string::npos) {
        return *src;
      }
      return quote(*src);
    } else if constexpr (std::is_same_v<T, bool>) {
      return *src ? "true" : "false";
    } else if constexpr (std::is_integral_v<T>) {
      return std::to_string(*src);
    } else {
      return number(*src);
    }
  };
  return k;
}

std::vector<ConfigKey> make_keys() {
  using C = Config;
  return {
      key("model.preset", &C::model, &ModelConfig::preset, "model preset the shape starts from"),
      key("model.arch", &C::model, &ModelConfig::arch, "gpt2 or llama"),
      key("model.n_layer", &C::model, &ModelConfig::n_layer, "transformer blocks"),
      key("model.n_head", &C::model, &ModelConfig::n_head, "attention (query) heads"),
      key("model.n_kv_head", &C::model, &ModelConfig::n_kv_head, "key/value heads (llama GQA)"),
      key("model.d_model", &C::model, &ModelConfig::d_model, "hidden size"),
      key("model.d_ff", &C::model, &ModelConfig::d_ff, "MLP hidden size"),
      key("model.vocab_size", &C::model, &ModelConfig::vocab_size,
          "0: from the tokenizer; padded to vocab_multiple x tp"),
      key("model.vocab_multiple", &C::model, &ModelConfig::vocab_multiple,
          "pad the vocabulary to a multiple of this x tp"),
      key("model.max_seq", &C::model, &ModelConfig::max_seq, "context length"),
      key("model.attention", &C::model, &ModelConfig::attention, "tiled, math, sdpa or auto attention"),
      key("model.attention_tile", &C::model, &ModelConfig::attention_tile, "tiled attention: positions per tile"),
      key("model.loss_head", &C::model, &ModelConfig::loss_head, "fused, recompute or auto loss head"),
      key("model.dropout", &C::model, &ModelConfig::dropout, "dropout probability"),
      key("model.norm_eps", &C::model, &ModelConfig::norm_eps, "norm epsilon"),
      key("model.rope_theta", &C::model, &ModelConfig::rope_theta, "RoPE base (llama)"),
      key("model.init_std", &C::model, &ModelConfig::init_std, "weight init std"),
      key("train.steps", &C::train, &TrainConfig::steps, "optimizer steps"),
      key("train.batch", &C::train, &TrainConfig::batch, "sequences per microbatch"),
      key("train.seq", &C::train, &TrainConfig::seq, "tokens per sequence"),
      key("train.grad_accum", &C::train, &TrainConfig::grad_accum, "microbatches per step"),
      key("train.lr", &C::train, &TrainConfig::lr, "peak learning rate"),
      key("train.min_lr", &C::train, &TrainConfig::min_lr, "cosine floor"),
      key("train.warmup", &C::train, &TrainConfig::warmup, "warmup steps"),
      key("train.weight_decay", &C::train, &TrainConfig::weight_decay, "AdamW decay (matrices)"),
      key("train.beta1", &C::train, &TrainConfig::beta1, "AdamW beta1"),
      key("train.beta2", &C::train, &TrainConfig::beta2, "AdamW beta2"),
      key("train.grad_clip", &C::train, &TrainConfig::grad_clip, "global norm clip; 0: off"),
      key("train.eval_every", &C::train, &TrainConfig::eval_every, "steps between evals"),
      key("train.eval_batches", &C::train, &TrainConfig::eval_batches, "batches per eval"),
      key("train.ce_chunk", &C::train, &TrainConfig::ce_chunk, "tokens per loss-head chunk"),
      key("train.checkpoint_every", &C::train, &TrainConfig::checkpoint_every, "steps between checkpoints"),
      key("train.keep_checkpoints", &C::train, &TrainConfig::keep_checkpoints, "newest checkpoints kept"),
      key("data.text", &C::data, &DataConfig::text, "text file; empty: King James Bible"),
      key("data.dir", &C::data, &DataConfig::dir, "prepared-corpus cache directory"),
      key("data.vocab_size", &C::data, &DataConfig::vocab_size, "BPE vocabulary size"),
      key("data.val_fraction", &C::data, &DataConfig::val_fraction, "validation share"),
      key("run.out_dir", &C::run, &RunConfig::out_dir, "where run directories go"),
      key("run.name", &C::run, &RunConfig::name, "run directory name"),
      key("run.threads", &C::run, &RunConfig::threads, "intra-op threads; 0: all cores"),
      key("run.seed", &C::run, &RunConfig::seed, "seed of init, data and dropout"),
      key("run.device", &C::run, &RunConfig::device, "cpu or cuda[:N]"),
      key("run.dtype", &C::run, &RunConfig::dtype, "float32 or bfloat16"),
      key("run.sample_tokens", &C::run, &RunConfig::sample_tokens, "tokens sampled at the end"),
      key("run.prompt", &C::run, &RunConfig::prompt, "prompt of the final sample"),
      key("run.progress", &C::run, &RunConfig::progress, "progress bar on a terminal"),
      key("run.trace", &C::run, &RunConfig::trace, "Chrome-trace JSON of step 3; empty: none"),
      key("run.expandable_segments", &C::run, &RunConfig::expandable_segments,
          "CUDA: growing allocator segments (PyTorch's expandable_segments)"),
      key("run.record_allocations", &C::run, &RunConfig::record_allocations,
          "allocation trace of the first two steps; empty: none"),
      key("parallel.dp", &C::parallel, &ParallelConfig::dp, "data-parallel ranks; 0: all launched"),
      key("parallel.tp", &C::parallel, &ParallelConfig::tp, "tensor-parallel ranks splitting each layer"),
      key("parallel.sp", &C::parallel, &ParallelConfig::sp, "sequence parallelism over the tp ranks"),
      key("parallel.timeout", &C::parallel, &ParallelConfig::timeout, "seconds before a lost rank stops all"),
      key("parallel.zero", &C::parallel, &ParallelConfig::zero, "1: shard AdamW's moments over data-parallel ranks"),
      key("parallel.pp", &C::parallel, &ParallelConfig::pp, "pipeline stages the layers split into (sets ac.stages)"),
      key("parallel.schedule", &C::parallel, &ParallelConfig::schedule, "pipeline schedule: 1f1b or gpipe"),
      key("parallel.link_rate", &C::parallel, &ParallelConfig::link_rate,
          "GB/s a rank sends in a ring all-gather (remat plan's collectives)"),
      key("parallel.compute_rate", &C::parallel, &ParallelConfig::compute_rate,
          "TFLOP/s a rank's matmuls reach (remat plan's FLOPs per second)"),
      key("parallel.link_latency", &C::parallel, &ParallelConfig::link_latency,
          "us a ring step of a collective waits (remat plan); 2: NCCL's model on NVLink"),
      key("parallel.overlap_grad_reduce", &C::parallel, &ParallelConfig::overlap_grad_reduce,
          "all-reduce gradients during the backward"),
      ac_key("ac.policy", &AcConfig::policy, "recompute policy (docs/policies.md); unset: none"),
      key("ac.budget", &C::ac, &AcConfig::budget, "memory budget: the planner picks the plan (12GiB, 0.6)"),
      key("ac.host_budget", &C::ac, &AcConfig::host_budget,
          "host memory the budget's plan may offload to (64GiB, 0.5, 0); default: free on CUDA, none on CPU"),
      key("ac.profile", &C::ac, &AcConfig::profile, "measure node times to predict step time (cached)"),
      key("ac.preserve_rng_state", &C::ac, &AcConfig::preserve_rng_state, "replay dropout RNG in recompute"),
      key("ac.allow_rng_mismatch", &C::ac, &AcConfig::allow_rng_mismatch, "allow dropout without RNG replay"),
      key("ac.check", &C::ac, &AcConfig::check, "verify recompute: none, meta or values"),
      key("ac.early_stop", &C::ac, &AcConfig::early_stop, "stop recompute once outputs exist"),
      key("ac.pool", &C::ac, &AcConfig::pool, "recompute into recycled buffers"),
      key("ac.offload_prefetch", &C::ac, &AcConfig::offload_prefetch,
          "offloaded slots come back during the layer above's backward"),
      key("ac.offload_rate", &C::ac, &AcConfig::offload_rate, "GB/s device to host and back (remat plan's copies)"),
      key("ac.offload_slowdown", &C::ac, &AcConfig::offload_slowdown,
          "share of compute lost beside copies (remat plan's)"),
      key("ac.stages", &C::ac, &AcConfig::stages, "pipeline stages the layers split into"),
      ac_key("ac.enable_activation_checkpointing", &AcConfig::enable_activation_checkpointing,
             "torchtune: true alone = full"),
      ac_key("ac.ac_mode", &AcConfig::ac_mode, "torchtune: full or selective"),
      ac_key("ac.ac_option", &AcConfig::ac_option, "torchtune: K (every:K) or op", Literal::WordOrInt),
      ac_key("ac.enable_activation_offloading", &AcConfig::enable_activation_offloading,
             "torchtune: every kept slot in host memory"),
      ac_key("ac.recompute_granularity", &AcConfig::recompute_granularity, "Megatron: full or selective"),
      ac_key("ac.recompute_method", &AcConfig::recompute_method, "Megatron: uniform or block"),
      ac_key("ac.recompute_num_layers", &AcConfig::recompute_num_layers, "Megatron: N of the method"),
      ac_key("ac.recompute_modules", &AcConfig::recompute_modules, "Megatron: selective modules", Literal::List),
      ac_key("ac.recompute_activations", &AcConfig::recompute_activations, "Megatron: selective core_attn"),
      ac_key("ac.distribute_saved_activations", &AcConfig::distribute_saved_activations,
             "Megatron: needs tensor parallelism"),
      ac_key("ac.offload_modules", &AcConfig::offload_modules, "Megatron: modules whose saved input is offloaded",
             Literal::List),
      ac_key("ac.cpu_offloading_num_layers", &AcConfig::cpu_offloading_num_layers,
             "Megatron/TransformerEngine: first N layers offloaded"),
      ac_key("ac.gradient_checkpointing_ratio", &AcConfig::gradient_checkpointing_ratio, "ColossalAI: ratio:R"),
      ac_key("ac.num_ckpt_layers_per_stage", &AcConfig::num_ckpt_layers_per_stage,
             "ColossalAI: recomputed layers per stage", Literal::List),
      ac_key("ac.num_layers_per_stage", &AcConfig::num_layers_per_stage, "ColossalAI: layers per stage", Literal::List),
      ac_key("ac.recompute_layer", &AcConfig::recompute_layer, "nanotron: true = full"),
      ac_key("ac.tp_recompute_allgather", &AcConfig::tp_recompute_allgather,
             "nanotron: gather again in the backward (parallel.sp)"),
  };
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

const ConfigKey& find_key(const std::string& name, const std::string& where) {
  const auto& keys = config_keys();
  for (const auto& k : keys) {
    if (k.name == name) return k;
  }
  // The edit distance costs the product of the lengths: a key this long is no typo.
  if (name.size() > 100) {
    fail(fmt::format("Unknown config key {}{}; `remat train --help-config` lists every key.", printable(name), where));
  }
  // Suggest the closest key, also matching a bare field name ("lr" -> "train.lr").
  const ConfigKey* best = nullptr;
  size_t best_d = SIZE_MAX;
  for (const auto& k : keys) {
    const std::string field = k.name.substr(k.name.find('.') + 1);
    size_t d = std::min(edit_distance(name, k.name), edit_distance(name, field));
    if (d < best_d) {
      best_d = d;
      best = &k;
    }
  }
  std::string msg = fmt::format("Unknown config key '{}'{}", util::clip(name), where);
  if (best != nullptr && best_d <= std::max<size_t>(3, name.size() / 3)) {
    msg += fmt::format("; did you mean '{}'?", best->name);
  } else {
    msg += "; `remat train --help-config` lists every key.";
  }
  fail(msg);
}

// A config is a few kilobytes; a megabyte is no config remat wrote or a person would.
constexpr int64_t kMaxConfigBytes = int64_t{1} << 20;

// toml++ makes a table per part of a dotted key and parses nested arrays and inline tables
// by recursion, so a key of 30,000 parts overflows the stack (SIGSEGV) before it can refuse
// it. remat's keys have two or three parts, so more than kMaxKeyParts, or brackets nested
// deeper than kMaxNesting, are refused before toml++ parses. Strings and comments are
// skipped: their dots and brackets are text.
void check_toml_nesting(const std::string& text, const std::string& path) {
  constexpr int kMaxKeyParts = 32, kMaxNesting = 32;
  int dots = 0, depth = 0;
  size_t line = 1;
  const auto refuse = [&](const std::string& what) {
    fail(
        fmt::format("Cannot read config {}: line {} {}; remat's keys have two or three parts (train.lr, "
                    "model.preset), so this is not a remat config.",
                    path, line, what));
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\n') {
      ++line;
      dots = 0;
    } else if (ch == '#') {
      const size_t end = text.find('\n', i);
      i = (end == std::string::npos ? text.size() : end) - 1;
    } else if (ch == '"' || ch == '\'') {
      const std::string triple(3, ch);
      size_t end;
      if (text.compare(i, 3, triple) == 0) {
        end = text.find(triple, i + 3);
        end = end == std::string::npos ? text.size() : end + 2;
      } else {
        end = i + 1;
        while (end < text.size() && text[end] != ch && text[end] != '\n') end += ch == '"' && text[end] == '\\' ? 2 : 1;
        if (end < text.size() && text[end] == '\n') --end;  // an unclosed string: toml++ says so
      }
      end = std::min(end, text.size() - 1);
      line += static_cast<size_t>(std::count(text.begin() + static_cast<std::ptrdiff_t>(i),
                                             text.begin() + static_cast<std::ptrdiff_t>(end) + 1, '\n'));
      i = end;
    } else if (ch == '.') {
      if (++dots >= kMaxKeyParts) refuse(fmt::format("has a key of more than {} dotted parts", kMaxKeyParts));
    } else if (ch == '[' || ch == '{') {
      dots = 0;
      if (++depth > kMaxNesting) refuse(fmt::format("nests arrays or tables more than {} deep", kMaxNesting));
    } else if (ch == ']' || ch == '}') {
      dots = 0;
      depth = std::max(0, depth - 1);
    } else if (ch == '=' || ch == ',') {
      dots = 0;
    }
  }
}

// TOML file -> ordered (key, value-as-text) pairs, tables flattened to dotted names.
void flatten(const toml::table& t, const std::string& prefix, const std::string& path,
             std::vector<std::pair<std::string, std::string>>& out) {
  for (const auto& [k, node] : t) {
    const std::string name = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = node.as_table()) {
      flatten(*sub, name, path, out);
    } else if (auto s = node.value_exact<std::string>()) {
      out.emplace_back(name, *s);
    } else if (auto b = node.value_exact<bool>()) {
      out.emplace_back(name, *b ? "true" : "false");
    } else if (auto i = node.value_exact<int64_t>()) {
      out.emplace_back(name, std::to_string(*i));
    } else if (auto d = node.value_exact<double>()) {
      out.emplace_back(name, fmt::format("{}", *d));
    } else if (const auto* arr = node.as_array()) {
      // A list key: an array of scalars becomes the comma-joined string an override gives.
      std::string joined;
      for (size_t i = 0; i < arr->size(); ++i) {
        const auto& item = *arr->get(i);
        std::string text;
        if (auto is = item.value_exact<std::string>()) {
          text = *is;
        } else if (auto ii = item.value_exact<int64_t>()) {
          text = std::to_string(*ii);
        } else if (auto id = item.value_exact<double>()) {
          text = fmt::format("{}", *id);
        } else if (auto ib = item.value_exact<bool>()) {
          text = *ib ? "true" : "false";
        } else {
          fail(fmt::format("{}: '{}' must be an array of strings, numbers or booleans.", path, name));
        }
        joined += (i ? "," : "") + text;
      }
      out.emplace_back(name, joined);
    } else {
      fail(fmt::format("{}: '{}' must be a string, number, boolean or array of them.", path, name));
    }
  }
}

}  // namespace

at::ScalarType dtype_of(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  fail(fmt::format("run.dtype must be float32 or bfloat16, got '{}'.", util::clip(name)));
}

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = make_keys();
  return keys;
}

Config load_config(const std::string& toml_path, const std::vector<std::string>& overrides) {
  std::vector<std::pair<std::string, std::string>> settings;
  std::vector<std::string> origins;
  if (!toml_path.empty()) {
    // Read here rather than by toml++: a FIFO or device is refused instead of waited on.
    const std::string text = util::read_file(toml_path, "the config", kMaxConfigBytes);
    check_toml_nesting(text, toml_path);
    toml::table table;
    try {
      table = toml::parse(text, toml_path);
    } catch (const toml::parse_error& e) {
      const auto& src = e.source();
      fail(fmt::format("Cannot read config {}: {} (line {}, column {}).", toml_path, std::string(e.description()),
                       src.begin.line, src.begin.column));
    }
    flatten(table, "", toml_path, settings);
    origins.assign(settings.size(), " in " + toml_path);
  }
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      fail(fmt::format("Override '{}' is not of the form key=value (e.g. train.lr=1e-3).", util::clip(o)));
    }
    // A TOML file is UTF-8 by its grammar (toml++ refuses other bytes); an override is not,
    // and its value would land in the run's config.toml, which could not be read back.
    const size_t bad = util::find_invalid_utf8(o);
    if (bad != std::string::npos) {
      fail(
          fmt::format("Override {} is not UTF-8 text (byte {:#04x} at offset {}); config values are UTF-8, as in a "
                      "TOML file, since a run records them in its config.toml: write it in UTF-8.",
                      printable(o), static_cast<unsigned char>(o[bad]), bad));
    }
    settings.emplace_back(o.substr(0, eq), o.substr(eq + 1));
    origins.emplace_back(" (command-line override)");
  }

  Config c;
  // The preset replaces the whole model shape, so it goes first; explicit model keys
  // then adjust it, whichever order they were written in.
  for (const auto& [k, v] : settings) {
    if (k == "model.preset") c.model = model_preset(v);
  }
  for (size_t i = 0; i < settings.size(); ++i) {
    const auto& [k, v] = settings[i];
    if (k == "model.preset") continue;
    find_key(k, origins[i]).set(c, v);
  }
  c.model.vocab_size = padded_vocab_size(c, c.model.vocab_size);
  // The real stages are the ones per-stage policies count (block:N, ratio:R, ColossalAI's lists).
  if (c.parallel.pp > 1 && c.ac.stages == 1) c.ac.stages = c.parallel.pp;
  validate_config(c);
  return c;
}

int64_t padded_vocab_size(const Config& c, int64_t vocab) {
  const int64_t multiple = c.model.vocab_multiple;
  // Far above the 64 or 128 rows accelerators want; more would pad rows for nothing.
  if (multiple < 1 || multiple > 65536) {
    fail(
        fmt::format("model.vocab_multiple must be from 1 to 65536, got {}; the vocabulary is padded to a multiple "
                    "of it times parallel.tp (1: only as far as the tensor-parallel split needs; 128 is "
                    "Megatron-LM's make_vocab_size_divisible_by).",
                    multiple));
  }
  if (vocab <= 0) return vocab;
  // load_config pads before validate_config looks at the rest, so the factors are bounded
  // here: the rounding below stays far inside int64 (a vocabulary near 2^63, or a parallel.tp
  // near 2^62, had overflowed it).
  check_tp(c);
  if (vocab > kMaxVocab) {
    fail(
        fmt::format("model.vocab_size = {} is more than 2^31 tokens; token ids are 32-bit integers (the largest "
                    "real vocabularies hold a few hundred thousand): give the tokenizer's size, or 0 to take it.",
                    vocab));
  }
  const int64_t step = multiple * c.parallel.tp;
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

void check_path(const std::string& what, const std::string& path) {
  for (size_t i = 0; i < path.size(); ++i) {
    const auto byte = static_cast<unsigned char>(path[i]);
    if (byte < 0x20 || byte == 0x7f) {
      fail(
          fmt::format("{} = {} holds a control character (byte {:#04x} at offset {}); paths must be printable "
                      "(they are written into plot scripts, logs and tables): remove it, it is usually a stray "
                      "line break in a config file or a shell variable.",
                      what, printable(path), byte, i));
    }
  }
}

void validate_config(const Config& c) {
  const auto& m = c.model;
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) fail(fmt::format("{} must be positive, got {}.", name, v));
  };
  positive("model.n_layer", m.n_layer);
  positive("model.n_head", m.n_head);
  positive("model.n_kv_head", m.n_kv_head);
  positive("model.d_model", m.d_model);
  positive("model.d_ff", m.d_ff);
  positive("model.max_seq", m.max_seq);
  positive("model.attention_tile", m.attention_tile);
  if (m.vocab_size < 0)
    fail(fmt::format("model.vocab_size must be >= 0 (0: from the tokenizer), got {}.", m.vocab_size));
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
  if (!(m.dropout >= 0.0 && m.dropout < 1.0)) {
    fail(fmt::format("model.dropout must be in [0, 1), got {}.", m.dropout));
  }
  if (m.norm_eps <= 0) fail(fmt::format("model.norm_eps must be positive, got {}.", m.norm_eps));
  if (!(m.rope_theta > 1)) {
    fail(
        fmt::format("model.rope_theta must be greater than 1 (the RoPE base: 10000 in GPT-NeoX, 500000 in Llama 3), "
                    "got {}; at or below 1 the rotation frequencies are infinite or do not decrease.",
                    m.rope_theta));
  }
  if (!(m.init_std > 0 && m.init_std <= 1)) {
    fail(
        fmt::format("model.init_std must be in (0, 1] (0.02 is usual), got {}; larger weights overflow the first "
                    "forward.",
                    m.init_std));
  }

  const auto& t = c.train;
  positive("train.steps", t.steps);
  positive("train.batch", t.batch);
  positive("train.seq", t.seq);
  positive("train.grad_accum", t.grad_accum);
  positive("train.ce_chunk", t.ce_chunk);
  positive("train.eval_batches", t.eval_batches);
  positive("train.checkpoint_every", t.checkpoint_every);
  positive("train.keep_checkpoints", t.keep_checkpoints);
  // Upper bounds far above any real run, so that counts, token totals and byte predictions
  // stay far inside int64 and a mistyped number is refused instead of running for ever.
  auto at_most = [](const char* name, int64_t v, int64_t most, const char* why) {
    if (v > most) fail(fmt::format("{} must be at most {} ({}), got {}.", name, most, why, v));
  };
  at_most("train.steps", t.steps, int64_t{1} << 30, "a billion steps");
  at_most("train.grad_accum", t.grad_accum, int64_t{1} << 16, "microbatches per step");
  at_most("train.batch", t.batch, int64_t{1} << 20, "sequences per microbatch");
  // The planner takes about 7 s at 1024 layers on one core, eight times the deepest
  // published transformer.
  at_most("model.n_layer", m.n_layer, 1024, "layers");
  at_most("model.max_seq", m.max_seq, int64_t{1} << 24, "16M tokens of context");
  // Eight times the widest published transformers (Llama 3 405B: d_model 16384, d_ff
  // 53248, 128 heads), so that no shape product can overflow before the planner counts it.
  at_most("model.d_model", m.d_model, int64_t{1} << 17, "eight times Llama 3 405B's 16384");
  at_most("model.d_ff", m.d_ff, int64_t{1} << 19, "about ten times Llama 3 405B's 53248");
  at_most("model.n_head", m.n_head, 1024, "eight times Llama 3 405B's 128 heads");
  at_most("model.n_kv_head", m.n_kv_head, 1024, "as many as model.n_head may have");
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
  at_most("train.seq", t.seq, int64_t{1} << 24, "16M tokens per sequence");
  at_most("train.eval_batches", t.eval_batches, int64_t{1} << 20, "validation microbatches");
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
  // Above 10 an AdamW step moves a weight by more than any model survives, and the
  // optimizer's float32 step size overflows long before 1e38.
  if (t.lr <= 0 || t.lr > 10 || t.min_lr < 0 || t.min_lr > t.lr) {
    fail(
        fmt::format("Learning rates must satisfy 0 <= train.min_lr <= train.lr and 0 < train.lr <= 10; "
                    "got lr {} and min_lr {}.",
                    t.lr, t.min_lr));
  }
  if (t.warmup < 0 || t.eval_every < 0) fail("train.warmup and train.eval_every must be >= 0.");
  if (t.weight_decay < 0) {
    fail(
        fmt::format("train.weight_decay must be >= 0 (0 disables it; 0.1 is usual), got {}; a negative decay grows "
                    "the weights every step.",
                    t.weight_decay));
  }
  if (t.grad_clip < 0) fail(fmt::format("train.grad_clip must be >= 0 (0 disables), got {}.", t.grad_clip));
  if (!(t.beta1 >= 0 && t.beta1 < 1 && t.beta2 >= 0 && t.beta2 < 1)) {
    fail(fmt::format("AdamW betas must be in [0, 1), got {} and {}.", t.beta1, t.beta2));
  }

  if (c.data.vocab_size < 260) {
    fail(fmt::format("data.vocab_size must be at least 260 (256 byte pieces plus specials), got {}.",
                     c.data.vocab_size));
  }
  if (!(c.data.val_fraction > 0 && c.data.val_fraction < 0.5)) {
    fail(fmt::format("data.val_fraction must be in (0, 0.5), got {}.", c.data.val_fraction));
  }
  if (c.run.threads < 0 || c.run.threads > 1024) {
    fail(fmt::format("run.threads must be in [0, 1024] (0: all cores), got {}.", c.run.threads));
  }
  dtype_of(c.run.dtype);
  if (c.run.device != "cpu" && c.run.device != "cuda" && c.run.device.rfind("cuda:", 0) != 0) {
    fail(fmt::format("run.device must be cpu or cuda[:N], got '{}'.", util::clip(c.run.device)));
  }
  if (c.run.sample_tokens < 0) fail("run.sample_tokens must be >= 0.");
  if (c.parallel.dp < 0 || c.parallel.dp > 1 << 20) {
    fail(fmt::format("parallel.dp must be in [0, 2^20] (0: every rank the launcher starts), got {}.", c.parallel.dp));
  }
  if (c.parallel.dp > 0 && t.batch % c.parallel.dp != 0) {
    fail(
        fmt::format("train.batch = {} sequences cannot be split evenly over parallel.dp = {} data-parallel ranks; "
                    "make train.batch a multiple of {} (it counts the sequences of all ranks together).",
                    t.batch, c.parallel.dp, c.parallel.dp));
  }
  check_tp(c);
  // Each rank holds an equal share of the heads and the MLP's features; the vocabulary is
  // padded instead (Megatron's padding), since real vocabularies (GPT-2's 50257) are odd.
  for (const auto& [name, size] : {std::pair<const char*, int64_t>{"model.n_head", m.n_head},
                                   {"model.n_kv_head", m.n_kv_head},
                                   {"model.d_ff", m.d_ff}}) {
    if (size % c.parallel.tp != 0) {
      fail(
          fmt::format("parallel.tp = {} gives each tensor-parallel rank an equal share of {} = {}, but {} is not a "
                      "multiple of {}; choose a parallel.tp dividing model.n_head ({}), model.n_kv_head ({}) and "
                      "model.d_ff ({}).",
                      c.parallel.tp, name, size, size, c.parallel.tp, m.n_head, m.n_kv_head, m.d_ff));
    }
  }
  const int64_t padded = padded_vocab_size(c, m.vocab_size);
  if (padded != m.vocab_size) {
    fail(
        fmt::format("model.vocab_size = {} is not padded to a multiple of model.vocab_multiple x parallel.tp = {} x "
                    "{}, so the tensor-parallel ranks cannot share its rows equally; set it to {} (load_config and "
                    "the trainer pad it so; a Config built in code must call padded_vocab_size).",
                    m.vocab_size, m.vocab_multiple, c.parallel.tp, padded));
  }
  if (c.parallel.sp && c.parallel.tp < 2) {
    fail(
        "parallel.sp = true shares each sequence's positions over the tensor-parallel ranks, but parallel.tp = 1 "
        "has one rank; set parallel.tp to 2 or more, or parallel.sp = false.");
  }
  if (c.parallel.sp && t.seq % c.parallel.tp != 0) {
    fail(
        fmt::format("parallel.sp = true gives each of the parallel.tp = {} ranks an equal share of the {} positions "
                    "of a sequence (train.seq), but {} is not a multiple of {}; choose a train.seq that is.",
                    c.parallel.tp, t.seq, t.seq, c.parallel.tp));
  }
  if (c.ac.tp_recompute_allgather && *c.ac.tp_recompute_allgather && !c.parallel.sp) {
    fail(
        "ac.tp_recompute_allgather = true keeps the sequence-parallel input of each column-parallel linear and "
        "gathers it again in the backward, but without parallel.sp = true (and parallel.tp > 1) nothing is "
        "gathered; set parallel.sp = true, or drop ac.tp_recompute_allgather.");
  }
  if (c.ac.distribute_saved_activations && *c.ac.distribute_saved_activations) {
    if (c.parallel.tp < 2) {
      fail(
          "ac.distribute_saved_activations = true keeps each recomputed layer's input as a share per "
          "tensor-parallel rank, but parallel.tp = 1 has one rank; set parallel.tp to 2 or more, or drop "
          "ac.distribute_saved_activations.");
    }
    if (c.parallel.sp) {
      fail(
          "ac.distribute_saved_activations = true shares the layers' inputs over the tensor-parallel ranks, but "
          "with parallel.sp = true they already hold a share of the positions each; drop one of the two.");
    }
  }
  // Below a few heartbeats a busy machine would name live ranks as lost.
  if (!(c.parallel.timeout >= 5 && c.parallel.timeout <= 86400)) {
    fail(fmt::format("parallel.timeout must be from 5 to 86400 seconds, got {}.", c.parallel.timeout));
  }
  // One data-parallel rank with zero = 1 is accepted (it shards over one rank: nothing),
  // so that one configuration serves any number of ranks, as parallel.dp = 0 does.
  if (c.parallel.zero != 0 && c.parallel.zero != 1) {
    fail(
        fmt::format("parallel.zero must be 0 (every data-parallel rank keeps AdamW's moments whole) or 1 (ZeRO "
                    "stage 1: each keeps the moments of its share of the parameters), got {}; stages 2 and 3 "
                    "(sharded gradients and parameters) are not implemented.",
                    c.parallel.zero));
  }
  // Both turn bytes and FLOPs into time; 1 PB/s and 1 EFLOP/s are far past any device.
  if (!(c.parallel.link_rate > 0 && c.parallel.link_rate <= 1e6)) {
    fail(
        fmt::format("parallel.link_rate must be the GB/s a rank sends at over its tensor-parallel links, above 0 and "
                    "at most 1000000, got {}; for example 20 for PCIe 4, 200 for NVLink 3, 350 for NVLink 4.",
                    c.parallel.link_rate));
  }
  if (!(c.ac.offload_rate > 0 && c.ac.offload_rate <= 1e6)) {
    fail(
        fmt::format("ac.offload_rate must be the GB/s copies move between the device and host memory, above 0 and "
                    "at most 1000000 (25 for PCIe 4, 55 for PCIe 5), got {}.",
                    c.ac.offload_rate));
  }
  if (!(c.ac.offload_slowdown >= 0 && c.ac.offload_slowdown < 1)) {
    fail(
        fmt::format("ac.offload_slowdown must be the share of each second a copy to or from host memory runs beside "
                    "the compute that the compute loses, from 0 to below 1 (0.17: it does 0.83 s of its work), got "
                    "{}.",
                    c.ac.offload_slowdown));
  }
  if (!(c.parallel.compute_rate > 0 && c.parallel.compute_rate <= 1e6)) {
    fail(
        fmt::format("parallel.compute_rate must be the TFLOP/s a rank's matmuls reach, above 0 and at most 1000000, "
                    "got {}; for example 300 for an A100 in bfloat16, 600 for an H100.",
                    c.parallel.compute_rate));
  }
  // A second a step is past any link that could carry a tensor-parallel group.
  if (!(c.parallel.link_latency >= 0 && c.parallel.link_latency <= 1e6)) {
    fail(
        fmt::format("parallel.link_latency must be the microseconds one ring step of a collective waits on the "
                    "tensor-parallel links whatever it sends, from 0 to 1000000, got {}; for example 2 for NVLink, "
                    "5 for PCIe, 10 for a network between hosts.",
                    c.parallel.link_latency));
  }
  if (c.parallel.pp < 1 || c.parallel.pp > m.n_layer) {
    fail(
        fmt::format("parallel.pp = {} pipeline stages for {} layers: every stage needs at least one layer; use 1 "
                    "(no pipeline) to {}.",
                    c.parallel.pp, m.n_layer, m.n_layer));
  }
  if (c.parallel.pp > 1 && c.ac.stages != c.parallel.pp) {
    fail(
        fmt::format("ac.stages = {} but parallel.pp = {}: with a pipeline the per-stage policies count its real "
                    "stages; drop ac.stages or set it to {}.",
                    c.ac.stages, c.parallel.pp, c.parallel.pp));
  }
  if (!c.ac.budget.empty()) {
    if (c.ac.tp_recompute_allgather && *c.ac.tp_recompute_allgather) {
      fail(
          fmt::format("ac.budget = \"{}\" lets the planner choose, per layer, whether to keep each gathered input "
                      "or gather it again, but ac.tp_recompute_allgather = true fixes that choice; keep one of "
                      "them.",
                      c.ac.budget));
    }
    if (c.ac.distribute_saved_activations && *c.ac.distribute_saved_activations) {
      fail(
          fmt::format("ac.budget = \"{}\" lets the planner choose, per layer, whether to keep its input whole or "
                      "as a share per tensor-parallel rank, but ac.distribute_saved_activations = true fixes that "
                      "choice; keep one of them.",
                      c.ac.budget));
    }
  }
  check_path("run.out_dir", c.run.out_dir);
  check_path("run.trace", c.run.trace);
  check_path("run.record_allocations", c.run.record_allocations);
  check_path("data.dir", c.data.dir);
  check_path("data.text", c.data.text);
  if (c.run.name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
          std::string::npos ||
      c.run.name == "." || c.run.name == "..") {
    fail(fmt::format("run.name may hold only letters, digits, '.', '_' and '-', got '{}'.", util::clip(c.run.name)));
  }
  // A directory name holds at most 255 bytes, and remat may add a "-N" suffix.
  if (c.run.name.size() > 200) {
    fail(
        fmt::format("run.name is {} bytes long; a run directory's name holds at most 200 (file systems allow 255, and "
                    "remat may add a suffix): give a shorter name.",
                    c.run.name.size()));
  }
}

std::string config_to_toml(const Config& c) {
  std::string out = "# remat resolved configuration\n";
  std::string section;
  for (const auto& k : config_keys()) {
    const auto dot = k.name.find('.');
    const std::string sec = k.name.substr(0, dot);
    if (sec != section) {
      out += fmt::format("\n[{}]\n", sec);
      section = sec;
    }
    const std::string value = k.get(c);
    if (value.empty()) {
      out += fmt::format("# {} = (unset)\n", k.name.substr(dot + 1));
    } else {
      out += fmt::format("{} = {}\n", k.name.substr(dot + 1), value);
    }
  }
  return out;
}

}  // namespace remat
