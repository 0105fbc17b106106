// The `remat` binary on bad input: one clear sentence on stderr and a non-zero exit,
// never a crash or a backtrace.
#include "data/test_text.h"
#include "remat/config.h"
#include "remat/caching_allocator.h"
#include "remat/graph.h"
#include "remat/memory.h"
#include "remat/safetensors.h"
#include "util/atomic_file.h"
#include "util/paths.h"
#include "util/processes.h"
#include "util/temp_dir.h"

#include <ATen/Context.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

namespace fs = std::filesystem;

using remat::testing::read_text;
using remat::testing::Result;
using remat::testing::run_remat;

class Cli : public ::testing::Test {
 protected:
  // Exit code 1 and, after any progress lines, one last line "error: ..." containing
  // `expected`; no backtrace.
  void expect_error(const std::string& args, const std::string& expected) {
    const Result r = run_remat(args);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    ASSERT_FALSE(r.output.empty());
    const size_t last = r.output.rfind('\n', r.output.size() - 2);
    const std::string line = r.output.substr(last == std::string::npos ? 0 : last + 1);
    EXPECT_EQ(line.rfind("error: ", 0), 0u) << r.output;
    EXPECT_NE(line.find(expected), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("error:"), r.output.size() - line.size()) << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  }

  // `remat train` of tiny-gpt2 on a generated corpus, everything under dir_, plus `settings`.
  std::string tiny_training(const std::string& settings) {
    return "train model.preset=tiny-gpt2 model.vocab_size=0 train.batch=2 train.seq=16 train.warmup=1 "
           "train.eval_batches=1 data.vocab_size=512 run.threads=1 run.progress=false data.text=" +
           file("corpus.txt", remat::testing::make_text(1000)) + " data.dir=" + (dir_ / "data").string() +
           " run.out_dir=" + (dir_ / "runs").string() + " " + settings;
  }

  // A data directory with no prepared corpus, so that plans are the same wherever the
  // tests run (remat plan counts a prepared corpus's tokens).
  std::string no_corpus() const { return " data.dir=" + (dir_ / "no-corpus").string(); }

  std::string file(const std::string& name, const std::string& content) {
    const std::string p = (dir_ / name).string();
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }

  // Two steps of AdamW at 1e-3 from a transformers-saved model on a JSONL file; the run's
  // folder.
  fs::path fine_tune(const std::string& model) {
    std::string jsonl;
    for (int d = 0; d < 60; ++d) {
      jsonl +=
          nlohmann::json{{"id", d}, {"text", remat::testing::make_text(8, static_cast<uint64_t>(d) + 1)}}.dump() + "\n";
    }
    const Result r = run_remat(
        "train model.init=" + model +
        " train.batch=2 train.seq=16 train.warmup=1 train.steps=2 train.lr=1e-3 train.eval_batches=1 run.threads=1 "
        "run.progress=false run.sample_tokens=0 run.name=ft data.format=jsonl data.text=" +
        file("docs.jsonl", jsonl) + " data.dir=" + (dir_ / "data").string() +
        " run.out_dir=" + (dir_ / "runs").string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return dir_ / "runs" / "ft";
  }

  remat::testing::TempDir dir_;
};

TEST_F(Cli, UnknownPresetListsTheValidOnes) {
  expect_error("train model.preset=gpt5", "Unknown model preset 'gpt5'; valid presets: tiny-gpt2,");
}

TEST_F(Cli, UnknownKeySuggestsTheNearest) { expect_error("train train.stepz=3", "did you mean 'train.steps'?"); }

TEST_F(Cli, SequenceLongerThanTheContextIsRefused) {
  expect_error("train train.seq=4096", "train.seq (4096) is longer than the model's context (model.max_seq = 256)");
}

TEST_F(Cli, EmptyTextFileIsRefused) {
  const std::string empty = file("empty.txt", "");
  expect_error("prepare --text " + empty + " data.dir=" + (dir_ / "data").string(), "is empty");
}

TEST_F(Cli, NonUtf8TextFileIsRefusedWithTheOffset) {
  const std::string bad = file("latin1.txt", std::string("caf") + char(0xE9) + " au lait\n");
  expect_error("prepare --text " + bad + " data.dir=" + (dir_ / "data").string(), "byte offset 3");
}

TEST_F(Cli, MissingTextFileIsRefused) {
  expect_error("prepare --text " + (dir_ / "nope.txt").string() + " data.dir=" + (dir_ / "data").string(), "nope.txt");
}

TEST_F(Cli, DataDirectoryThatCannotExistIsRefused) {
  const std::string blocker = file("a-file", "x");
  expect_error("prepare data.dir=" + blocker + "/data", blocker);
  // Found before any tokenizer work (/proc/1 refuses writes even to root).
  expect_error("prepare data.dir=/proc/1", "Cannot write into the data directory /proc/1 (data.dir)");
}

TEST_F(Cli, GenerateWithoutARunDirectoryIsRefused) {
  expect_error("generate --run " + (dir_ / "no-run").string(), "has no config.toml");
}

// Once accepted, 99999999999 tokens printed nothing for minutes; tokens now stream as they
// come, and the count has a range.
TEST_F(Cli, GenerateRefusesAnAbsurdTokenCount) {
  const Result r = run_remat("generate --run " + (dir_ / "no-run").string() + " --tokens 99999999999");
  EXPECT_NE(r.exit_code, 0);
  // CLI11's words for the range differ between versions ("1 to 100000", "[1 - 100000]").
  EXPECT_NE(r.output.find("--tokens: Value 99999999999 not in range"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("100000"), std::string::npos) << r.output;
}

// A word that names no command was told "A subcommand is required".
TEST_F(Cli, AnUnknownCommandIsNamedWithTheCommands) {
  expect_error("bogus",
               "'bogus' is not a remat command; the commands are prepare, train, plan, bench, generate, "
               "launch (`remat --help` says what each does).");
}

TEST_F(Cli, DevicesAndDtypesThisMachineLacksAreRefused) {
  expect_error("train run.device=tpu", "run.device must be cpu or cuda[:N], got 'tpu'.");
  expect_error("train run.dtype=float16", "run.dtype must be float32 or bfloat16, got 'float16'.");
  expect_error("train run.name=a/b", "run.name may hold only letters, digits");
}

TEST_F(Cli, ExplainAcPrintsTheCanonicalPlanOfAnAliasSpelling) {
  const Result r = run_remat(
      "train --explain-ac ac.recompute_granularity=full ac.recompute_method=uniform "
      "ac.recompute_num_layers=2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("policy: uniform:2"), std::string::npos) << r.output;
  expect_error("train --explain-ac ac.recompute_granularity=selective ac.recompute_method=block",
               "ac.recompute_method");
}

TEST_F(Cli, TraceWritesTheThirdStepAsJson) {
  const std::string text = file("corpus.txt", remat::testing::make_text(1000));
  const std::string trace = (dir_ / "step.json").string();
  const Result r = run_remat("train --trace " + trace + " model.preset=tiny-gpt2 model.vocab_size=0 train.steps=4 " +
                             "train.batch=2 train.seq=16 train.warmup=1 train.eval_batches=1 data.vocab_size=512 " +
                             "data.text=" + text + " data.dir=" + (dir_ / "data").string() + " run.out_dir=" +
                             (dir_ / "runs").string() + " run.threads=1 run.sample_tokens=0 run.progress=false");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("trace of step 3: " + trace), std::string::npos) << r.output;
  std::ifstream in(trace);
  const nlohmann::json json = nlohmann::json::parse(in);
  int steps = 0, ops = 0, samples = 0;
  for (const auto& e : json.at("traceEvents")) {
    steps += e.at("ph") == "X" && e.at("name") == "step";
    ops += e.at("ph") == "X" && e.at("cat") == "forward";
    samples += e.at("ph") == "C";
  }
  EXPECT_EQ(steps, 1);
  EXPECT_GT(ops, 0);
  EXPECT_GT(samples, 0);
}

// A Hugging Face tokenizer given to a run: its vocabulary sizes the model, `remat plan`
// reads it before any corpus exists, and `remat generate` samples through it.
TEST_F(Cli, TrainsAndGeneratesWithAGivenHuggingFaceTokenizer) {
  const std::string tokenizer =
      std::string(" data.tokenizer=") + remat::testing::kSourceDir + "/tests/data/hf_tokenizers/gpt2";
  const Result plan =
      run_remat("plan --json model.preset=tiny-gpt2 model.vocab_size=0 train.seq=16" + tokenizer + no_corpus());
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_EQ(nlohmann::json::parse(plan.output).at("model").at("vocab_size"), 545) << plan.output;
  const Result r = run_remat(tiny_training("train.steps=2 run.sample_tokens=5 run.name=hf" + tokenizer));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("validation tokens, vocabulary 545, unigram entropy"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "data" / "corpus-gpt2" / "meta.json"));
  const Result g = run_remat("generate --run " + (dir_ / "runs" / "hf").string() + " --prompt Hello --tokens 3");
  ASSERT_EQ(g.exit_code, 0) << g.output;
  EXPECT_EQ(g.output.rfind("Hello", 0), 0u) << g.output;
}

// Two steps move no weight by more than 1e-2; a fresh model's are some 0.1 from the
// fixture's.
void expect_near_start(const fs::path& run, const std::map<std::string, at::Tensor>& start) {
  const auto end = remat::model::load_safetensors((run / "model.safetensors").string());
  ASSERT_FALSE(end.tensors.empty());
  for (const auto& [name, t] : end.tensors) {
    ASSERT_TRUE(start.count(name)) << name;
    EXPECT_LE((t - start.at(name)).abs().max().item<double>(), 1e-2) << name;
  }
}

// Fine-tuning: a model transformers saved (tests/data/hf_models/gpt2, its tokenizer beside
// it) trained on JSONL records. Its config.json gives the shape, its tokenizer the corpus,
// its weights the start; the run's config.json and model.safetensors load back as its own.
TEST_F(Cli, FineTunesATransformersModelOnJsonlRecords) {
  const std::string model = std::string(remat::testing::kSourceDir) + "/tests/data/hf_models/gpt2";
  const fs::path run = fine_tune(model);
  EXPECT_TRUE(fs::exists(dir_ / "data" / "docs-jsonl-gpt2" / "meta.json"));
  const auto config = nlohmann::json::parse(remat::util::read_file((run / "config.json").string()));
  EXPECT_EQ(config.at("model_type"), "gpt2");
  EXPECT_EQ(config.at("n_embd"), 32);
  EXPECT_EQ(config.at("vocab_size"), 545);
  EXPECT_EQ(config.at("eos_token_id"), 0);  // the tokenizer's <|endoftext|>
  // The model's own tokenizer beside it, so that transformers loads the folder whole.
  EXPECT_EQ(remat::util::read_file((run / "tokenizer.json").string()),
            remat::util::read_file(model + "/tokenizer.json"));
  std::map<std::string, at::Tensor> start;
  for (auto& [name, t] : remat::model::load_safetensors(model + "/model.safetensors").tensors) {
    start.emplace(name.substr(std::string("transformer.").size()), t);
  }
  expect_near_start(run, start);
}

// Llama 3.2's layout: weights in shards, a head tied to the embedding, RoPE scaled.
TEST_F(Cli, FineTunesAShardedTiedLlamaAndWritesItBackAsOne) {
  const std::string model = std::string(remat::testing::kSourceDir) + "/tests/data/hf_models/llama3.2";
  const fs::path run = fine_tune(model);
  const auto config = nlohmann::json::parse(remat::util::read_file((run / "config.json").string()));
  EXPECT_EQ(config.at("tie_word_embeddings"), true);
  EXPECT_EQ(config.at("rope_scaling").at("rope_type"), "llama3");
  EXPECT_EQ(config.at("rope_scaling").at("factor"), 8.0);
  EXPECT_EQ(config.at("rope_scaling").at("original_max_position_embeddings"), 64);
  std::map<std::string, at::Tensor> start;
  for (const std::string& shard : remat::model::safetensors_index_files(model + "/model.safetensors.index.json")) {
    for (auto& [name, t] : remat::model::load_safetensors(shard).tensors) start.emplace(name, t);
  }
  EXPECT_FALSE(start.count("lm_head.weight"));
  expect_near_start(run, start);
  EXPECT_FALSE(remat::model::load_safetensors((run / "model.safetensors").string()).find("lm_head.weight"));
}

// A model's folder whose weights are missing is refused before any work, naming both
// layouts transformers saves.
TEST_F(Cli, AModelFolderWithoutWeightsIsRefusedBeforeAnyWork) {
  const fs::path model = dir_ / "model";
  fs::create_directories(model);
  fs::copy_file(fs::path(remat::testing::kSourceDir) / "tests/data/hf_models/llama3.2/config.json",
                model / "config.json");
  expect_error(tiny_training("model.init=" + model.string()),
               "names no weights: the folder holds neither model.safetensors nor model.safetensors.index.json");
  EXPECT_FALSE(fs::exists(dir_ / "data"));
}

TEST_F(Cli, RecordAllocationsWritesTheRunsFirstTwoStepsAsATrace) {
  const std::string path = (dir_ / "allocations.txt").string();
  const Result r = run_remat(tiny_training("train.steps=3 run.sample_tokens=0 run.record_allocations=" + path));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(path);
  const auto entries = remat::memory::read_allocation_trace(in);
  ASSERT_FALSE(entries.empty());
  // Every free is of a block the trace allocated; the totals move by each event's block.
  std::map<int64_t, int64_t> live;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    const bool malloc = e.event.kind == remat::memory::AllocatorEvent::Kind::malloc;
    if (malloc) live[e.event.id] = e.event.bytes;
    ASSERT_TRUE(live.count(e.event.id)) << "line " << i + 1 << " frees a block the trace never allocated";
    const int64_t bytes = live[e.event.id];
    if (i > 0) {
      EXPECT_EQ(e.state.allocated - entries[i - 1].state.allocated, malloc ? bytes : -bytes) << i + 1;
    }
    if (!malloc) live.erase(e.event.id);
  }
  expect_error("train --record-allocations " + path, "a file is there already, and the allocation trace never");
}

TEST_F(Cli, TraceIntoAMissingDirectoryIsRefusedBeforeTraining) {
  expect_error("train --trace " + (dir_ / "none" / "step.json").string(), "none does not exist");
}

TEST_F(Cli, BenchSweepsPoliciesAndWritesCsvJsonAndTheTable) {
  const std::string common =
      "--steps 2 --warmup 1 model.preset=tiny-gpt2 model.vocab_size=0 train.batch=4 "
      "train.seq=32 data.vocab_size=512 run.threads=1 data.text=" +
      file("corpus.txt", remat::testing::make_text(1500)) + " data.dir=" + (dir_ / "data").string();
  const std::string out = (dir_ / "bench").string();
  const Result r =
      run_remat("bench --policies 'none;ops:[matmul,attention]' --policies full --out " + out + " " + common);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  std::ifstream csv(out + "/bench.csv");
  std::vector<std::string> lines;
  for (std::string line; std::getline(csv, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0].rfind("entry,policy,median_step_seconds,", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("none,none,", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("\"ops:[matmul,attention]\",\"ops:[matmul,attention]\",", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3].rfind("full,full,", 0), 0u) << lines[3];

  std::ifstream json_file(out + "/bench.json");
  const auto json = nlohmann::json::parse(json_file);
  EXPECT_EQ(json["machine"]["preset"], "tiny-gpt2");
  EXPECT_EQ(json["machine"]["seq"], 32);
  EXPECT_EQ(json["reference"], "none");
  const auto& rows = json["rows"];
  ASSERT_EQ(rows.size(), 3u);
  for (const auto& row : rows) {
    EXPECT_EQ(row["final_loss"].get<double>(), rows[0]["final_loss"].get<double>()) << row["entry"];
    EXPECT_EQ(row["step_seconds"].size(), 2u);
    EXPECT_EQ(row["activation_bytes"], row["predicted_activation_bytes"]) << row["entry"];
    // The CPU has no caching allocator.
    EXPECT_EQ(row["reserved_peak_bytes"], 0) << row["entry"];
    EXPECT_EQ(row["predicted_cuda_reserved_bytes"], 0) << row["entry"];
  }
  EXPECT_TRUE(json["losses_equal"].get<bool>());
  EXPECT_LT(rows[2]["peak_bytes"].get<int64_t>(), rows[0]["peak_bytes"].get<int64_t>());
  EXPECT_EQ(rows[0]["ops_recomputed"], 0);
  EXPECT_GT(rows[2]["ops_recomputed"].get<int64_t>(), 0);

  // A line per entry, then the table on stdout with the ratios to none.
  EXPECT_NE(r.output.find("[3/3] full:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("x none"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("warning"), std::string::npos) << r.output;

  // Without none the ratios are to the first entry, and run.progress=false drops the lines.
  const Result q = run_remat("bench --policies 'every:2;full' run.progress=false --out " + out + " " + common);
  ASSERT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("ratios are to the first entry, every:2"), std::string::npos) << q.output;
  EXPECT_NE(q.output.find("x first"), std::string::npos) << q.output;
  EXPECT_EQ(q.output.find("[1/2]"), std::string::npos) << q.output;
  EXPECT_TRUE(fs::exists(out + "-2/bench.csv")) << q.output;  // the first run's directory is kept
}

TEST_F(Cli, BenchPricesTheCopiesOfAnEntryThatOffloads) {
  const std::string out = (dir_ / "bench").string();
  const Result r = run_remat(
      "bench --policies 'full;full+offload:[input]' --steps 1 --warmup 0 --out " + out +
      " model.preset=tiny-gpt2 model.vocab_size=0 train.batch=4 train.seq=32 data.vocab_size=512 run.threads=1 "
      "data.text=" +
      file("corpus.txt", remat::testing::make_text(1500)) + " data.dir=" + (dir_ / "data").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream json_file(out + "/bench.json");
  const auto rows = nlohmann::json::parse(json_file)["rows"];
  ASSERT_EQ(rows.size(), 2u);
  // The same plan but for the copies there and back, which the host copies measured price:
  // the step adds the time the compute waits for them.
  const auto seconds = [&](size_t row, const char* key) { return rows[row][key].get<double>(); };
  EXPECT_GT(seconds(0, "predicted_step_seconds"), 0.0);
  EXPECT_EQ(seconds(0, "predicted_copy_seconds"), 0.0);
  EXPECT_GT(seconds(1, "predicted_copy_seconds"), 0.0);
  EXPECT_GE(seconds(1, "predicted_copy_wait_seconds"), 0.0);
  EXPECT_LE(seconds(1, "predicted_copy_wait_seconds"), seconds(1, "predicted_copy_seconds"));
  EXPECT_NEAR(seconds(1, "predicted_step_seconds"),
              seconds(0, "predicted_step_seconds") + seconds(1, "predicted_copy_wait_seconds"),
              1e-12 * seconds(0, "predicted_step_seconds"));
}

TEST_F(Cli, BenchRefusesABadEntryBeforeRunningAnything) {
  const std::string out = (dir_ / "bench").string();
  expect_error("bench --policies 'none;every:0' model.preset=tiny-gpt2 train.seq=32 --out " + out,
               "Bench entry 'every:0': ");
  EXPECT_FALSE(fs::exists(out));
  expect_error("bench --policies ''", "--policies is empty");
  expect_error("bench --policies ' ; '", "--policies is empty");
  expect_error("bench --budgets ''", "--budgets is empty");
  expect_error("bench --steps 0", "--steps must be at least 1");
  // Tensor parallelism needs its ranks, started by a launcher: the sentence shows how.
  expect_error("bench model.preset=tiny-gpt2 train.seq=32 parallel.tp=2 --out " + out,
               "parallel.dp = 0 x parallel.tp = 2 asks for 2 ranks, but this process runs alone; start the run with "
               "`remat launch --nproc 2 bench ...`");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(Cli, HelpConfigListsEveryKey) {
  const Result r = run_remat("train --help-config");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("train.grad_accum"), std::string::npos);
  // A number key shows the values it accepts, and some that work.
  EXPECT_NE(r.output.find("transformer blocks [from 1 to 1024 layers; e.g. 12 (GPT-2), 32 (Llama 3 8B)]"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("llama3-8b"), std::string::npos);
}

}  // namespace

namespace {

// Also under ZeRO-3, where the gathered weights at the peak are parts of their own.
TEST_F(Cli, PlanPrintsThePlanAndItsBreakdownAsJson) {
  for (const std::string zero : {"", " parallel.dp=2 parallel.zero=3"}) {
    const Result r = run_remat("plan --json --budget 0.6 model.preset=gpt2-demo" + zero + no_corpus());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["plan"].size(), 4u);
    EXPECT_LE(j["breakdown"]["peak"].get<int64_t>(), j["budget"].get<int64_t>());
    EXPECT_LT(j["min_feasible_budget"].get<int64_t>(), j["budget"].get<int64_t>());
    EXPECT_GT(j["frontier"].size(), 2u);
    EXPECT_EQ(j["manual"][0]["label"], "none");
    EXPECT_EQ(j["manual"][0]["peak"], j["none_peak"]);
    // The parts of the breakdown add up to the peak.
    const auto& b = j["breakdown"];
    int64_t parts = 0;
    for (const char* k : {"parameters", "gradients", "optimizer", "compute_copies", "batch", "kept_activations",
                          "kept_weights", "running_weights", "working_set"}) {
      EXPECT_GE(b[k].get<int64_t>(), 0) << k << zero;
      parts += b[k].get<int64_t>();
    }
    EXPECT_LE(b["peak"].get<int64_t>() - parts, 16 * 1024) << zero;  // the allowance for scalars
    EXPECT_GE(b["peak"].get<int64_t>() - parts, 0) << zero;
    EXPECT_EQ(b["running_weights"].get<int64_t>() > 0, !zero.empty());
  }
}

// A run reads its token corpus from disk as it draws batches (mapped, never held), so
// remat plan names the corpus and its size, before and after it is prepared, and the plan's
// bytes do not change with it.
TEST_F(Cli, PlanNamesTheTokenCorpusWhichHoldsNoMemory) {
  const std::string data = " data.vocab_size=512 data.text=" + file("corpus.txt", remat::testing::make_text(1000)) +
                           " data.dir=" + (dir_ / "data").string();
  const std::string shape = " model.preset=tiny-gpt2 model.vocab_size=0 train.batch=2 train.seq=16";
  const std::string plan = "plan --json --budget 0.9" + shape + data;
  const std::string corpus_dir = (dir_ / "data" / "corpus-v512").string();
  const Result before = run_remat(plan);
  ASSERT_EQ(before.exit_code, 0) << before.output;
  EXPECT_EQ(nlohmann::json::parse(before.output)["token_corpus_tokens"], 0);
  const Result text = run_remat("plan" + shape + data);
  EXPECT_NE(text.output.find("token corpus: " + corpus_dir + ", not prepared yet (remat prepare)\n"), std::string::npos)
      << text.output;

  const Result prepared = run_remat("prepare" + data);
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  const auto meta = nlohmann::json::parse(read_text(dir_ / "data" / "corpus-v512" / "meta.json"));
  const int64_t tokens =
      meta["tokens"]["train"]["count"].get<int64_t>() + meta["tokens"]["val"]["count"].get<int64_t>();
  const Result after = run_remat(plan);
  ASSERT_EQ(after.exit_code, 0) << after.output;
  const auto a = nlohmann::json::parse(after.output), b = nlohmann::json::parse(before.output);
  EXPECT_EQ(a["token_corpus_tokens"].get<int64_t>(), tokens);
  EXPECT_EQ(a["none_peak"], b["none_peak"]);
  EXPECT_EQ(a["breakdown"], b["breakdown"]);
  const Result text_after = run_remat("plan" + shape + data);
  EXPECT_NE(text_after.output.find(
                fmt::format("token corpus: {}, {} tokens read from disk as batches are drawn\n", corpus_dir, tokens)),
            std::string::npos)
      << text_after.output;
}

// Under tensor parallelism remat plan prices the collectives at parallel.link_rate and
// says what they take: a step's own (twice as long at half the rate) and those the
// recompute re-runs (none without recompute, some under a tight budget).
TEST_F(Cli, PlanNamesTheCommunicationTimeItPriced) {
  const auto line = [&](const std::string& args) {
    const Result r = run_remat("plan model.preset=gpt2-demo parallel.tp=2 parallel.sp=true " + args + no_corpus());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const size_t at = r.output.find("communication at parallel.link_rate = ");
    EXPECT_NE(at, std::string::npos) << r.output;
    return at == std::string::npos ? std::string() : r.output.substr(at, r.output.find('\n', at) - at);
  };
  const auto step_ms = [](const std::string& l) {
    const size_t at = l.find("collectives take ");
    return at == std::string::npos ? -1.0 : std::stod(l.substr(at + 17));
  };
  const auto recompute_ms = [](const std::string& l) {
    const size_t at = l.find("re-runs ");
    return at == std::string::npos ? -1.0 : std::stod(l.substr(at + 8));
  };
  // Without latency the bytes alone take the time, twice as long at half the rate.
  const std::string loose = line("--budget 1.0 parallel.link_latency=0"),
                    half = line("--budget 1.0 parallel.link_latency=0 parallel.link_rate=50");
  EXPECT_NE(loose.find("= 100 GB/s and parallel.link_latency = 0 us: the recompute re-runs 0.000 ms of collectives "
                       "per step"),
            std::string::npos)
      << loose;
  EXPECT_NE(half.find("= 50 GB/s"), std::string::npos) << half;
  EXPECT_GT(step_ms(loose), 0) << loose;
  EXPECT_NEAR(step_ms(half), 2 * step_ms(loose), 0.002) << loose << "\n" << half;
  const std::string tight = line("--budget 0.4");
  EXPECT_GT(recompute_ms(tight), 0) << tight;
  const Result json =
      run_remat("plan --json --budget 0.4 model.preset=gpt2-demo parallel.tp=2 parallel.sp=true" + no_corpus());
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const auto c = nlohmann::json::parse(json.output)["communication"];
  EXPECT_EQ(c["link_rate_gb_per_s"].get<double>(), 100);
  EXPECT_EQ(c["link_latency_us"].get<double>(), 2);
  EXPECT_NEAR(c["recompute_seconds"].get<double>() * 1e3, recompute_ms(tight), 0.001);
  expect_error("plan parallel.link_rate=0",
               "parallel.link_rate must be from 0.001 to 1000000 GB/s, got 0; it is the rate a rank sends at");
  expect_error("plan parallel.compute_rate=-1",
               "parallel.compute_rate must be from 0.001 to 1000000 TFLOP/s, got -1; it is the rate one rank's "
               "matmuls reach");
  expect_error("plan parallel.link_latency=-1",
               "parallel.link_latency must be from 0 to 1000000 microseconds, got -1; it is what one ring step");
}

// An offload policy's copies at ac.offload_rate: every layer's input (B x T x C float32)
// to host memory and back, its seconds the bytes both ways at that rate, in text and JSON.
// On the CPU the copies take the compute's cores: it waits for all of them. On CUDA they
// run beside it, but a layer's compute at parallel.compute_rate is far shorter than its
// copies, so the compute still waits for nearly all of them.
TEST_F(Cli, PlanPricesOffloadCopiesAtTheOffloadRate) {
  const std::string args = " model.preset=gpt2-demo train.batch=2 train.seq=64 ac.policy=full+offload:[input]";
  const Result json = run_remat("plan --json ac.offload_rate=10" + args + no_corpus());
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const auto o = nlohmann::json::parse(json.output)["offload"];
  const remat::ModelConfig m = remat::model_preset("gpt2-demo");
  const int64_t input = 2 * 64 * m.d_model * 4;
  EXPECT_EQ(o["bytes_each_way"].get<int64_t>(), m.n_layer * input);
  EXPECT_EQ(o["host_peak"].get<int64_t>(), m.n_layer * input);
  EXPECT_NEAR(o["seconds"].get<double>(), 2.0 * static_cast<double>(m.n_layer * input) / 10e9, 1e-12);
  EXPECT_DOUBLE_EQ(o["wait_seconds"].get<double>(), o["seconds"].get<double>());
  // An ac.host_budget beside the policy bounds its offload, as it bounds a budget's plan;
  // it was once ignored there.
  const Result within =
      run_remat("plan ac.host_budget=" + std::to_string(m.n_layer * input) + "B" + args + no_corpus());
  EXPECT_EQ(within.exit_code, 0) << within.output;
  expect_error("plan ac.host_budget=" + std::to_string(m.n_layer * input - 1) + "B" + args + no_corpus(),
               "The policy full+offload:[input] keeps ");
  expect_error("plan ac.host_budget=0" + args + no_corpus(),
               "of offloaded slots in host memory at once (predicted), "
               "more than ac.host_budget = \"0\" (0 B); offload fewer");
  const Result cuda = run_remat("plan --json ac.offload_rate=10 run.device=cuda" + args + no_corpus());
  ASSERT_EQ(cuda.exit_code, 0) << cuda.output;
  const auto beside = nlohmann::json::parse(cuda.output)["offload"];
  EXPECT_DOUBLE_EQ(beside["seconds"].get<double>(), o["seconds"].get<double>());
  EXPECT_LT(beside["wait_seconds"].get<double>(), beside["seconds"].get<double>());
  EXPECT_GT(beside["wait_seconds"].get<double>(), 0.9 * beside["seconds"].get<double>());
  // Per layer, the share of its copies hidden: none on the CPU; all of them on CUDA where
  // the compute is slow enough to cover them, and the input is read last by the backward.
  for (const auto& layer : nlohmann::json::parse(json.output)["plan"]) EXPECT_EQ(layer["copies_hidden"], 0.0);
  const std::string slow =
      " model.preset=gpt2-demo train.batch=2 train.seq=64 run.device=cuda parallel.compute_rate=0.001"
      " ac.offload_rate=10 ac.policy=modules:[core_attn]+offload:[input]";
  const Result hidden = run_remat("plan --json" + slow + no_corpus());
  ASSERT_EQ(hidden.exit_code, 0) << hidden.output;
  for (const auto& layer : nlohmann::json::parse(hidden.output)["plan"]) EXPECT_EQ(layer["copies_hidden"], 1.0);
  const auto hidden_copies = nlohmann::json::parse(hidden.output)["offload"];
  EXPECT_EQ(hidden_copies["wait_seconds"].get<double>(), 0.0);
  // Compute beside every copy throughout: it loses ac.offload_slowdown of each copy's time.
  EXPECT_NEAR(hidden_copies["slowdown_seconds"].get<double>(), 0.17 * hidden_copies["seconds"].get<double>(),
              1e-9 * hidden_copies["seconds"].get<double>());
  const Result lossless = run_remat("plan --json ac.offload_slowdown=0" + slow + no_corpus());
  ASSERT_EQ(lossless.exit_code, 0) << lossless.output;
  EXPECT_EQ(nlohmann::json::parse(lossless.output)["offload"]["slowdown_seconds"].get<double>(), 0.0);
  const auto layers = nlohmann::json::parse(json.output)["plan"];
  EXPECT_EQ(static_cast<int64_t>(layers.size()), m.n_layer);
  for (const auto& layer : layers) {
    EXPECT_EQ(layer["offloaded"], nlohmann::json::array({"input"}));
    EXPECT_EQ(layer["host_bytes"].get<int64_t>(), input);
  }
  const Result text = run_remat("plan ac.offload_rate=10" + args + no_corpus());
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("offload copies at ac.offload_rate = 10 GB/s: 256.00 KiB to host memory and back a "
                             "step, 0.1 ms of copies beside the compute, which waits 0.1 ms for them"),
            std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find("layers       kept each   recompute each   host each  hidden  keeps"), std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find(" 64.00 KiB      0%  "), std::string::npos) << text.output;
  // `full` recomputes a layer from its input as its backward starts, so with slow compute
  // each layer waits for its whole copy back; started with the backward of the layer above
  // (every layer but the top one), they hide behind it, and only the top layer waits.
  const std::string full_slow =
      " model.preset=gpt2-demo train.batch=2 train.seq=64 run.device=cuda parallel.compute_rate=0.001"
      " ac.offload_rate=10 ac.policy=full+offload:[input]";
  const Result late = run_remat("plan --json" + full_slow + no_corpus());
  const Result early = run_remat("plan --json ac.offload_prefetch=true" + full_slow + no_corpus());
  ASSERT_EQ(late.exit_code, 0) << late.output;
  ASSERT_EQ(early.exit_code, 0) << early.output;
  const auto waited = nlohmann::json::parse(late.output)["offload"];
  const auto prefetched = nlohmann::json::parse(early.output);
  EXPECT_EQ(prefetched["offload"]["seconds"].get<double>(), waited["seconds"].get<double>());
  EXPECT_NEAR(prefetched["offload"]["wait_seconds"].get<double>(),
              waited["wait_seconds"].get<double>() / static_cast<double>(m.n_layer),
              1e-9 * waited["wait_seconds"].get<double>());
  for (const auto& layer : prefetched["plan"]) {
    EXPECT_EQ(layer["prefetch"], layer["layer"].get<int64_t>() < m.n_layer) << layer;
  }
  expect_error("plan ac.offload_prefetch=true", "ac.offload_prefetch = true brings a layer's offloaded slots back");
  expect_error("plan ac.offload_prefetch=true ac.budget=0.8", "fixes that choice; keep one of them");
  expect_error("plan ac.offload_rate=0",
               "ac.offload_rate must be from 0.001 to 1000000 GB/s, got 0; it is the rate copies move at between "
               "the device and host");
  // A rate of 1e-30 once printed a copy time of 31 digits.
  expect_error("plan ac.offload_rate=1e-30", "ac.offload_rate must be from 0.001 to 1000000 GB/s, got 1e-30;");
  expect_error("plan ac.offload_slowdown=1",
               "ac.offload_slowdown must be from 0 to below 1, got 1; it is the share of each second a copy");
}

// ac.host_budget lets a budget's plan offload: below the least budget recompute alone fits,
// the plan offloads within the host budget; without one (the CPU's default, 0) the same
// budget is refused. A CUDA run's default host budget is the host memory free.
TEST_F(Cli, PlanOffloadsWithinTheHostBudgetWhereRecomputeAloneCannotFit) {
  const std::string args = " model.preset=gpt2-demo train.batch=2 train.seq=64" + no_corpus();
  const Result alone = run_remat("plan --json ac.budget=0.9" + args);
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  const auto a = nlohmann::json::parse(alone.output);
  EXPECT_EQ(a["host_budget"].get<int64_t>(), 0);
  const int64_t least = a["min_feasible_budget"].get<int64_t>();
  const std::string below = fmt::format(" ac.budget={}", least - 1);
  const Result refused = run_remat("plan" + below + args);
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  const Result json = run_remat("plan --json ac.host_budget=1GiB" + below + args);
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const auto j = nlohmann::json::parse(json.output);
  EXPECT_EQ(j["host_budget"].get<int64_t>(), int64_t{1} << 30);
  EXPECT_LT(j["min_feasible_budget"].get<int64_t>(), least);
  EXPECT_GT(j["offload"]["host_peak"].get<int64_t>(), 0);
  EXPECT_LE(j["offload"]["host_peak"].get<int64_t>(), int64_t{1} << 30);
  const Result text = run_remat("plan ac.host_budget=1GiB" + below + args);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("to host memory"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("host memory 1.00 GiB (ac.host_budget)"), std::string::npos) << text.output;
  const Result cuda = run_remat("plan --json run.device=cuda" + args);
  ASSERT_EQ(cuda.exit_code, 0) << cuda.output;
  EXPECT_GT(nlohmann::json::parse(cuda.output)["host_budget"].get<int64_t>(), 0);
  expect_error("plan ac.host_budget=lots", "ac.host_budget = \"lots\" is not a size");
}

// An offload term names slots of every architecture's block; a slot this one lacks (a
// llama block keeps no attn.resid) moves nothing, so the plan does not claim it, and a term
// that moves nothing at all is refused.
TEST_F(Cli, PlanOffloadsOnlySlotsTheBlockHas) {
  const std::string llama = " model.preset=llama-demo" + no_corpus();
  const Result some = run_remat("plan ac.policy=offload:[input,attn.resid]" + llama);
  ASSERT_EQ(some.exit_code, 0) << some.output;
  EXPECT_NE(some.output.find("offloads input to host memory"), std::string::npos) << some.output;
  EXPECT_EQ(some.output.find("attn.resid"), some.output.find("offload:[input,attn.resid]") + 15) << some.output;
  expect_error("plan ac.policy=offload:[attn.resid]" + llama,
               "The policy \"offload:[attn.resid]\" offloads only attn.resid, which a llama block does not have, so "
               "it would move nothing; offload some of its slots: input, attn.norm");
}

// Each ring step of a collective waits parallel.link_latency: a step's collectives take
// exactly its ring steps (the graphs' LinkTraffic messages: blocks, embedding and loss
// head, per microbatch) times the latency longer than without it.
TEST_F(Cli, PlanPricesEachRingStepAtTheLinkLatency) {
  const std::vector<std::string> settings = {"model.preset=gpt2-demo", "model.vocab_size=512", "parallel.tp=2",
                                             "parallel.sp=true",       "train.batch=2",        "train.seq=64",
                                             "train.ce_chunk=48",      "train.grad_accum=2"};
  std::string args;
  for (const auto& s : settings) args += " " + s;
  const auto step_seconds = [&](const std::string& latency) {
    const Result r = run_remat("plan --json --budget 1.0 parallel.link_latency=" + latency + args + no_corpus());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.exit_code == 0 ? nlohmann::json::parse(r.output)["communication"]["step_seconds"].get<double>() : -1.0;
  };
  const remat::Config cfg = remat::load_config("", settings);
  const remat::ModelConfig& m = cfg.model;
  const int64_t B = cfg.train.batch, T = cfg.train.seq, tp = cfg.parallel.tp;
  const auto messages = [](const remat::graph::BlockGraph& g) {
    int64_t n = 0;
    for (const auto& node : g.nodes) n += node.forward_link.messages + node.backward_link.messages;
    return n;
  };
  remat::Layout layout;
  layout.tp = tp;
  layout.sp = cfg.parallel.sp;
  const remat::graph::BlockGraph head = remat::graph::head_graph(m, B, T, at::kFloat, cfg.train.ce_chunk, layout);
  layout.sp = true;
  const int64_t steps =
      cfg.train.grad_accum * (m.n_layer * messages(remat::graph::block_graph(m, B, T, at::kFloat, layout)) +
                              messages(remat::graph::embed_graph(m, B, T, at::kFloat, layout)) + messages(head));
  // The loss head's statistics are among them: three all-reduces in each of its 3 chunks.
  ASSERT_GE(messages(head), 3 * 3 * 2 * (tp - 1));
  const double without = step_seconds("0"), with = step_seconds("7.5");
  EXPECT_GT(without, 0);
  EXPECT_NEAR(with - without, static_cast<double>(steps) * 7.5e-6, 1e-12 * with);
}

// The step at declared rates: the simulated passes (the weights gathered again for each
// layer's backward among them) and the other data-parallel collectives, all at their own
// links, which a rate twice as high (with no latency) takes half the time over; each rank
// trains its share of the batch's tokens in it.
TEST_F(Cli, PlanPredictsTheStepAtTheDeclaredRates) {
  const std::string args =
      " model.preset=gpt2-demo model.vocab_size=512 parallel.dp=2 parallel.zero=3 train.batch=4 train.seq=64 "
      "parallel.dp_link_latency=0" +
      no_corpus();
  const auto plan = [&](const std::string& rate) {
    const Result r = run_remat("plan --json parallel.dp_link_rate=" + rate + args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.exit_code == 0 ? nlohmann::json::parse(r.output) : nlohmann::json();
  };
  const nlohmann::json slow = plan("1"), fast = plan("2");
  ASSERT_FALSE(slow.is_null());
  ASSERT_FALSE(fast.is_null());
  const double collectives = slow["declared_data_parallel_seconds"].get<double>();
  EXPECT_GT(slow["breakdown"]["data_parallel"]["gather_bytes"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(collectives, slow["breakdown"]["data_parallel"]["seconds"].get<double>());
  EXPECT_DOUBLE_EQ(fast["declared_data_parallel_seconds"].get<double>(), collectives / 2);
  const double again = slow["breakdown"]["data_parallel"]["regather_seconds"].get<double>();
  EXPECT_GT(again, 0);
  EXPECT_DOUBLE_EQ(fast["breakdown"]["data_parallel"]["regather_seconds"].get<double>(), again / 2);
  const double step = slow["declared_step_seconds"].get<double>();
  EXPECT_NEAR(step - fast["declared_step_seconds"].get<double>(), (collectives + again) / 2, 1e-12 * step);
  EXPECT_NEAR(slow["declared_tokens_per_second_per_rank"].get<double>(), 2 * 64 / step, 1e-9 * 2 * 64 / step);
}

TEST_F(Cli, PlanOfAn8BLlamaAt8kTokens) {
  const Result r = run_remat(
      "plan --budget 200GiB model.preset=llama3-8b train.batch=1 train.seq=8192 "
      "run.dtype=bfloat16" +
      no_corpus());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("32 layers"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("minimum feasible 145.06 GiB"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", optimizer 59.83 GiB, "), std::string::npos) << r.output;
}

// GPT-2's 50257-piece vocabulary is padded to split over the ranks: over 4 (GPT-2's 12 heads
// allow no 8) each rank holds 50260 / 4 rows of wte; GPT-2 medium over 8, 50264 / 8, or
// 51200 / 8 with Megatron's make_vocab_size_divisible_by = 128.
TEST_F(Cli, PlanOfGpt2OverTensorParallelRanksPadsItsVocabulary) {
  // One rank's float32 parameters: its rows of wte, all of wpe, per layer the norms, its share
  // of c_attn, c_fc (weights and biases) and of the projections' weights, their biases whole.
  const auto param_bytes = [](int64_t C, int64_t L, int64_t t, int64_t vocab) {
    const int64_t layer =
        2 * C + (C * 3 * C + 3 * C) / t + C * C / t + C + 2 * C + (C * 4 * C + 4 * C) / t + 4 * C * C / t + C;
    return 4 * (vocab / t * C + 1024 * C + L * layer + 2 * C);
  };
  const std::tuple<std::string, int64_t> cases[] = {
      {"model.preset=gpt2 parallel.tp=4", param_bytes(768, 12, 4, 50260)},
      {"model.preset=gpt2-medium parallel.tp=8", param_bytes(1024, 24, 8, 50264)},
      {"model.preset=gpt2-medium parallel.tp=8 model.vocab_multiple=128", param_bytes(1024, 24, 8, 51200)}};
  for (const auto& [args, bytes] : cases) {
    const Result r = run_remat("plan --json train.batch=1 train.seq=1024 " + args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(nlohmann::json::parse(r.output)["breakdown"]["parameters"].get<int64_t>(), bytes) << args;
  }
}

// A pipeline's plan: each stage's layers, what they keep and its peak within the per-rank
// budget, the bottleneck, and the even split for comparison; training one is refused.
TEST_F(Cli, PlanOfAPipelineSplitsTheLayersAndPlansEachStage) {
  const Result r = run_remat(
      "plan --json --budget 0.7 model.preset=llama-demo model.n_layer=8 parallel.pp=4 "
      "train.grad_accum=8");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  ASSERT_EQ(j["stages"].size(), 4u);
  int64_t layers = 0;
  for (const auto& st : j["stages"]) {
    EXPECT_LE(st["breakdown"]["peak"].get<int64_t>(), j["budget"].get<int64_t>());
    EXPECT_EQ(st["first_layer"].get<int64_t>(), layers + 1);
    layers += st["layers"].get<int64_t>();
  }
  EXPECT_EQ(layers, 8);
  EXPECT_EQ(j["stages"][0]["in_flight"], 4);
  EXPECT_EQ(j["stages"][3]["in_flight"], 1);
  EXPECT_LE(j["schedule_flops"].get<double>(), j["even_split_schedule_flops"].get<double>());
  // ColossalAI's counts on the even split are one of the plans the joint planner weighs.
  const auto& counts = j["least_ckpt_layers_per_stage"];
  ASSERT_EQ(counts["counts"].size(), 4u);
  for (const auto& c : counts["counts"]) EXPECT_LE(c.get<int64_t>(), 2);
  EXPECT_GT(counts["counts"][0].get<int64_t>(), 0);
  EXPECT_LE(j["schedule_flops"].get<double>(), counts["schedule_flops"].get<double>());

  const Result text = run_remat(
      "plan --budget 0.7 model.preset=llama-demo model.n_layer=8 parallel.pp=4 "
      "train.grad_accum=8");
  ASSERT_EQ(text.exit_code, 0) << text.output;
  for (const char* part :
       {"pipeline: 4 stages, 1f1b schedule, 8 microbatches", "stage 1: layers 1-", "4 microbatches in flight",
        "bottleneck: stage ", "the even split (2,2,2,2)",
        "ColossalAI's least per-stage counts on the even split (2,2,2,2): num_ckpt_layers_per_stage = ["}) {
    EXPECT_NE(text.output.find(part), std::string::npos) << part << "\n" << text.output;
  }
  expect_error("plan --budget 1MiB model.preset=llama-demo parallel.pp=2",
               "fits no plan of llama-demo on 2 pipeline stages (1f1b schedule, 1 microbatch): the least budget "
               "every stage fits is");
  expect_error("train parallel.pp=2",
               "parallel.dp = 0 x parallel.tp = 1 x parallel.pp = 2 asks for 2 ranks, but "
               "this process runs alone; start the run with `remat launch --nproc 2 train");
}

// A pipeline over tensor-parallel ranks names the collectives of its bottleneck stage, the
// one the schedule waits on, and each stage's: together a step's collectives without the
// pipeline. Without tensor parallelism there are none to name.
TEST_F(Cli, PlanOfATensorParallelPipelineNamesItsBottlenecksCommunication) {
  const std::string model = " model.preset=llama-demo model.n_layer=4 parallel.tp=2 train.grad_accum=4" + no_corpus();
  const Result pipe = run_remat("plan --json --budget 1.0 parallel.pp=2" + model);
  const Result whole = run_remat("plan --json --budget 1.0" + model);
  ASSERT_EQ(pipe.exit_code, 0) << pipe.output;
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto p = nlohmann::json::parse(pipe.output);
  const auto& c = p["communication"];
  const int64_t bottleneck = p["bottleneck"].get<int64_t>();
  EXPECT_EQ(c["stage"].get<int64_t>(), bottleneck);
  EXPECT_EQ(c["link_latency_us"].get<double>(), 2);
  EXPECT_EQ(c["step_seconds"].get<double>(),
            p["stages"][static_cast<size_t>(bottleneck - 1)]["communication"]["step_seconds"].get<double>());
  double stages = 0;
  for (const auto& st : p["stages"]) {
    EXPECT_GT(st["communication"]["step_seconds"].get<double>(), 0);
    stages += st["communication"]["step_seconds"].get<double>();
  }
  const double all = nlohmann::json::parse(whole.output)["communication"]["step_seconds"].get<double>();
  EXPECT_NEAR(stages, all, 1e-12 * all);

  const Result text = run_remat("plan --budget 1.0 parallel.pp=2" + model);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  const std::string line = fmt::format(
      "communication at parallel.link_rate = 100 GB/s and parallel.link_latency = 2 "
      "us on stage {}'s ranks (the bottleneck): the recompute re-runs ",
      bottleneck);
  EXPECT_NE(text.output.find(line), std::string::npos) << line << "\n" << text.output;
  const Result alone =
      run_remat("plan --budget 1.0 parallel.pp=2 model.preset=llama-demo model.n_layer=4" + no_corpus());
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_EQ(alone.output.find("communication at"), std::string::npos) << alone.output;
}

TEST_F(Cli, ExplainBlockListsEveryValueWithItsSlot) {
  const Result r = run_remat("plan --explain-block model.preset=llama-demo train.batch=2 train.seq=16");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The attention probabilities of 2 x 4 heads x 16 x 16 float32 scores, kept as attn.probs,
  // in the rows' order: 2 key/value heads x 16 positions x 2 query heads each.
  EXPECT_NE(r.output.find("attention.probs"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[2, 2, 16, 2, 16]  float32    8.00 KiB  attn.probs     attention (attention)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("view  attn.qkv       v_heads (view), view of v_proj"), std::string::npos) << r.output;
}

TEST_F(Cli, PlanBelowTheMinimumStatesTheMinimumAndWhatFillsIt) {
  expect_error(
      "plan --budget 60GiB model.preset=llama3-8b train.batch=1 train.seq=8192 run.dtype=bfloat16" + no_corpus(),
      "is below the minimum feasible 145.06 GiB for llama3-8b at batch 1 x 8192 tokens in bfloat16");
  expect_error("plan --budget '12 parsecs'", "The memory budget \"12 parsecs\" is not a size");
  expect_error("plan --budget 0", "The memory budget \"0\" leaves no memory; give a size above 0");
}

TEST_F(Cli, ParetoPlotsTheFrontierWithTheManualPolicies) {
  const std::string png = (dir_ / "frontier.png").string();
  const Result r = run_remat("plan --pareto --budget 0.5 --plot " + png);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("frontier (budget plans)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("modules:[core_attn]"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(png)) << r.output;
}

// A plot gnuplot cannot write (its path is a directory) fails the command, after the tables.
TEST_F(Cli, AFailedPlotIsAnError) {
  fs::create_directories(dir_ / "taken.png");
  const Result r = run_remat("plan --pareto --budget 0.5 --plot " + (dir_ / "taken.png").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("frontier (budget plans)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error: The frontier could not be plotted to --plot = "), std::string::npos) << r.output;
}

// Each path would run `touch injected` through gnuplot if it were pasted into the plot
// script: a quote that ends gnuplot's string and calls system(), and a leading '|', which
// makes gnuplot pipe the plot into a shell command. Both must be plain file names.
TEST_F(Cli, PlotPathsNeverRunAsGnuplotCode) {
  for (const std::string png : {"a' . system('touch injected') . '.png", "|touch injected"}) {
    const Result r = run_remat("plan --pareto --budget 0.5 --plot \"" + png + "\"", dir_.path());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir_ / png)) << r.output;
    EXPECT_FALSE(fs::exists(dir_ / "injected")) << png;
  }
}

// A shared config.toml whose run.out_dir ends a line and starts a gnuplot command.
TEST_F(Cli, AControlCharacterInAPathIsRefusedBeforeAnythingRuns) {
  const std::string marker = (dir_ / "injected").string();
  const std::string cfg = file("shared.toml", "[run]\nout_dir = \"runs\\nsystem('touch " + marker + "')\\n\"\n");
  expect_error("train --config " + cfg + " train.steps=1",
               "run.out_dir in " + cfg + " holds a control character at offset 4: 'runs\\nsystem('touch " + marker +
                   "')\\n'; config values are printed");
  expect_error("plan --pareto --plot \"$(printf 'a\\tb.png')\"", "--plot = 'a\\tb.png' holds a control character");
  EXPECT_FALSE(fs::exists(marker));
}

// Starts `remat args` in the background, its output discarded; returns its process id.
pid_t spawn_remat(const std::string& args, const fs::path& cwd) {
  const std::string cmd =
      "cd '" + cwd.string() + "' && exec " + remat::testing::kRematBinary + " " + args + " >/dev/null 2>&1";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

// The exit code of a finished child, 128 + the signal that ended it.
int wait_for(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::vector<double> train_losses(const fs::path& run) {
  std::ifstream in(run / "metrics.jsonl");
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") out.push_back(j["loss"].get<double>());
  }
  return out;
}

// A run killed (SIGKILL, or SIGTERM, which checkpoints and exits) at seeded random moments,
// a checkpoint written every step so that many kills land inside a write, then resumed
// until it finishes: its weights and every logged loss are bitwise the uninterrupted
// run's, and no temporary file is left.
TEST_F(Cli, ARunKilledAtRandomPointsAndResumedIsBitwiseTheUninterruptedRun) {
  const std::string settings = "train.steps=400 train.checkpoint_every=1 train.eval_every=100 run.sample_tokens=0";
  const Result whole = run_remat(tiny_training(settings + " run.name=whole"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const fs::path run = dir_ / "runs" / "cut";
  std::mt19937 rng(14);
  std::string args = tiny_training(settings + " run.name=cut");
  int kills = 0;
  for (int attempt = 0; attempt < 8; ++attempt) {
    const pid_t pid = spawn_remat(args, dir_.path());
    // Until a first checkpoint exists there is nothing to resume; then a random moment.
    while (!fs::exists(run / "checkpoints") && ::waitpid(pid, nullptr, WNOHANG) == 0) ::usleep(1000);
    ::usleep(std::uniform_int_distribution<useconds_t>(0, 400000)(rng));
    const bool term = attempt % 3 == 2;
    ::kill(pid, term ? SIGTERM : SIGKILL);
    const int code = wait_for(pid);
    if (code == 0) break;  // it finished first
    EXPECT_EQ(code, 128 + (term ? SIGTERM : SIGKILL));
    ++kills;
    args = "train --resume " + run.string();
  }
  EXPECT_GE(kills, 3);
  if (!fs::exists(run / "model.safetensors")) {
    const Result last = run_remat(args);
    ASSERT_EQ(last.exit_code, 0) << last.output;
  }
  EXPECT_EQ(train_losses(run), train_losses(dir_ / "runs" / "whole"));
  EXPECT_EQ(read_text(run / "model.safetensors"), read_text(dir_ / "runs" / "whole" / "model.safetensors"));
  for (const auto& e : fs::recursive_directory_iterator(run)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
}

// Where there is nothing to save yet (planning here; also preparing, measuring,
// generating), a signal ends the command at once with a sentence naming the phase and the
// shell's code, where it once ended it without a word. The 8B pipeline plan takes seconds.
TEST_F(Cli, ASignalWhilePlanningEndsItWithASentence) {
  const fs::path log = dir_ / "plan.log";
  const pid_t pid = remat::testing::start_shell(
      "exec " + std::string(remat::testing::kRematBinary) +
          " plan model.preset=llama3-8b run.device=cuda run.dtype=bfloat16 train.seq=8192 train.batch=1 "
          "ac.offload_rate=55 ac.host_budget=88GiB run.expandable_segments=true parallel.pp=4 train.grad_accum=8 "
          "ac.budget=50GiB",
      log);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  ::kill(pid, SIGTERM);
  EXPECT_EQ(remat::testing::wait_exit(pid), 128 + SIGTERM);
  const std::string output = read_text(log);
  EXPECT_NE(output.find("remat: terminated (SIGTERM) while planning; it ends here, and leaves no file half-written."),
            std::string::npos)
      << output;
}

// A closed terminal (SIGHUP) once killed a run where it stood, with no checkpoint and no
// word; it now stops the run after the step under way, as SIGTERM does.
TEST_F(Cli, AHangUpStopsTheRunAfterItsCheckpoint) {
  const fs::path run = dir_ / "runs" / "hup", log = dir_ / "hup.log";
  const pid_t pid = remat::testing::start_shell(
      "exec " + std::string(remat::testing::kRematBinary) + " " +
          tiny_training("train.steps=100000 train.checkpoint_every=100000 run.sample_tokens=0 run.name=hup"),
      log);
  // A step's metrics line means the training loop runs.
  const auto stepped = [&] {
    std::ifstream in(run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"train\"") != std::string::npos) return true;
    }
    return false;
  };
  while (!stepped() && ::waitpid(pid, nullptr, WNOHANG) == 0) ::usleep(1000);
  ::kill(pid, SIGHUP);
  EXPECT_EQ(remat::testing::wait_exit(pid), 128 + SIGHUP);
  const std::string output = read_text(log);
  EXPECT_NE(output.find("hung up (SIGHUP) after step "), std::string::npos) << output;
  EXPECT_NE(output.find("continue with `remat train --resume " + run.string() + "`"), std::string::npos) << output;
  EXPECT_TRUE(fs::exists(run / "checkpoints")) << output;
}

// --resume takes the keys of what a run writes after its last step (the sample may be
// skipped), and still refuses any that would change its training, naming those it takes.
TEST_F(Cli, AResumeMaySkipTheFinalSampleButNotChangeTheTraining) {
  const fs::path run = dir_ / "runs" / "finals";
  const Result first =
      run_remat(tiny_training("train.steps=4 train.checkpoint_every=2 run.sample_tokens=40 run.name=finals"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // As if stopped after step 2: the resume trains steps 3 and 4, where a trace is taken.
  fs::remove(run / "checkpoints" / "step-00000004.safetensors");
  fs::remove(run / "model.safetensors");
  fs::remove(run / "sample.txt");
  fs::remove(run / "summary.json");
  const Result refused = run_remat("train --resume " + run.string() + " run.sample_tokens=0 train.lr=1");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("(all but run.sample_tokens, run.prompt, run.progress, which change only the final "
                                "sample and the display)"),
            std::string::npos)
      << refused.output;
  // A config.toml from other hands naming a trace file once had the resume write it there;
  // a resumed run traces nothing again.
  std::string toml = read_text(run / "config.toml");
  const std::string unset = "trace = \"\"";
  ASSERT_NE(toml.find(unset), std::string::npos) << toml;
  toml.replace(toml.find(unset), unset.size(), "trace = \"" + (dir_ / "crafted.json").string() + "\"");
  std::ofstream(run / "config.toml") << toml;
  const Result resumed = run_remat("train --resume " + run.string() + " run.sample_tokens=0");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(fs::exists(run / "model.safetensors"));
  EXPECT_FALSE(fs::exists(run / "sample.txt"));
  EXPECT_FALSE(fs::exists(dir_ / "crafted.json"));
}

// A run trained on a GPU, met where there is none: the advice is one the command can follow
// (generate takes --device, and --resume changes no run.device).
TEST_F(Cli, AMissingGpuIsMetWithAdviceTheCommandTakes) {
  if (at::hasCUDA()) GTEST_SKIP() << "this machine has a GPU";
  const fs::path run = dir_ / "runs" / "gpu";
  ASSERT_EQ(run_remat(tiny_training("train.steps=2 run.name=gpu")).exit_code, 0);
  std::string toml = remat::util::read_file((run / "config.toml").string());
  const std::string cpu = "device = \"cpu\"";
  const size_t device = toml.find(cpu);
  ASSERT_NE(device, std::string::npos) << toml;
  toml.replace(device, cpu.size(), "device = \"cuda\"");
  remat::util::write_file_atomically((run / "config.toml").string(), toml);
  expect_error("generate --run " + run.string() + " --tokens 4",
               "--device cuda (the run's device where --device is not given) was asked for, but this LibTorch has no "
               "CUDA device available; sample on the CPU with --device cpu.");
  EXPECT_EQ(run_remat("generate --run " + run.string() + " --tokens 4 --device cpu").exit_code, 0);
  fs::remove(run / "model.safetensors");
  expect_error("train --resume " + run.string(),
               "The run trained on run.device=cuda, but this LibTorch has no CUDA device available; a run resumes on "
               "the device it trained on");
}

// A batch no plan fits on this machine allocated 61 GiB for two minutes (a matmul rate measured
// at its rows, then a time profile) before any refusal; it is refused from bytes alone (its
// least plan peaks at 2 TiB, past any machine the suite runs on).
TEST_F(Cli, ABatchNoPlanFitsIsRefusedBeforeAnythingAllocatesIt) {
  expect_error(tiny_training("train.batch=1048576 train.seq=256 model.max_seq=256"),
               "A step of train.batch=1048576 x train.seq=256 tokens peaks at ");
}

// Out-of-range numbers that once spawned 100000 threads, looped for ever, wrapped to
// negative sizes or overflowed the planner: each is refused before anything runs.
TEST_F(Cli, OutOfRangeSettingsAreRefusedBeforeAnythingRuns) {
  const std::string huge = "9223372036854775807";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train run.threads=100000", "run.threads must be from 0 to 1024, got 100000; 0 takes all cores."},
      {"train run.sample_tokens=99999999999",
       "run.sample_tokens must be from 0 to 10000 tokens, got 99999999999; the final sample is a glance at the model "
       "(0 samples nothing); `remat generate --tokens` writes up to 100000 from the run's weights."},
      {"train train.grad_accum=" + huge,
       "train.grad_accum must be from 1 to 65536 microbatches, got " + huge + "; 65536 a step is far past any run."},
      {"train train.steps=" + huge,
       "train.steps must be from 1 to 1073741824 steps, got " + huge + "; a billion is far past any run."},
      {"train train.batch=" + huge,
       "train.batch must be from 1 to 1048576 sequences, got " + huge + "; a million is far past any microbatch."},
      {"train ac.budget=1e30", "The memory budget \"1e30\" is 1e+30 bytes, beyond any device"},
      {"train train.lr=3e38",
       "train.lr must be above 0 and at most 10, got 3e+38; above 10 an AdamW step moves a weight by more than any "
       "model survives"},
      {"train train.weight_decay=-1",
       "train.weight_decay must be at least 0, got -1; a negative decay grows the weights every step; for example "
       "0.1, or 0 (off)."},
      {"train model.preset=tiny-llama model.rope_theta=0",
       "model.rope_theta must be above 1, got 0; at or below 1 the rotation frequencies are infinite"},
      {"train model.init_std=1e30", "model.init_std must be above 0 and at most 1, got 1e+30; larger weights overflow"},
      {"plan model.preset=llama3-8b model.max_seq=268435456 train.seq=268435456",
       "model.max_seq must be from 1 to 16777216 tokens, got 268435456; 16M tokens of context is far past any "
       "published model's"},
      {"plan model.preset=llama3-8b model.max_seq=16777216 train.seq=16777216 train.batch=64",
       "The attention probabilities of 32 layers at train.batch = 64 x train.seq = 16777216 with 32 heads"},
      {"plan --budget '' model.n_layer=2", "--budget \"\" gives --budget an empty value; give a budget"},
      {"plan --budget= model.n_layer=2",
       "--budget= gives --budget an empty value; write the value after '=' or "
       "leave the option out."},
      {"plan model.n_layer=10000",
       "model.n_layer must be from 1 to 1024 layers, got 10000; 1024 is eight times the deepest published "
       "transformer"},
      {"plan --budget 1.5", "is neither a fraction of the no-recompute peak"},
      {"train --explain-ac ac.budget=0.6",
       "--explain-ac prints the plan a policy compiles to, but ac.budget = \"0.6\""}};
  for (const auto& [args, sentence] : cases) expect_error(args, sentence);
}

// Rows past the tokenizer's vocabulary train like any other but are never sampled.
TEST_F(Cli, AModelVocabularyLargerThanTheTokenizersSamplesOnlyItsPieces) {
  const Result r = run_remat(tiny_training("model.vocab_size=700 train.steps=2 run.sample_tokens=40 run.name=padded"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "runs" / "padded" / "sample.txt")) << r.output;
}

TEST_F(Cli, AnExistingTraceFileIsNeverReplaced) {
  const std::string old = file("step.json", "an earlier trace");
  expect_error("train --trace " + old, "a file is there already, and the trace never replaces one");
  std::ifstream in(old);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "an earlier trace");
}

TEST_F(Cli, TrainingWithABudgetStaysWithinItAndPredictsItsPeak) {
  const std::string common =
      "model.preset=tiny-gpt2 model.vocab_size=0 train.steps=3 train.batch=4 train.seq=32 "
      "train.warmup=1 train.eval_batches=1 data.vocab_size=512 run.threads=1 "
      "run.sample_tokens=0 run.progress=false data.text=" +
      file("corpus.txt", remat::testing::make_text(1500)) + " data.dir=" + (dir_ / "data").string() +
      " run.out_dir=" + (dir_ / "runs").string();
  const Result r = run_remat("train ac.budget=0.7 run.name=b " + common);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("stayed within it"), std::string::npos) << r.output;
  std::ifstream in(dir_ / "runs" / "b" / "summary.json");
  const auto s = nlohmann::json::parse(in);
  EXPECT_LE(s["peak_bytes"].get<int64_t>(), s["budget_bytes"].get<int64_t>());
  EXPECT_NEAR(s["peak_bytes"].get<double>(), s["predicted_peak_bytes"].get<double>(),
              0.05 * s["predicted_peak_bytes"].get<double>());
  EXPECT_GT(s["predicted_step_seconds"].get<double>(), 0.0);
  // Beside it, what keeping everything would cost: more memory than the budget allows.
  EXPECT_NE(r.output.find("without recompute the step would peak at"), std::string::npos) << r.output;
  EXPECT_GT(s["predicted_none_peak_bytes"].get<int64_t>(), s["budget_bytes"].get<int64_t>());
  EXPECT_GT(s["predicted_none_step_seconds"].get<double>(), 0.0);
  // The time profile is cached, unless other processes loaded the machine while it was
  // measured (ctest runs tests side by side), which the run then says.
  EXPECT_TRUE(fs::exists(dir_ / "runs" / ".profiles") || r.output.find("does not cache it") != std::string::npos)
      << r.output;
  // A budget below the minimum fails before training, with the minimum.
  const Result low = run_remat("train ac.budget=1KiB run.name=c " + common);
  EXPECT_EQ(low.exit_code, 1) << low.output;
  EXPECT_NE(low.output.find("is below the minimum feasible"), std::string::npos) << low.output;
  // A budget and a policy at once are refused.
  expect_error("train ac.budget=0.7 ac.policy=full " + common, "keep one of them");
}

}  // namespace
