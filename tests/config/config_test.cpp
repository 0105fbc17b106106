#include "util/error_of.h"
#include "config/changed_keys.h"
#include "remat/config.h"
#include "remat/policy.h"
#include "remat/ops/tiled_attention.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace remat {
namespace {

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::exception>(f); }

std::string write_temp(const std::string& text) {
  char name[] = "/tmp/remat-config-XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(name) << text;
  return name;
}

TEST(Config, DefaultsAreValidAndRoundTripThroughToml) {
  const Config c = load_config("", {});
  EXPECT_EQ(c.model.preset, "gpt2-demo");
  EXPECT_TRUE(c.ac.pool);
  const std::string path = write_temp(config_to_toml(c));
  const Config again = load_config(path, {});
  EXPECT_EQ(config_to_toml(again), config_to_toml(c));
  std::remove(path.c_str());
}

// What a resumed run says of a hand-edited config.toml: each changed key, the ignored ones
// left out, an unset key named as such.
TEST(Config, ChangedKeysNameEachEditedValue) {
  const Config c = load_config("", {});
  const Config edited = load_config("", {"train.lr=0.5", "run.seed=7", "run.sample_tokens=3", "ac.budget=1GiB"});
  const auto changes = changed_keys(config_to_toml(c), config_to_toml(edited), {"run.sample_tokens"});
  ASSERT_EQ(changes.size(), 3u) << fmt::format("{}", fmt::join(changes, "; "));
  EXPECT_EQ(changes[0].rfind("train.lr = 0.", 0), 0u) << changes[0];
  EXPECT_EQ(changes[0].substr(changes[0].size() - 7), " -> 0.5") << changes[0];
  EXPECT_EQ(changes[1], "run.seed = " + std::to_string(c.run.seed) + " -> 7");
  EXPECT_EQ(changes[2], "ac.budget = \"\" -> \"1GiB\"");
  EXPECT_TRUE(changed_keys(config_to_toml(c), config_to_toml(c), {}).empty());
}

TEST(Config, OverridesWinOverTheFileAndPresetGoesFirst) {
  const std::string path = write_temp("[model]\nn_layer = 3\npreset = \"tiny-llama\"\n[train]\nlr = 0.01\n");
  const Config c = load_config(path, {"train.lr=0.002", "model.d_model=64", "train.seq=16", "ac.pool=false"});
  EXPECT_EQ(c.model.arch, Arch::llama);  // from the preset
  EXPECT_EQ(c.model.n_layer, 3);         // the file's key, though written before the preset
  EXPECT_EQ(c.model.d_model, 64);        // override
  EXPECT_DOUBLE_EQ(c.train.lr, 0.002);
  EXPECT_FALSE(c.ac.pool);
  std::remove(path.c_str());
}

TEST(Config, UnknownKeySuggestsTheNearestValidKey) {
  EXPECT_EQ(error_of([] { load_config("", {"train.lrr=1"}); }),
            "Unknown config key 'train.lrr' (command-line override); did you mean 'train.lr'?");
  EXPECT_NE(error_of([] { load_config("", {"model.nlayer=2"}); }).find("did you mean 'model.n_layer'?"),
            std::string::npos);
  const std::string path = write_temp("[train]\nstepz = 3\n");
  EXPECT_NE(error_of([&] { load_config(path, {}); }).find("did you mean 'train.steps'?"), std::string::npos);
  std::remove(path.c_str());
}

TEST(Config, BadValuesAndShapesAreRefusedWithSentences) {
  EXPECT_EQ(error_of([] { load_config("", {"train.steps=abc"}); }), "train.steps must be an integer, got 'abc'.");
  EXPECT_EQ(error_of([] { load_config("", {"model.preset=gpt5"}); }),
            "Unknown model preset 'gpt5'; valid presets: tiny-gpt2, tiny-llama, gpt2-demo, llama-demo, gpt2, "
            "gpt2-medium, llama3.2-1b, llama3-8b, llama3.1-8b, llama3.1-70b.");
  EXPECT_EQ(error_of([] { load_config("", {"train.seq=512"}); }),
            "train.seq (512) is longer than the model's context (model.max_seq = 256); use train.seq <= 256 or "
            "raise model.max_seq.");
  EXPECT_EQ(error_of([] { load_config("", {"model.n_head=3"}); }),
            "model.d_model (128) must be divisible by model.n_head (3).");
  EXPECT_EQ(error_of([] { load_config("", {"model.dropout=1"}); }),
            "model.dropout must be from 0 to below 1, got 1; at 1 nothing passes; for example 0.1, or 0.");
  EXPECT_EQ(error_of([] { load_config("", {"model.attention=flash"}); }),
            "model.attention must be tiled (online softmax over tiles, keeps one log-sum-exp per row), math "
            "(keeps the [T x T] probabilities), sdpa (ATen's fused attention, keeps what tiled keeps; LibTorch 2.9 "
            "and later, no attention dropout) or auto (the planner chooses one of them for the run), got 'flash'.");
  // sdpa: refused where this build lacks the kernel, and with attention dropout anywhere (by
  // validate_plan, which the commands call on every config they load).
  if (kSdpaBuilt) {
    EXPECT_EQ(load_run_config("", {"model.attention=sdpa", "model.dropout=0"}).model.attention, Attention::sdpa);
    EXPECT_EQ(error_of([] {
                load_run_config("", {"model.attention=sdpa", "model.dropout=0.1"});
              }),
              "model.attention = sdpa cannot drop attention probabilities: ATen's fused attention draws its dropout "
              "mask inside the kernel (from the global generator, and not at all on the CPU), so a recompute could "
              "not draw the forward's mask again, and model.dropout = 0.1 applies to them; set model.dropout = 0, or "
              "use model.attention = math or tiled (their masks are keyed, so a recompute is exact).");
    EXPECT_EQ(error_of([] {
                load_run_config("", {"model.attention=sdpa", "model.dropout=0", "run.device=cuda"});
              }),
              "model.attention = sdpa on CUDA runs ATen's flash kernel, which takes bfloat16 or float16, and "
              "run.dtype is float32; set run.dtype = bfloat16, or use model.attention = math or tiled.");
    EXPECT_EQ(load_run_config("", {"model.attention=sdpa", "model.dropout=0", "run.device=cuda", "run.dtype=bfloat16"})
                  .model.attention,
              Attention::sdpa);
    EXPECT_EQ(error_of([] {
                load_run_config("", {"model.attention=sdpa", "model.dropout=0", "run.device=cuda", "run.dtype=bfloat16",
                                     "model.n_head=32", "model.n_kv_head=32"});
              }),
              "model.attention = sdpa on CUDA runs ATen's flash kernel, which takes heads of a multiple of 8 "
              "values, and model.d_model / model.n_head = 4; choose model.n_head so that it is, or use "
              "model.attention = math.");
  } else {
    EXPECT_EQ(error_of([] {
                load_run_config("", {"model.attention=sdpa", "model.dropout=0"});
              }),
              fmt::format("model.attention = sdpa needs LibTorch 2.9 or later (ATen's fused attention, with "
                          "grouped-query heads); this build has LibTorch {}.{}; use model.attention = math or tiled.",
                          TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR));
  }
  EXPECT_EQ(error_of([] {
              load_run_config("", {"model.attention=tiled", "run.device=cuda"});
            }),
            "model.attention = tiled runs remat's own loops over tiles on the CPU, and run.device is CUDA; use "
            "model.attention = sdpa (ATen's flash kernel, bfloat16) or math there.");
  EXPECT_EQ(error_of([] { load_config("", {"model.attention_tile=0"}); }),
            "model.attention_tile must be at least 1, got 0; for example 64.");
  EXPECT_EQ(load_config("", {"model.attention=tiled"}).model.attention, Attention::tiled);
  EXPECT_EQ(load_config("", {"model.attention=auto"}).model.attention, Attention::automatic);
  // A run's config.toml holds the op resolved; "auto" itself reads back as written.
  EXPECT_EQ(load_config("", {"model.attention=auto"}).model.attention,
            load_config("", {"model.attention=" + std::string(attention_name(Attention::automatic))}).model.attention);
  // One measured default: the config's tile is the op's.
  EXPECT_EQ(load_config("", {}).model.attention_tile, ops::AttentionTiles{}.q);
  EXPECT_EQ(ops::AttentionTiles{}.q, ops::AttentionTiles{}.k);
  EXPECT_EQ(error_of([] { load_config("", {"steps"}); }),
            "Override 'steps' is not of the form key=value (e.g. train.lr=1e-3).");
  const std::string path = write_temp("[train\nlr = 1\n");
  EXPECT_NE(error_of([&] { load_config(path, {}); }).find("Cannot read config " + path), std::string::npos);
  std::remove(path.c_str());
}

// Found by fuzz/config.cpp: an override is the one way bytes that are not UTF-8 reach a
// config (toml++ refuses them in a file); the run's config.toml then held them and could
// not be loaded back.
TEST(Config, OverridesMustBeUtf8) {
  EXPECT_EQ(error_of([] { load_config("", {"run.trace=b\x93ock"}); }),
            "Override 'run.trace=b\\x93ock' is not UTF-8 text (byte 0x93 at offset 11); config values are UTF-8, as "
            "in a TOML file, since a run records them in its config.toml: write it in UTF-8.");
  EXPECT_EQ(load_config("", {"run.prompt=Grüße"}).run.prompt, "Grüße");
  // A path option given on the command line (--plot) is checked alone, and its message
  // must not fail on such bytes either (the JSON quoting threw instead of the sentence).
  EXPECT_EQ(error_of([] { check_path("--plot", "a\x01\x93.png"); }),
            "--plot = 'a\\x01\\x93.png' holds a control character at offset 1; paths must be printable (they are "
            "written into plot scripts, logs and tables): remove it, it is usually a stray line break in a config "
            "file or a shell variable.");
}

// A value with a control character, from a TOML file or an override, is refused in a
// sentence that shows it escaped: it would clear a screen or forge lines of config.toml,
// plan.txt and the messages that quote it, and a NUL byte cut those messages short.
TEST(Config, ValuesWithControlCharactersAreRefusedEscaped) {
  const std::string path = write_temp("[ac]\npolicy = \"full\\u001b[2J\\u0000X\"\n");
  EXPECT_EQ(error_of([&] { load_config(path, {}); }),
            "ac.policy in " + path +
                " holds a control character at offset 4: 'full\\x1b[2J\\x00X'; config values are printed and "
                "written into config.toml, plan.txt and logs: remove it (it is usually a stray line break or escape "
                "in a file or a shell variable).");
  std::remove(path.c_str());
  EXPECT_NE(error_of([] {
              load_config("", {"run.name=a\u202Eb"});
            }).find("run.name (command-line override) holds a control character at offset 1: 'a\\u202Eb'"),
            std::string::npos);
  // A prompt may break lines and hold tabs, and nothing else.
  EXPECT_EQ(load_config("", {"run.prompt=One\n\tTwo"}).run.prompt, "One\n\tTwo");
  EXPECT_NE(error_of([] { load_config("", {"run.prompt=One\rTwo"}); }).find("'One\\rTwo'"), std::string::npos);
}

TEST(Config, SequenceParallelismIsRefusedWhereItCannotRun) {
  EXPECT_EQ(error_of([] { load_config("", {"parallel.sp=true"}); }),
            "parallel.sp = true shares each sequence's positions over the tensor-parallel ranks, but parallel.tp = 1 "
            "has one rank; set parallel.tp to 2 or more, or parallel.sp = false.");
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.sp=true", "parallel.tp=2", "train.seq=255"});
            }),
            "parallel.sp = true gives each of the parallel.tp = 2 ranks an equal share of the 255 positions of a "
            "sequence (train.seq), but 255 is not a multiple of 2; choose a train.seq that is.");
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.tp=2", "ac.tp_recompute_allgather=true"});
            }),
            "ac.tp_recompute_allgather = true keeps the sequence-parallel input of each column-parallel linear and "
            "gathers it again in the backward, but without parallel.sp = true (and parallel.tp > 1) nothing is "
            "gathered; set parallel.sp = true, or drop ac.tp_recompute_allgather.");
  EXPECT_EQ(
      error_of([] {
        load_config("", {"parallel.tp=2", "parallel.sp=true", "ac.tp_recompute_allgather=true", "ac.budget=1GiB"});
      }),
      "ac.budget = \"1GiB\" lets the planner choose, per layer, whether to keep each gathered input or gather "
      "it again, but ac.tp_recompute_allgather = true fixes that choice; keep one of them.");
  EXPECT_NO_THROW(load_config("", {"parallel.tp=2", "parallel.sp=true", "ac.tp_recompute_allgather=true"}));
}

TEST(Config, DistributedSavedActivationsNeedTensorParallelismAlone) {
  const std::vector<std::string> full{"ac.recompute_granularity=full", "ac.recompute_method=uniform",
                                      "ac.recompute_num_layers=1", "ac.distribute_saved_activations=true"};
  const auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), full.begin(), full.end());
    return error_of([&] { load_run_config("", more); });
  };
  EXPECT_EQ(with({}),
            "ac.distribute_saved_activations = true keeps each recomputed layer's input as a share per "
            "tensor-parallel rank, but parallel.tp = 1 has one rank; set parallel.tp to 2 or more, or drop "
            "ac.distribute_saved_activations.");
  EXPECT_EQ(with({"parallel.tp=2", "parallel.sp=true"}),
            "ac.distribute_saved_activations = true shares the layers' inputs over the tensor-parallel ranks, but "
            "with parallel.sp = true they already hold a share of the positions each; drop one of the two.");
  EXPECT_EQ(with({"parallel.tp=2", "ac.budget=1GiB"}),
            "ac.budget = \"1GiB\" lets the planner choose, per layer, whether to keep its input whole or as a share "
            "per tensor-parallel rank, but ac.distribute_saved_activations = true fixes that choice; keep one of "
            "them.");
  EXPECT_EQ(with({"parallel.tp=2"}), "");
}

// A pipeline's stages are the stages per-stage policies count; its schedule is one of two.
TEST(Config, PipelineStagesAreThePolicysStages) {
  const Config c = load_config("", {"parallel.pp=2", "ac.policy=block:1", "parallel.schedule=gpipe"});
  EXPECT_EQ(c.ac.stages, 2);
  EXPECT_EQ(c.parallel.schedule, pipeline::Schedule::gpipe);
  const ActivationPlan plan = compile_policy(c.ac, c.model.n_layer, c.model.dropout);
  ASSERT_EQ(plan.layers.size(), 4u);
  EXPECT_FALSE(plan.layers[0].dropped.empty());  // the first layer of each of the two stages
  EXPECT_TRUE(plan.layers[1].dropped.empty());
  EXPECT_FALSE(plan.layers[2].dropped.empty());
  EXPECT_EQ(load_config("", {"parallel.pp=2", "ac.num_layers_per_stage=1,3"}).ac.stages, 2);
  EXPECT_EQ(error_of([] { load_config("", {"parallel.pp=5"}); }),
            "parallel.pp = 5 pipeline stages for 4 layers: every stage needs at least one layer; use 1 (no pipeline) "
            "to 4.");
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.pp=2", "ac.stages=4"});
            }),
            "ac.stages = 4 but parallel.pp = 2: with a pipeline the per-stage policies count its real stages; drop "
            "ac.stages or set it to 2.");
  EXPECT_EQ(error_of([] { load_config("", {"parallel.schedule=zb"}); }),
            "parallel.schedule = \"zb\" is not a pipeline schedule; use 1f1b (each stage alternates forwards and "
            "backwards once the pipeline is full, holding at most one microbatch per later stage) or gpipe (every "
            "forward, then every backward, holding all microbatches).");
  // The resolved configuration reads back to the same one.
  EXPECT_NE(config_to_toml(c).find("schedule = \"gpipe\""), std::string::npos);
}

// ZeRO stages 0 to 3, with tensor, sequence and pipeline parallelism; with one
// data-parallel rank each is accepted and shards over that rank alone, so one
// configuration serves any number of ranks.
TEST(Config, ZeroIsStageZeroToThree) {
  EXPECT_EQ(load_config("", {}).parallel.zero, 0);
  EXPECT_EQ(load_config("", {"parallel.zero=1"}).parallel.zero, 1);
  EXPECT_EQ(load_config("", {"parallel.zero=1", "parallel.dp=1"}).parallel.zero, 1);
  EXPECT_EQ(load_config("", {"parallel.zero=2", "parallel.tp=2"}).parallel.zero, 2);
  EXPECT_EQ(load_config("", {"parallel.zero=3", "parallel.tp=2", "parallel.pp=2"}).parallel.zero, 3);
  EXPECT_EQ(error_of([] { load_config("", {"parallel.zero=4"}); }),
            "parallel.zero must be from 0 to 3, got 4; 0 keeps AdamW's moments, the gradients and the weights whole "
            "on every data-parallel rank, 1 (ZeRO stage 1) keeps each rank's share of the moments, 2 (ZeRO stage 2) "
            "of the gradients too, 3 (ZeRO stage 3) of the weights too.");
  EXPECT_EQ(load_config("", {"parallel.zero=2", "parallel.pp=2"}).parallel.zero, 2);
  EXPECT_EQ(load_config("", {"parallel.zero=2", "parallel.tp=2", "parallel.sp=true"}).parallel.zero, 2);
  EXPECT_NE(error_of([] { load_config("", {"parallel.zero=-1"}); }).find("got -1;"), std::string::npos);
  EXPECT_EQ(error_of([] { load_config("", {"parallel.zero=yes"}); }), "parallel.zero must be an integer, got 'yes'.");
}

// Whether ZeRO-3's layers gather their weights again: remat's key and torchtitan's, which
// agree or are refused in a sentence, and neither without stage 3.
TEST(Config, ReshardAfterForwardTakesTorchtitansSpelling) {
  const auto reshard = [](std::vector<std::string> o) {
    o.emplace_back("parallel.zero=3");
    return load_config("", std::move(o)).parallel.reshard_after_forward;
  };
  EXPECT_EQ(reshard({}), Reshard::automatic);
  EXPECT_EQ(reshard({"parallel.reshard_after_forward=never"}), Reshard::never);
  EXPECT_EQ(reshard({"parallel.fsdp_reshard_after_forward=always"}), Reshard::always);
  EXPECT_EQ(reshard({"parallel.fsdp_reshard_after_forward=default"}), Reshard::automatic);
  EXPECT_EQ(reshard({"parallel.fsdp_reshard_after_forward=never", "parallel.reshard_after_forward=never"}),
            Reshard::never);
  EXPECT_EQ(error_of([&] {
              reshard({"parallel.fsdp_reshard_after_forward=never", "parallel.reshard_after_forward=always"});
            }),
            "parallel.reshard_after_forward = \"always\" but parallel.fsdp_reshard_after_forward = \"never\" "
            "(torchtitan's spelling, its \"default\" remat's \"auto\"): they are two spellings of the same "
            "setting; drop one, or make them agree.");
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.reshard_after_forward=never", "parallel.zero=2"});
            }),
            "parallel.reshard_after_forward = \"never\" chooses whether ZeRO-3's gathered weights stay from a "
            "layer's forward to its backward, but parallel.zero = 2 gathers none: set parallel.zero = 3, or drop "
            "the setting.");
  EXPECT_NE(error_of([&] {
              reshard({"parallel.reshard_after_forward=sometimes"});
            }).find("parallel.reshard_after_forward must be auto"),
            std::string::npos);
  const Config c = load_config("", {"parallel.zero=3", "parallel.fsdp_reshard_after_forward=never"});
  EXPECT_NE(config_to_toml(c).find("reshard_after_forward = \"never\""), std::string::npos);
}

// Megatron's spellings of the ZeRO stage set parallel.zero, agree with it where both are
// given, are written back as given, and are refused in a sentence where they disagree.
TEST(Config, ZeroTakesMegatronsSpellings) {
  const auto zero = [](std::vector<std::string> o) { return load_config("", std::move(o)).parallel.zero; };
  EXPECT_EQ(zero({"parallel.use_distributed_optimizer=true"}), 1);
  EXPECT_EQ(zero({"parallel.use_distributed_optimizer=false"}), 0);
  EXPECT_EQ(zero({"parallel.use_distributed_optimizer=true", "parallel.zero=2"}), 2);
  EXPECT_EQ(zero({"parallel.data_parallel_sharding_strategy=no_shard"}), 0);
  EXPECT_EQ(zero({"parallel.data_parallel_sharding_strategy=optim"}), 1);
  EXPECT_EQ(zero({"parallel.data_parallel_sharding_strategy=optim_grads", "parallel.use_distributed_optimizer=1"}), 2);
  EXPECT_EQ(zero({"parallel.data_parallel_sharding_strategy=optim_grads", "parallel.zero=2"}), 2);
  EXPECT_EQ(zero({"parallel.data_parallel_sharding_strategy=optim", "parallel.data_parallel_sharding_strategy="}), 0);

  // Written back beside the stage they set, and read back alike.
  const Config c = load_config("", {"parallel.data_parallel_sharding_strategy=optim_grads"});
  const std::string text = config_to_toml(c);
  EXPECT_NE(text.find("zero = 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("data_parallel_sharding_strategy = \"optim_grads\""), std::string::npos) << text;
  const std::string path = write_temp(text);
  EXPECT_EQ(config_to_toml(load_config(path, {})), text);
  std::remove(path.c_str());

  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.zero=1", "parallel.data_parallel_sharding_strategy=optim_grads"});
            }),
            "parallel.zero = 1 but parallel.data_parallel_sharding_strategy = \"optim_grads\" asks ZeRO stage 2: they "
            "are two spellings of the same setting; drop one, or make them agree.");
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.zero=0", "parallel.use_distributed_optimizer=true"});
            }),
            "parallel.zero = 0 but parallel.use_distributed_optimizer = true asks ZeRO stage 1 or above: they are two "
            "spellings of the same setting; drop one, or make them agree.");
  EXPECT_EQ(
      error_of([] {
        load_config("", {"parallel.data_parallel_sharding_strategy=optim", "parallel.use_distributed_optimizer=false"});
      }),
      "parallel.data_parallel_sharding_strategy = \"optim\" asks ZeRO stage 1 but "
      "parallel.use_distributed_optimizer = false asks stage 0; drop one of them, or make them agree (the "
      "distributed optimizer is stage 1 and above).");
  EXPECT_EQ(zero({"parallel.data_parallel_sharding_strategy=optim_grads_params"}), 3);
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.zero=2", "parallel.data_parallel_sharding_strategy=optim_grads_params"});
            }),
            "parallel.zero = 2 but parallel.data_parallel_sharding_strategy = \"optim_grads_params\" asks ZeRO stage "
            "3: they are two spellings of the same setting; drop one, or make them agree.");
  EXPECT_EQ(error_of([] { load_config("", {"parallel.data_parallel_sharding_strategy=full_shard"}); }),
            "parallel.data_parallel_sharding_strategy must be no_shard (parallel.zero = 0), optim (1: AdamW's "
            "moments sharded), optim_grads (2: the gradients too) or optim_grads_params (3: the parameters too), got "
            "'full_shard'.");
}

// data.format names what data.text holds; each format other than text needs the files, and
// token ids the tokenizer that wrote them.
TEST(Config, DataFormatsNeedWhatTheyRead) {
  EXPECT_EQ(load_config("", {}).data.format, DataFormat::text);
  const Config jsonl = load_config("", {"data.format=jsonl", "data.text=a.jsonl", "data.field=content"});
  EXPECT_EQ(jsonl.data.format, DataFormat::jsonl);
  EXPECT_EQ(jsonl.data.field, "content");
  EXPECT_NE(config_to_toml(jsonl).find("format = \"jsonl\""), std::string::npos);
  EXPECT_EQ(error_of([] { load_config("", {"data.format=parquet"}); }),
            "data.format must be text (UTF-8 text files), jsonl (one JSON object per line, data.field holding the "
            "text) or tokens (llm.c or nanoGPT .bin shards, or Megatron's indexed dataset: a .bin beside its .idx), "
            "got 'parquet'.");
  EXPECT_EQ(error_of([] { load_config("", {"data.format=jsonl"}); }),
            "data.format = \"jsonl\" reads the files data.text names, but data.text is unset (the default corpus is "
            "text): set data.text to a file or a glob such as data/shards/*.jsonl.");
  EXPECT_EQ(error_of([] {
              load_config("", {"data.format=tokens", "data.text=s/*.bin"});
            }),
            "data.format = \"tokens\" reads token ids, which only the tokenizer that wrote them can decode and bound, "
            "but data.tokenizer is unset: set it to that tokenizer (its tokenizer.json, .model or model folder).");
  EXPECT_EQ(error_of([] {
              load_config("", {"data.format=jsonl", "data.text=a.jsonl", "data.field="});
            }),
            "data.field is empty; with data.format = \"jsonl\" it names the field holding each document's text, such "
            "as text.");
}

// remat plan's link latency: microseconds a ring step waits, 0 (a link priced by its rate
// alone) included; a negative or absurd one is refused with what to give instead.
// Llama 3.2 1B's long-context RoPE and tied head are keys like any other: written to a
// run's config.toml (as dotted keys inside [model]) and read back, and refused where they
// cannot apply.
TEST(Config, RopeScalingAndATiedHeadAreKeys) {
  const Config c = load_config("", {"model.preset=llama3.2-1b", "train.seq=16"});
  EXPECT_EQ(c.model.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.model.rope_scaling.original_max_seq, 8192);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_FALSE(model_preset("llama3-8b").tie_embeddings);
  EXPECT_FALSE(model_preset("llama3-8b").rope_scaling.scaled());
  EXPECT_EQ(model_preset("llama3.1-8b").rope_scaling.factor, 8.0);
  const std::string toml = config_to_toml(c);
  EXPECT_NE(toml.find("\nrope_scaling.factor = 32\n"), std::string::npos) << toml;
  const std::string path = write_temp(toml);
  const Config again = load_config(path, {});
  std::remove(path.c_str());
  EXPECT_EQ(config_to_toml(again), toml);
  EXPECT_EQ(again.model.rope_scaling.factor, 32.0);

  EXPECT_EQ(error_of([] { load_config("", {"model.rope_scaling.factor=8"}); }),
            "model.rope_scaling.factor = 8 scales RoPE, which gpt2 has none of (learned positions); leave it at 1.");
  EXPECT_EQ(error_of([] {
              load_config("", {"model.preset=tiny-llama", "model.rope_scaling.factor=8",
                               "model.rope_scaling.low_freq_factor=4"});
            }),
            "model.rope_scaling.low_freq_factor (4) must be below model.rope_scaling.high_freq_factor (4): the "
            "wavelengths between original_max_seq / high and original_max_seq / low are the ones blended (Llama 3.1: "
            "1 and 4).");
  EXPECT_NE(error_of([] { load_config("", {"model.rope_scaling.factor=0.5"}); }).find("must be from 1 to 1024"),
            std::string::npos);
  EXPECT_EQ(error_of([] {
              load_config("", {"model.preset=tiny-llama", "model.tie_embeddings=true", "train.seq=16"});
            }),
            "");
}

TEST(Config, LinkLatencyIsMicrosecondsARingStepWaits) {
  EXPECT_EQ(load_config("", {}).parallel.link_latency, 2);
  EXPECT_EQ(load_config("", {"parallel.link_latency=0"}).parallel.link_latency, 0);
  EXPECT_EQ(load_config("", {"parallel.link_latency=1000000"}).parallel.link_latency, 1e6);
  EXPECT_EQ(error_of([] { load_config("", {"parallel.link_latency=-1"}); }),
            "parallel.link_latency must be from 0 to 1000000 microseconds, got -1; it is what one ring step of a "
            "collective waits on the tensor-parallel links, whatever it sends; for example 2 for NVLink, 5 for PCIe, "
            "10 for a network between hosts.");
  EXPECT_NE(error_of([] { load_config("", {"parallel.link_latency=1000001"}); }).find("got 1000001;"),
            std::string::npos);
  // The data-parallel links are declared apart: a network between hosts, often.
  const Config dp = load_config("", {"parallel.dp_link_rate=50", "parallel.dp_link_latency=10"});
  EXPECT_EQ(dp.parallel.dp_link_rate, 50);
  EXPECT_EQ(dp.parallel.dp_link_latency, 10);
  EXPECT_EQ(dp.parallel.link_rate, 100);
  EXPECT_EQ(error_of([] { load_config("", {"parallel.dp_link_latency=-1"}); }),
            "parallel.dp_link_latency must be from 0 to 1000000 microseconds, got -1; it is what one ring step of a "
            "collective waits on the data-parallel links, whatever it sends; for example 2 for NVLink, 10 for a "
            "network between hosts.");
  EXPECT_NE(error_of([] { load_config("", {"parallel.dp_link_rate=0"}); }).find("from 0.001 to 1000000 GB/s"),
            std::string::npos);
}

TEST(Config, PresetsHaveTheRealShapes) {
  const ModelConfig g = model_preset("gpt2");
  EXPECT_EQ(g.n_layer, 12);
  EXPECT_EQ(g.n_head, 12);
  EXPECT_EQ(g.d_model, 768);
  EXPECT_EQ(g.vocab_size, 50257);
  EXPECT_EQ(g.max_seq, 1024);
  EXPECT_EQ(model_preset("gpt2-medium").n_layer, 24);
  const ModelConfig l = model_preset("llama3-8b");
  EXPECT_EQ(l.n_layer, 32);
  EXPECT_EQ(l.n_kv_head, 8);
  EXPECT_EQ(l.d_ff, 14336);
  EXPECT_EQ(l.vocab_size, 128256);
}

// Megatron's padding: the vocabulary rounded up to a multiple of vocab_multiple x tp.
TEST(Config, TheVocabularyIsPaddedToAMultipleOfTheTensorParallelRanks) {
  const auto padded = [](int64_t vocab, int64_t multiple, int64_t tp) {
    Config c;
    c.model.vocab_multiple = multiple;
    c.parallel.tp = tp;
    return padded_vocab_size(c, vocab);
  };
  EXPECT_EQ(padded(50257, 1, 1), 50257);  // one process: unchanged by default
  EXPECT_EQ(padded(50257, 1, 8), 50264);
  EXPECT_EQ(padded(50257, 128, 1), 50304);  // nanoGPT's padded GPT-2 vocabulary
  EXPECT_EQ(padded(50257, 128, 8), 51200);  // Megatron-LM's default at tp = 8
  EXPECT_EQ(padded(2048, 1, 3), 2049);
  EXPECT_EQ(padded(2049, 1, 3), 2049);  // a padded size is its own padding
  EXPECT_EQ(padded(128256, 1, 8), 128256);
  EXPECT_EQ(padded(0, 64, 4), 0);  // the tokenizer's, padded when known
  for (int64_t vocab : {1, 7, 300, 50257}) {
    for (int64_t multiple : {1, 3, 64}) {
      for (int64_t tp : {1, 2, 6, 8}) {
        const int64_t p = padded(vocab, multiple, tp);
        EXPECT_EQ(p % (multiple * tp), 0);
        EXPECT_GE(p, vocab);
        EXPECT_LT(p, vocab + multiple * tp);
      }
    }
  }
  // Where the vocabulary is resolved: the preset's, a given one, the tokenizer's.
  EXPECT_EQ(load_config("", {"model.preset=gpt2-medium", "parallel.tp=8"}).model.vocab_size, 50264);
  EXPECT_EQ(load_config("", {"model.preset=gpt2", "parallel.tp=4"}).model.vocab_size, 50260);
  EXPECT_EQ(load_config("", {"model.preset=gpt2"}).model.vocab_size, 50257);
  EXPECT_EQ(load_config("", {"model.preset=gpt2", "parallel.tp=4", "model.vocab_multiple=128"}).model.vocab_size,
            50688);
  EXPECT_EQ(load_config("", {"model.vocab_size=1000", "parallel.tp=3", "model.n_head=3", "model.n_kv_head=3",
                             "model.d_model=96", "model.d_ff=384"})
                .model.vocab_size,
            1002);
  Config c = load_config("", {"parallel.tp=4"});
  EXPECT_EQ(c.model.vocab_size, 0);
  resolve_vocab_size(c, 2050);
  EXPECT_EQ(c.model.vocab_size, 2052);
  validate_config(c);
  // Through the resolved config of a run (config.toml): the padded size stays.
  const std::string path = write_temp(config_to_toml(c));
  EXPECT_EQ(load_config(path, {}).model.vocab_size, 2052);
  std::remove(path.c_str());
}

TEST(Config, VocabularyPaddingIsRefusedWithSentences) {
  EXPECT_EQ(error_of([] { load_config("", {"model.vocab_multiple=0"}); }),
            "model.vocab_multiple must be from 1 to 65536, got 0; the vocabulary is padded to a multiple of it times "
            "parallel.tp (1: only as far as the tensor-parallel split needs; 128 is Megatron-LM's "
            "make_vocab_size_divisible_by).");
  EXPECT_NE(error_of([] { load_config("", {"model.vocab_multiple=65537"}); }).find("got 65537;"), std::string::npos);
  Config c = load_config("", {"parallel.tp=2"});
  c.model.vocab_size = 2049;  // built in code, not padded
  EXPECT_EQ(error_of([&] { validate_config(c); }),
            "model.vocab_size = 2049 is not padded to a multiple of model.vocab_multiple x parallel.tp = 1 x 2, so "
            "the tensor-parallel ranks cannot share its rows equally; set it to 2050 (load_config and the trainer pad "
            "it so; a Config built in code must call padded_vocab_size).");
  c.model.vocab_size = 4096;
  EXPECT_EQ(error_of([&] { resolve_vocab_size(c, 5000); }),
            "model.vocab_size (4096) is smaller than the tokenizer's vocabulary (5000); use model.vocab_size=0 to "
            "take the tokenizer's.");
  // Padding a vocabulary near 2^63, or over a parallel.tp near 2^62 (load_config pads before
  // it validates), overflowed int64: seen reading the code, shown by fuzz/config.cpp's
  // UndefinedBehaviorSanitizer on these inputs (now in its seed corpus).
  EXPECT_EQ(error_of([] {
              load_config("", {"model.vocab_size=9223372036854775807", "model.vocab_multiple=2"});
            }),
            "model.vocab_size = 9223372036854775807 is more than 2^31 tokens; token ids are 32-bit integers (the "
            "largest real vocabularies hold a few hundred thousand): give the tokenizer's size, or 0 to take it.");
  EXPECT_EQ(error_of([] {
              load_config("", {"parallel.tp=4611686018427387904", "model.vocab_size=5", "model.vocab_multiple=4"});
            }),
            "parallel.tp must be from 1 to 1024 tensor-parallel ranks, got 4611686018427387904.");
  EXPECT_EQ(load_config("", {"model.vocab_size=2147483648"}).model.vocab_size, int64_t{1} << 31);
  // The heads and features are not padded: a tp that does not divide them is refused.
  EXPECT_EQ(error_of([] { load_config("", {"parallel.tp=3"}); }),
            "parallel.tp = 3 gives each tensor-parallel rank an equal share of model.n_head = 4, but 4 is not a "
            "multiple of 3; choose a parallel.tp dividing model.n_head (4), model.n_kv_head (4) and model.d_ff "
            "(512).");
}

}  // namespace
}  // namespace remat
