// The key table: every key once, with how it parses, how it is written back and the range
// a number key accepts (validate_config checks the ranges).
#include "remat/config.h"

#include "util/number.h"
#include "util/utf8.h"

#include <fmt/format.h>

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
    fail(fmt::format("{} must be {}, got '{}'.", key, std::is_integral_v<T> ? "an integer" : "a number",
                     util::printable(v)));
  }
  return *out;
}

bool parse_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "1" || v == "on") return true;
  if (v == "false" || v == "0" || v == "off") return false;
  fail(fmt::format("{} must be true or false, got '{}'.", key, util::printable(v)));
}

Arch parse_arch(const std::string& key, const std::string& v) {
  if (v == "gpt2") return Arch::gpt2;
  if (v == "llama") return Arch::llama;
  fail(fmt::format("{} must be gpt2 or llama, got '{}'.", key, util::printable(v)));
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
                  key, util::printable(v)));
}

LossHead parse_loss_head(const std::string& key, const std::string& v) {
  if (v == "fused") return LossHead::fused;
  if (v == "recompute") return LossHead::recompute;
  if (v == "auto") return LossHead::automatic;
  fail(
      fmt::format("{} must be fused (the logits' gradient computed in the forward: one product fewer), "
                  "recompute (the logits recomputed in the backward: vocab x d_model fewer bytes kept) or auto "
                  "(the planner chooses one of them for the run's budget), got '{}'.",
                  key, util::printable(v)));
}

CommBackend parse_comm_backend(const std::string& key, const std::string& v) {
  if (v == "auto") return CommBackend::automatic;
  if (v == "nccl") return CommBackend::nccl;
  if (v == "gloo") return CommBackend::gloo;
  fail(
      fmt::format("{} must be auto (NCCL for ranks on distinct GPUs where this build has it, Gloo otherwise), "
                  "nccl (CUDA ranks, one per GPU) or gloo (CPU ranks, or CUDA ranks through the host, several to a "
                  "GPU if need be), got '{}'.",
                  key, util::printable(v)));
}

ShardingStrategy parse_sharding_strategy(const std::string& key, const std::string& v) {
  for (const ShardingStrategy s : {ShardingStrategy::no_shard, ShardingStrategy::optim, ShardingStrategy::optim_grads,
                                   ShardingStrategy::optim_grads_params}) {
    if (v == sharding_strategy_name(s)) return s;
  }
  fail(
      fmt::format("{} must be no_shard (parallel.zero = 0), optim (1: AdamW's moments sharded), optim_grads (2: the "
                  "gradients too) or optim_grads_params (3: the parameters too), got '{}'.",
                  key, util::printable(v)));
}

Reshard parse_reshard(const std::string& key, const std::string& v) {
  if (v == "auto" || v == "default") return Reshard::automatic;
  if (v == "always") return Reshard::always;
  if (v == "never") return Reshard::never;
  fail(
      fmt::format("{} must be auto (or torchtitan's default: a budget plan chooses per layer whether its gathered "
                  "weights stay until its backward; a named policy gathers them again), always (every layer gathers "
                  "its weights again for its backward) or never (every layer keeps them, but in a uniform chunk), "
                  "got '{}'.",
                  key, util::printable(v)));
}

DataFormat parse_data_format(const std::string& key, const std::string& v) {
  if (v == "text") return DataFormat::text;
  if (v == "jsonl") return DataFormat::jsonl;
  if (v == "tokens") return DataFormat::tokens;
  fail(
      fmt::format("{} must be text (UTF-8 text files), jsonl (one JSON object per line, data.field holding the "
                  "text) or tokens (llm.c or nanoGPT .bin shards, or Megatron's indexed dataset: a .bin beside "
                  "its .idx), got '{}'.",
                  key, util::printable(v)));
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

// A key over the field `at` reaches in a Config (a generic lambda, so that one accessor
// serves the setter and the const getter).
template <class T, class At>
ConfigKey key_at(std::string name, At at, std::string help, std::optional<KeyRange> range) {
  ConfigKey k;
  k.name = name;
  k.help = std::move(help);
  k.range = std::move(range);
  k.set = [name, at](Config& c, const std::string& v) {
    T& dst = at(c);
    if constexpr (std::is_same_v<T, std::string>) {
      dst = v;
    } else if constexpr (std::is_same_v<T, Arch>) {
      dst = parse_arch(name, v);
    } else if constexpr (std::is_same_v<T, Attention>) {
      dst = parse_attention(name, v);
    } else if constexpr (std::is_same_v<T, LossHead>) {
      dst = parse_loss_head(name, v);
    } else if constexpr (std::is_same_v<T, DataFormat>) {
      dst = parse_data_format(name, v);
    } else if constexpr (std::is_same_v<T, CommBackend>) {
      dst = parse_comm_backend(name, v);
    } else if constexpr (std::is_same_v<T, Reshard>) {
      dst = parse_reshard(name, v);
    } else if constexpr (std::is_same_v<T, pipeline::Schedule>) {
      dst = pipeline::schedule_of_name(v);
    } else if constexpr (std::is_same_v<T, c10::Device>) {
      dst = device_of(v);
    } else if constexpr (std::is_same_v<T, bool>) {
      dst = parse_bool(name, v);
    } else if constexpr (std::is_integral_v<T>) {
      dst = parse_number<int64_t>(name, v);
    } else {
      dst = parse_number<double>(name, v);
    }
  };
  k.get = [at](const Config& c) {
    const T& src = at(c);
    if constexpr (std::is_same_v<T, std::string>) {
      return quote(src);
    } else if constexpr (std::is_same_v<T, Arch>) {
      return quote(arch_name(src));
    } else if constexpr (std::is_same_v<T, Attention>) {
      return quote(attention_name(src));
    } else if constexpr (std::is_same_v<T, LossHead>) {
      return quote(loss_head_name(src));
    } else if constexpr (std::is_same_v<T, DataFormat>) {
      return quote(data_format_name(src));
    } else if constexpr (std::is_same_v<T, CommBackend>) {
      return quote(comm_backend_name(src));
    } else if constexpr (std::is_same_v<T, Reshard>) {
      return quote(reshard_name(src));
    } else if constexpr (std::is_same_v<T, pipeline::Schedule>) {
      return quote(pipeline::schedule_name(src));
    } else if constexpr (std::is_same_v<T, c10::Device>) {
      return quote(src.str());
    } else if constexpr (std::is_same_v<T, bool>) {
      return std::string(src ? "true" : "false");
    } else if constexpr (std::is_integral_v<T>) {
      return std::to_string(src);
    } else {
      return number(src);
    }
  };
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    k.number = [at](const Config& c) { return static_cast<double>(at(c)); };
  }
  return k;
}

// Member-pointer adaptors: one line per key in the tables below.
template <class S, class T>
ConfigKey key(std::string name, S Config::*section, T S::*field, std::string help,
              std::optional<KeyRange> range = std::nullopt) {
  return key_at<T>(
      std::move(name), [ section, field ](auto& c) -> auto& { return c.*section.*field; }, std::move(help),
      std::move(range));
}
template <class S, class N, class T>
ConfigKey key(std::string name, S Config::*section, N S::*nested, T N::*field, std::string help,
              std::optional<KeyRange> range = std::nullopt) {
  return key_at<T>(
      std::move(name), [ section, nested, field ](auto& c) -> auto& { return c.*section.*nested.*field; },
      std::move(help), std::move(range));
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

// How an optional alias key's string is written back.
enum class Literal { Plain, List, WordOrInt };

// An optional alias key of a section: unset until given; an empty value unsets it again.
template <class S, class T>
ConfigKey alias_key(std::string name, S Config::*section, std::optional<T> S::*field, std::string help,
                    Literal literal = Literal::Plain) {
  ConfigKey k;
  k.name = name;
  k.help = std::move(help);
  k.set = [name, section, field](Config& c, const std::string& v) {
    std::optional<T>& dst = c.*section.*field;
    if (v.empty()) {
      dst.reset();
    } else if constexpr (std::is_same_v<T, std::string>) {
      dst = v;
    } else if constexpr (std::is_same_v<T, ShardingStrategy>) {
      dst = parse_sharding_strategy(name, v);
    } else if constexpr (std::is_same_v<T, Reshard>) {
      dst = parse_reshard(name, v);
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
    const std::optional<T>& src = c.*section.*field;
    if (!src) return "";
    if constexpr (std::is_same_v<T, std::string>) {
      if (literal == Literal::List) return list_literal(*src);
      if (literal == Literal::WordOrInt && !src->empty() && src->find_first_not_of("0123456789") == std::string::npos) {
        return *src;
      }
      return quote(*src);
    } else if constexpr (std::is_same_v<T, ShardingStrategy>) {
      return quote(sharding_strategy_name(*src));
    } else if constexpr (std::is_same_v<T, Reshard>) {
      return quote(reshard_name(*src));
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

template <class T>
ConfigKey ac_key(std::string name, std::optional<T> AcConfig::*field, std::string help,
                 Literal literal = Literal::Plain) {
  return alias_key(std::move(name), &Config::ac, field, std::move(help), literal);
}

using C = Config;

// GCC (-Wextra) warns of each member a designated initializer leaves to its default, which
// the ranges below do on purpose.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif

// RoPE's base and Llama 3.1's scaling of it (llama).
std::vector<ConfigKey> rope_keys() {
  return {
      key("model.rope_theta", &C::model, &ModelConfig::rope_theta, "RoPE base (llama)",
          KeyRange{.min = 1,
                   .above_min = true,
                   .why = "at or below 1 the rotation frequencies are infinite or do not decrease",
                   .example = "10000 (GPT-NeoX), 500000 (Llama 3)"}),
      key("model.rope_scaling.factor", &C::model, &ModelConfig::rope_scaling, &RopeScaling::factor,
          "llama3 RoPE scaling: stretch of long wavelengths; 1: unscaled",
          KeyRange{.min = 1,
                   .max = 1024,
                   .why = "it stretches the context; below 1 it would shrink it, and 1024 is far past any model's",
                   .example = "8 (Llama 3.1), 32 (Llama 3.2 1B and 3B)"}),
      key("model.rope_scaling.low_freq_factor", &C::model, &ModelConfig::rope_scaling, &RopeScaling::low_freq_factor,
          "llama3 RoPE scaling: wavelengths above original_max_seq / this are stretched",
          KeyRange{.min = 0, .above_min = true, .why = "it divides original_max_seq", .example = "1"}),
      key("model.rope_scaling.high_freq_factor", &C::model, &ModelConfig::rope_scaling, &RopeScaling::high_freq_factor,
          "llama3 RoPE scaling: wavelengths below original_max_seq / this are kept",
          KeyRange{.min = 0, .above_min = true, .why = "it divides original_max_seq", .example = "4"}),
      key("model.rope_scaling.original_max_seq", &C::model, &ModelConfig::rope_scaling, &RopeScaling::original_max_seq,
          "llama3 RoPE scaling: the context first trained at",
          KeyRange{.min = 1,
                   .max = 16777216,
                   .unit = "tokens",
                   .why = "16M tokens of context is far past any published model's",
                   .example = "8192 (Llama 3)"}),
  };
}

// Upper bounds on counts and sizes lie far above any real run, so that counts, token totals
// and byte predictions stay far inside int64 and a mistyped number is refused instead of
// running for ever. The widths are eight times the widest published transformer's (Llama 3
// 405B: d_model 16384, d_ff 53248, 128 heads), so that no shape product can overflow
// before the planner counts it.
std::vector<ConfigKey> model_keys() {
  std::vector<ConfigKey> keys{
      key("model.preset", &C::model, &ModelConfig::preset, "model preset the shape starts from"),
      key("model.init", &C::model, &ModelConfig::init, "weights to start from: .safetensors or HF model folder"),
      key("model.arch", &C::model, &ModelConfig::arch, "gpt2 or llama"),
      key("model.n_layer", &C::model, &ModelConfig::n_layer, "transformer blocks",
          KeyRange{.min = 1,
                   .max = 1024,
                   .unit = "layers",
                   .why = "1024 is eight times the deepest published transformer",
                   .example = "12 (GPT-2), 32 (Llama 3 8B)"}),
      key("model.n_head", &C::model, &ModelConfig::n_head, "attention (query) heads",
          KeyRange{.min = 1,
                   .max = 1024,
                   .unit = "heads",
                   .why = "1024 is eight times Llama 3 405B's 128",
                   .example = "12 (GPT-2), 32 (Llama 3 8B)"}),
      key("model.n_kv_head", &C::model, &ModelConfig::n_kv_head, "key/value heads (llama GQA)",
          KeyRange{.min = 1, .max = 1024, .unit = "heads", .why = "as many as model.n_head may have"}),
      key("model.d_model", &C::model, &ModelConfig::d_model, "hidden size",
          KeyRange{.min = 1,
                   .max = 131072,
                   .why = "131072 is eight times Llama 3 405B's 16384",
                   .example = "768 (GPT-2), 4096 (Llama 3 8B)"}),
      key("model.d_ff", &C::model, &ModelConfig::d_ff, "MLP hidden size",
          KeyRange{.min = 1,
                   .max = 524288,
                   .why = "524288 is about ten times Llama 3 405B's 53248",
                   .example = "3072 (GPT-2), 14336 (Llama 3 8B)"}),
      key("model.vocab_size", &C::model, &ModelConfig::vocab_size,
          "0: from the tokenizer; padded to vocab_multiple x tp",
          KeyRange{.min = 0,
                   .max = 2147483648.0,
                   .why = "0 takes the tokenizer's, and token ids are 32-bit integers",
                   .example = "50257 (GPT-2)"}),
      key("model.vocab_multiple", &C::model, &ModelConfig::vocab_multiple,
          "pad the vocabulary to a multiple of this x tp",
          KeyRange{.min = 1,
                   .max = 65536,
                   .why = "the vocabulary is padded to a multiple of it times parallel.tp (1: only as far as the "
                          "tensor-parallel split needs; 128 is Megatron-LM's make_vocab_size_divisible_by)"}),
      key("model.max_seq", &C::model, &ModelConfig::max_seq, "context length",
          KeyRange{.min = 1,
                   .max = 16777216,
                   .unit = "tokens",
                   .why = "16M tokens of context is far past any published model's",
                   .example = "1024 (GPT-2), 8192 (Llama 3)"}),
      key("model.attention", &C::model, &ModelConfig::attention, "tiled, math, sdpa or auto attention"),
      key("model.attention_tile", &C::model, &ModelConfig::attention_tile, "tiled attention: positions per tile",
          KeyRange{.min = 1, .example = "64"}),
      key("model.loss_head", &C::model, &ModelConfig::loss_head, "fused, recompute or auto loss head"),
      key("model.dropout", &C::model, &ModelConfig::dropout, "dropout probability",
          KeyRange{.min = 0, .max = 1, .below_max = true, .why = "at 1 nothing passes", .example = "0.1, or 0"}),
      key("model.norm_eps", &C::model, &ModelConfig::norm_eps, "norm epsilon",
          KeyRange{.min = 0, .above_min = true, .why = "it keeps the norms' division finite", .example = "1e-5"}),
      key("model.tie_embeddings", &C::model, &ModelConfig::tie_embeddings,
          "the head is the embedding's matrix; false: lm_head.weight"),
      key("model.init_std", &C::model, &ModelConfig::init_std, "weight init std",
          KeyRange{.min = 0,
                   .max = 1,
                   .above_min = true,
                   .why = "larger weights overflow the first forward",
                   .example = "0.02"}),
  };
  for (ConfigKey& k : rope_keys()) keys.push_back(std::move(k));
  return keys;
}

std::vector<ConfigKey> train_keys() {
  return {
      key("train.steps", &C::train, &TrainConfig::steps, "optimizer steps",
          KeyRange{.min = 1, .max = 1073741824, .unit = "steps", .why = "a billion is far past any run"}),
      key("train.batch", &C::train, &TrainConfig::batch, "sequences per microbatch",
          KeyRange{.min = 1, .max = 1048576, .unit = "sequences", .why = "a million is far past any microbatch"}),
      key("train.seq", &C::train, &TrainConfig::seq, "tokens per sequence",
          KeyRange{.min = 1, .max = 16777216, .unit = "tokens", .why = "16M tokens is far past any model's context"}),
      key("train.grad_accum", &C::train, &TrainConfig::grad_accum, "microbatches per step",
          KeyRange{.min = 1, .max = 65536, .unit = "microbatches", .why = "65536 a step is far past any run"}),
      // Above 10 the optimizer's float32 step size overflows long before 1e38.
      key("train.lr", &C::train, &TrainConfig::lr, "peak learning rate",
          KeyRange{.min = 0,
                   .max = 10,
                   .above_min = true,
                   .why = "above 10 an AdamW step moves a weight by more than any model survives",
                   .example = "3e-4"}),
      key("train.min_lr", &C::train, &TrainConfig::min_lr, "cosine floor",
          KeyRange{.min = 0, .why = "the cosine schedule decays to it", .example = "a tenth of train.lr"}),
      key("train.warmup", &C::train, &TrainConfig::warmup, "warmup steps", KeyRange{.min = 0, .unit = "steps"}),
      key("train.weight_decay", &C::train, &TrainConfig::weight_decay, "AdamW decay (matrices)",
          KeyRange{.min = 0, .why = "a negative decay grows the weights every step", .example = "0.1, or 0 (off)"}),
      key("train.beta1", &C::train, &TrainConfig::beta1, "AdamW beta1",
          KeyRange{
              .min = 0, .max = 1, .below_max = true, .why = "at 1 the moving average never moves", .example = "0.9"}),
      key("train.beta2", &C::train, &TrainConfig::beta2, "AdamW beta2",
          KeyRange{.min = 0,
                   .max = 1,
                   .below_max = true,
                   .why = "at 1 the moving average never moves",
                   .example = "0.95, 0.999"}),
      key("train.grad_clip", &C::train, &TrainConfig::grad_clip, "global norm clip; 0: off",
          KeyRange{.min = 0, .why = "0 turns clipping off", .example = "1"}),
      key("train.eval_every", &C::train, &TrainConfig::eval_every, "steps between evals",
          KeyRange{.min = 0, .unit = "steps", .why = "0 evaluates only at the end"}),
      key("train.eval_batches", &C::train, &TrainConfig::eval_batches, "batches per eval",
          KeyRange{.min = 1, .max = 1048576, .unit = "microbatches", .why = "a million is far past any evaluation"}),
      key("train.ce_chunk", &C::train, &TrainConfig::ce_chunk, "tokens per loss-head chunk",
          KeyRange{.min = 1, .example = "1024"}),
      key("train.checkpoint_every", &C::train, &TrainConfig::checkpoint_every, "steps between checkpoints",
          KeyRange{.min = 1, .example = "200"}),
      key("train.keep_checkpoints", &C::train, &TrainConfig::keep_checkpoints, "newest checkpoints kept",
          KeyRange{.min = 1, .example = "2"}),
  };
}

std::vector<ConfigKey> data_and_run_keys() {
  return {
      key("data.text", &C::data, &DataConfig::text, "file or glob to train on; empty: King James Bible"),
      key("data.format", &C::data, &DataConfig::format, "text, jsonl or tokens (.bin shards, .bin + .idx)"),
      key("data.field", &C::data, &DataConfig::field, "jsonl: the field holding each document"),
      key("data.dir", &C::data, &DataConfig::dir, "prepared-corpus cache directory"),
      key("data.tokenizer", &C::data, &DataConfig::tokenizer,
          "tokenizer.json, .model or model folder; empty: train one"),
      key("data.vocab_size", &C::data, &DataConfig::vocab_size, "BPE vocabulary size",
          KeyRange{.min = 260, .unit = "pieces", .why = "256 byte pieces plus the specials", .example = "2048"}),
      key("data.val_fraction", &C::data, &DataConfig::val_fraction, "validation share",
          KeyRange{.min = 0,
                   .max = 0.5,
                   .above_min = true,
                   .below_max = true,
                   .why = "it is the share of the corpus held out for validation",
                   .example = "0.05"}),
      key("run.out_dir", &C::run, &RunConfig::out_dir, "where run directories go"),
      key("run.name", &C::run, &RunConfig::name, "run directory name"),
      key("run.threads", &C::run, &RunConfig::threads, "intra-op threads; 0: all cores",
          KeyRange{.min = 0, .max = 1024, .why = "0 takes all cores"}),
      key("run.seed", &C::run, &RunConfig::seed, "seed of init, data and dropout"),
      key("run.device", &C::run, &RunConfig::device, "cpu or cuda[:N]"),
      key("run.dtype", &C::run, &RunConfig::dtype, "float32 or bfloat16"),
      key("run.sample_tokens", &C::run, &RunConfig::sample_tokens, "tokens sampled at the end",
          KeyRange{.min = 0,
                   .max = 10000,
                   .unit = "tokens",
                   .why = "the final sample is a glance at the model (0 samples nothing); `remat generate --tokens` "
                          "writes up to 100000 from the run's weights"}),
      key("run.prompt", &C::run, &RunConfig::prompt, "prompt of the final sample"),
      key("run.progress", &C::run, &RunConfig::progress, "progress bar on a terminal"),
      key("run.trace", &C::run, &RunConfig::trace, "Chrome-trace JSON of step 3; empty: none"),
      key("run.expandable_segments", &C::run, &RunConfig::expandable_segments,
          "CUDA: growing allocator segments (PyTorch's expandable_segments)"),
      key("run.record_allocations", &C::run, &RunConfig::record_allocations,
          "allocation trace of the first two steps; empty: none"),
  };
}

// A rate `remat plan` turns bytes or FLOPs into time with: above 0, and at most 10^6 (1 PB/s
// and 1 EFLOP/s are far past any device).
// Below a thousandth of the unit a copy or a step would take years, printed in 30 digits.
KeyRange rate(std::string unit, std::string why, std::string example) {
  return KeyRange{
      .min = 1e-3, .max = 1e6, .unit = std::move(unit), .why = std::move(why), .example = std::move(example)};
}

// Microseconds a ring step of a collective over `links` waits, whatever it sends: a
// second is past any link that could carry a parallel group.
KeyRange latency(const std::string& links, std::string example) {
  return KeyRange{.min = 0,
                  .max = 1e6,
                  .unit = "microseconds",
                  .why = "it is what one ring step of a collective waits on the " + links + " links, whatever it sends",
                  .example = std::move(example)};
}

std::vector<ConfigKey> parallel_keys() {
  using P = ParallelConfig;
  return {
      key("parallel.dp", &C::parallel, &P::dp, "data-parallel ranks; 0: all launched",
          KeyRange{.min = 0, .max = 1048576, .why = "0 takes every rank the launcher starts"}),
      key("parallel.tp", &C::parallel, &P::tp, "tensor-parallel ranks splitting each layer",
          KeyRange{.min = 1, .max = 1024, .unit = "tensor-parallel ranks"}),
      key("parallel.sp", &C::parallel, &P::sp, "sequence parallelism over the tp ranks"),
      key("parallel.timeout", &C::parallel, &P::timeout, "seconds before a lost rank stops all",
          KeyRange{.min = 5,
                   .max = 86400,
                   .unit = "seconds",
                   .why = "below a few heartbeats a busy machine would name live ranks as lost"}),
      key("parallel.zero", &C::parallel, &P::zero,
          "1: shard AdamW's moments over data-parallel ranks; 2: their gradients too; 3: the weights too",
          KeyRange{.min = 0,
                   .max = 3,
                   .why = "0 keeps AdamW's moments, the gradients and the weights whole on every data-parallel "
                          "rank, 1 (ZeRO stage 1) keeps each rank's share of the moments, 2 (ZeRO stage 2) of the "
                          "gradients too, 3 (ZeRO stage 3) of the weights too"}),
      key("parallel.pp", &C::parallel, &P::pp, "pipeline stages the layers split into (sets ac.stages)"),
      key("parallel.schedule", &C::parallel, &P::schedule, "pipeline schedule: 1f1b or gpipe"),
      key("parallel.link_rate", &C::parallel, &P::link_rate,
          "GB/s a rank sends in a ring all-gather (remat plan's collectives)",
          rate("GB/s", "it is the rate a rank sends at over its tensor-parallel links",
               "20 for PCIe 4, 200 for NVLink 3, 350 for NVLink 4")),
      key("parallel.compute_rate", &C::parallel, &P::compute_rate,
          "TFLOP/s a rank's matmuls reach (remat plan's FLOPs per second)",
          rate("TFLOP/s", "it is the rate one rank's matmuls reach", "300 for an A100 in bfloat16, 600 for an H100")),
      key("parallel.link_latency", &C::parallel, &P::link_latency,
          "us a ring step of a collective waits (remat plan); 2: NCCL's model on NVLink",
          latency("tensor-parallel", "2 for NVLink, 5 for PCIe, 10 for a network between hosts")),
      key("parallel.dp_link_rate", &C::parallel, &P::dp_link_rate,
          "GB/s a rank sends in a ring all-gather over the data-parallel links (remat plan)",
          rate("GB/s", "it is the rate a rank sends at over its data-parallel links",
               "350 for NVLink 4 within a host, 50 for 400 Gb/s InfiniBand between hosts")),
      key("parallel.dp_link_latency", &C::parallel, &P::dp_link_latency,
          "us a ring step of a data-parallel collective waits (remat plan)",
          latency("data-parallel", "2 for NVLink, 10 for a network between hosts")),
      key("parallel.backend", &C::parallel, &P::backend,
          "collectives' library: auto, nccl (CUDA ranks, one per GPU) or gloo (CPU, or CUDA through the host)"),
      key("parallel.overlap_grad_reduce", &C::parallel, &P::overlap_grad_reduce,
          "all-reduce gradients during the backward"),
      alias_key("parallel.use_distributed_optimizer", &C::parallel, &P::use_distributed_optimizer,
                "Megatron: true = parallel.zero 1 or above"),
      alias_key("parallel.data_parallel_sharding_strategy", &C::parallel, &P::data_parallel_sharding_strategy,
                "Megatron-FSDP: no_shard, optim, optim_grads, optim_grads_params = parallel.zero 0 to 3"),
      key("parallel.reshard_after_forward", &C::parallel, &P::reshard_after_forward,
          "ZeRO-3: auto (a budget plan chooses per layer), always (each layer gathers its weights again for its "
          "backward) or never (each keeps them)"),
      alias_key("parallel.fsdp_reshard_after_forward", &C::parallel, &P::fsdp_reshard_after_forward,
                "torchtitan: default, always, never = parallel.reshard_after_forward auto, always, never"),
  };
}

std::vector<ConfigKey> ac_keys() {
  return {
      ac_key("ac.policy", &AcConfig::policy, "recompute policy (docs/policies.md); unset: none"),
      key("ac.budget", &C::ac, &AcConfig::budget, "memory budget: the planner picks the plan (12GiB, 0.6)"),
      key("ac.host_budget", &C::ac, &AcConfig::host_budget,
          "host memory a plan may offload to (64GiB, 0.5, 0); default: free on CUDA or for an offload policy, else "
          "none"),
      key("ac.profile", &C::ac, &AcConfig::profile, "measure node times to predict step time (cached)"),
      key("ac.preserve_rng_state", &C::ac, &AcConfig::preserve_rng_state, "replay dropout RNG in recompute"),
      key("ac.allow_rng_mismatch", &C::ac, &AcConfig::allow_rng_mismatch, "allow dropout without RNG replay"),
      key("ac.check", &C::ac, &AcConfig::check, "verify recompute: none, meta or values"),
      key("ac.early_stop", &C::ac, &AcConfig::early_stop, "stop recompute once outputs exist"),
      key("ac.pool", &C::ac, &AcConfig::pool, "recompute into recycled buffers"),
      key("ac.offload_prefetch", &C::ac, &AcConfig::offload_prefetch,
          "offloaded slots come back during the layer above's backward"),
      key("ac.offload_rate", &C::ac, &AcConfig::offload_rate, "GB/s device to host and back (remat plan's copies)",
          rate("GB/s", "it is the rate copies move at between the device and host memory",
               "25 for PCIe 4, 55 for PCIe 5")),
      key("ac.offload_slowdown", &C::ac, &AcConfig::offload_slowdown,
          "share of compute lost beside copies (remat plan's)",
          KeyRange{.min = 0,
                   .max = 1,
                   .below_max = true,
                   .why = "it is the share of each second a copy to or from host memory runs beside the compute "
                          "that the compute loses",
                   .example = "0.17 (the compute does 0.83 s of its work in each such second)"}),
      key("ac.stages", &C::ac, &AcConfig::stages, "pipeline stages the layers split into"),
  };
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

std::vector<ConfigKey> ac_alias_keys() {
  using A = AcConfig;
  return {
      ac_key("ac.enable_activation_checkpointing", &A::enable_activation_checkpointing, "torchtune: true alone = full"),
      ac_key("ac.ac_mode", &A::ac_mode, "torchtune: full or selective"),
      ac_key("ac.ac_option", &A::ac_option, "torchtune: K (every:K) or op", Literal::WordOrInt),
      ac_key("ac.enable_activation_offloading", &A::enable_activation_offloading,
             "torchtune: every kept slot in host memory"),
      ac_key("ac.recompute_granularity", &A::recompute_granularity, "Megatron: full or selective"),
      ac_key("ac.recompute_method", &A::recompute_method, "Megatron: uniform or block"),
      ac_key("ac.recompute_num_layers", &A::recompute_num_layers, "Megatron: N of the method"),
      ac_key("ac.recompute_modules", &A::recompute_modules, "Megatron: selective modules", Literal::List),
      ac_key("ac.recompute_activations", &A::recompute_activations, "Megatron: selective core_attn"),
      ac_key("ac.distribute_saved_activations", &A::distribute_saved_activations, "Megatron: needs tensor parallelism"),
      ac_key("ac.offload_modules", &A::offload_modules, "Megatron: modules whose saved input is offloaded",
             Literal::List),
      ac_key("ac.cpu_offloading_num_layers", &A::cpu_offloading_num_layers,
             "Megatron/TransformerEngine: first N layers offloaded"),
      ac_key("ac.gradient_checkpointing_ratio", &A::gradient_checkpointing_ratio, "ColossalAI: ratio:R"),
      ac_key("ac.num_ckpt_layers_per_stage", &A::num_ckpt_layers_per_stage, "ColossalAI: recomputed layers per stage",
             Literal::List),
      ac_key("ac.num_layers_per_stage", &A::num_layers_per_stage, "ColossalAI: layers per stage", Literal::List),
      ac_key("ac.recompute_layer", &A::recompute_layer, "nanotron: true = full"),
      ac_key("ac.tp_recompute_allgather", &A::tp_recompute_allgather,
             "nanotron: gather again in the backward (parallel.sp)"),
  };
}

std::vector<ConfigKey> make_keys() {
  std::vector<ConfigKey> keys;
  for (auto section : {model_keys(), train_keys(), data_and_run_keys(), parallel_keys(), ac_keys(), ac_alias_keys()}) {
    for (auto& k : section) keys.push_back(std::move(k));
  }
  return keys;
}

}  // namespace

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = make_keys();
  return keys;
}

}  // namespace remat
