// The names configs spell the model's enums with, beside nothing else, so that whatever
// prints a plan or a config (src/policy, src/run) names them without the config's loader.
#include "remat/attention.h"
#include "remat/config.h"

namespace remat {

const char* arch_name(Arch a) { return a == Arch::gpt2 ? "gpt2" : "llama"; }

const char* loss_head_name(LossHead h) {
  return h == LossHead::fused ? "fused" : h == LossHead::recompute ? "recompute" : "auto";
}

const char* comm_backend_name(CommBackend b) {
  return b == CommBackend::nccl ? "nccl" : b == CommBackend::gloo ? "gloo" : "auto";
}

const char* sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::no_shard:
      return "no_shard";
    case ShardingStrategy::optim:
      return "optim";
    case ShardingStrategy::optim_grads:
      return "optim_grads";
    case ShardingStrategy::optim_grads_params:
      return "optim_grads_params";
  }
  return "?";
}

const char* reshard_name(Reshard r) { return r == Reshard::always ? "always" : r == Reshard::never ? "never" : "auto"; }

const char* data_format_name(DataFormat f) {
  return f == DataFormat::text ? "text" : f == DataFormat::jsonl ? "jsonl" : "tokens";
}

const char* attention_name(Attention a) {
  switch (a) {
    case Attention::math:
      return "math";
    case Attention::tiled:
      return "tiled";
    case Attention::sdpa:
      return "sdpa";
    case Attention::automatic:
      return "auto";
  }
  return "?";
}

}  // namespace remat
