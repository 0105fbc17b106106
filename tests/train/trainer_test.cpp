// End-to-end training on a small generated corpus: determinism, the run directory, and
// sampling back from it.
#include "remat/safetensors.h"
#include "util/atomic_file.h"
#include "remat/policy.h"
#include "remat/tokenizer.h"
#include "remat/trainer.h"
#include "run/planning.h"
#include "train/checkpoint_files.h"
#include "train/step.h"
#include "util/error_of.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <functional>
#include <optional>
#include <random>
#include <thread>

namespace remat {
namespace {

namespace fs = std::filesystem;

class Trainer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_.emplace();
    std::ofstream text(*dir_ / "corpus.txt");
    const char* words[] = {"the",   "lord",     "said",   "unto",  "moses",  "and", "it",    "was",  "so",
                           "light", "darkness", "waters", "earth", "heaven", "day", "night", "good", "made"};
    uint64_t x = 12345;
    for (int line = 0; line < 1500; ++line) {
      for (int w = 0; w < 10; ++w) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        text << words[(x >> 33) % 18] << (w == 9 ? ".\n" : " ");
      }
    }
  }
  static void TearDownTestSuite() { dir_.reset(); }

  static Config config(const std::string& name) {
    return load_config(
        "", {"model.preset=tiny-gpt2", "model.vocab_size=0", "train.steps=4", "train.batch=2", "train.seq=16",
             "train.grad_accum=2", "train.warmup=1", "train.eval_every=2", "train.eval_batches=2",
             "data.vocab_size=300", "data.text=" + (*dir_ / "corpus.txt").string(),
             "data.dir=" + (*dir_ / "data").string(), "run.out_dir=" + (*dir_ / "runs").string(), "run.name=" + name,
             "run.threads=1", "run.sample_tokens=8", "run.progress=false"});
  }

  static inline std::optional<remat::testing::TempDir> dir_;  // the suite's scratch directory
};

TEST_F(Trainer, SameSeedGivesBitwiseTheSameLosses) {
  const TrainSummary a = train(config("a"));
  const TrainSummary b = train(config("b"));
  ASSERT_EQ(a.losses.size(), 4u);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.final_val_loss, b.final_val_loss);
  EXPECT_EQ(a.sample, b.sample);
  Config other = config("c");
  other.run.seed = 7;
  EXPECT_NE(train(other).losses, a.losses);
}

TEST_F(Trainer, WritesTheRunDirectory) {
  const TrainSummary s = train(config("files"));
  for (const char* f : {"config.toml", "plan.txt", "metrics.jsonl", "model.safetensors", "config.json",
                        "tokenizer.model", "sample.txt", "summary.json", "loss.png"}) {
    EXPECT_TRUE(fs::exists(fs::path(s.run_dir) / f)) << f;
  }
  // The config.json that loads model.safetensors into transformers: the run's shape.
  const auto hf = nlohmann::json::parse(util::read_file((fs::path(s.run_dir) / "config.json").string()));
  EXPECT_EQ(hf.at("model_type"), arch_name(config("files").model.arch));
  EXPECT_EQ(hf.at("n_layer"), config("files").model.n_layer);
  std::ifstream metrics(fs::path(s.run_dir) / "metrics.jsonl");
  int train_lines = 0, val_lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") {
      ++train_lines;
      EXPECT_GT(j["peak_bytes"].get<int64_t>(), 0);
      EXPECT_GE(j["peak_bytes"].get<int64_t>(), j["activation_bytes"].get<int64_t>());
    }
    if (j["kind"] == "val") ++val_lines;
  }
  EXPECT_EQ(train_lines, 4);
  EXPECT_EQ(val_lines, 3);  // before the first step, at step 2 and at the end
  // How busy other processes kept the machine while it trained, as the report weighs it.
  std::ifstream summary_file(fs::path(s.run_dir) / "summary.json");
  const auto summary = nlohmann::json::parse(summary_file);
  ASSERT_TRUE(summary.contains("other_cpus"));
  if (s.other_cpus) {
    EXPECT_EQ(summary["other_cpus"].get<double>(), *s.other_cpus);
  }
  EXPECT_GT(s.tolerated_other_cpus, 0.0);
  // The resolved config is the given one with the vocabulary filled in from the tokenizer
  // and the host budget in bytes (none on the CPU).
  Config expected = config("files");
  expected.model.vocab_size = 300;
  expected.ac.host_budget = "0";
  const Config again = load_config((fs::path(s.run_dir) / "config.toml").string(), {});
  EXPECT_EQ(config_to_toml(again), config_to_toml(expected));
}

TEST_F(Trainer, GenerateFromARunReproducesTheFinalSample) {
  const Config cfg = config("gen");
  const TrainSummary s = train(cfg);
  std::string streamed;
  const std::string text =
      generate_from_run(s.run_dir, cfg.run.prompt, cfg.run.sample_tokens, 0.8, 40, static_cast<uint64_t>(cfg.run.seed),
                        "", [&](std::string_view piece) { streamed += piece; });
  EXPECT_EQ(text, s.sample);
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(text.rfind(cfg.run.prompt, 0), 0u);
}

// Far past the context (32 tokens here) every token still streams: the stream once stopped
// for good at the first character split over byte pieces (decoded as U+FFFD until its last
// byte came), printing the same text for any longer --tokens.
TEST_F(Trainer, GenerateStreamsEveryTokenPastTheContext) {
  const TrainSummary s = train(config("long-gen"));
  std::string streamed;
  int64_t generated = 0;
  const std::string text = generate_from_run(
      s.run_dir, "the", 400, 1.0, 40, 3, "", [&](std::string_view piece) { streamed += piece; }, &generated);
  EXPECT_EQ(generated, 400);
  EXPECT_EQ(streamed, text);
  EXPECT_GT(text.size(), 400u);
  EXPECT_LT(generate_from_run(s.run_dir, "the", 200, 1.0, 40, 3).size(), text.size());
}

// A signal during the final sample ends it at the next token (SIGTERM once waited for all
// of run.sample_tokens, then exited 0): the weights are written, and the run says it was
// stopped. The signal comes once the last step's checkpoint is written, seconds before
// 10000 tokens could be sampled.
TEST_F(Trainer, ASignalEndsTheFinalSampleWithTheWeightsWritten) {
  Config cfg = config("signalled");
  cfg.run.sample_tokens = 10000;
  const fs::path run = fs::path(cfg.run.out_dir) / "signalled";
  // Absorbed outside train(), which catches it: a signal sent late must not end the test.
  // A handler, not SIG_IGN: a signal ignored from the start stays ignored (nohup's SIGHUP).
  struct sigaction absorb {
  }, previous{};
  absorb.sa_handler = [](int) {};
  sigaction(SIGTERM, &absorb, &previous);
  std::thread signaller([&] {
    while (!fs::exists(run / "checkpoints" / "step-00000004.safetensors")) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ::kill(::getpid(), SIGTERM);
  });
  const TrainSummary s = train(cfg);
  signaller.join();
  sigaction(SIGTERM, &previous, nullptr);
  EXPECT_EQ(s.stopped_by, SIGTERM);
  EXPECT_TRUE(fs::exists(run / "model.safetensors"));
  const auto tok = data::Tokenizer::load((run / "tokenizer.model").string());
  EXPECT_LT(tok.encode(s.sample).size(), 10000u);
}

using testing::error_of;

// A run resumed from an earlier checkpoint (the later ones and the final weights gone, as
// after a crash) ends bitwise where the uninterrupted run ended.
TEST_F(Trainer, ResumingFromACheckpointGivesBitwiseTheSameRun) {
  Config cfg = config("resumed");
  cfg.train.checkpoint_every = 1;
  cfg.train.keep_checkpoints = 4;
  const TrainSummary whole = train(cfg);
  const fs::path run = whole.run_dir;
  auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string weights = bytes(run / "model.safetensors");
  for (const char* later : {"step-00000003.safetensors", "step-00000004.safetensors"}) {
    fs::remove(run / "checkpoints" / later);
  }
  fs::remove(run / "model.safetensors");
  std::ofstream(run / "checkpoints" / "step-00000003.safetensors.tmp.99999") << "cut short";
  const Config saved = load_config((run / "config.toml").string(), {});
  const TrainSummary resumed = train(saved, run.string());
  EXPECT_EQ(resumed.losses, whole.losses);
  EXPECT_EQ(resumed.final_val_loss, whole.final_val_loss);
  EXPECT_EQ(bytes(run / "model.safetensors"), weights);
  EXPECT_FALSE(fs::exists(run / "checkpoints" / "step-00000003.safetensors.tmp.99999"));
  EXPECT_EQ(error_of<std::exception>([&] { train(saved, run.string()); }),
            run.string() + " finished all 4 steps; there is nothing to resume.");
}

// A resumed run runs the plan its checkpoint holds, not what planning gives now (on another
// machine, measured times can choose another): here the checkpoint's plan is rewritten to
// recompute every layer, and the resumed run does that, bitwise as before (recompute never
// changes a value). A damaged plan is refused with a sentence before any step.
TEST_F(Trainer, AResumedRunRunsThePlanItsCheckpointHolds) {
  Config cfg = config("plan-kept");
  cfg.ac.budget = "0.9";
  cfg.ac.profile = false;
  cfg.train.checkpoint_every = 1;
  cfg.train.keep_checkpoints = 4;
  const TrainSummary whole = train(cfg);
  const fs::path run = whole.run_dir;
  const fs::path second = run / "checkpoints" / "step-00000002.safetensors";
  const SavedPlan planned =
      parse_saved_plan(model::read_safetensors_header(second.string()).metadata.at("plan"), cfg.model.n_layer, 1);
  EXPECT_EQ(planned.plan.policy.rfind("budget:", 0), 0u) << planned.plan.policy;
  EXPECT_EQ(planned.split, std::vector<int64_t>{cfg.model.n_layer});
  for (const char* later : {"step-00000003.safetensors", "step-00000004.safetensors"}) {
    fs::remove(run / "checkpoints" / later);
  }
  const Config saved = load_config((run / "config.toml").string(), {});
  // The file is freed before the run: its tensors would count in the run's measured memory.
  const auto rewrite_plan = [&](const std::string& plan) {
    testing::rewrite_checkpoint(second.string(), [&](model::SafeTensors& file) { file.metadata["plan"] = plan; });
  };

  const ActivationPlan full = compile_policy("full", cfg.model.n_layer);
  rewrite_plan(saved_plan_json(full, {cfg.model.n_layer}));
  const TrainSummary resumed = train(saved, run.string());
  EXPECT_EQ(resumed.losses, whole.losses);
  EXPECT_EQ(resumed.final_val_loss, whole.final_val_loss);
  // The steps after the resume peak as full's prediction says, below the budget plan's.
  EXPECT_LT(resumed.predicted_peak_bytes, whole.predicted_peak_bytes);
  std::ifstream metrics(run / "metrics.jsonl");
  int resumed_steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["kind"] != "train" || j["step"].get<int64_t>() <= 2) continue;
    ++resumed_steps;
    EXPECT_LE(j["peak_bytes"].get<int64_t>(), resumed.predicted_peak_bytes) << line;
  }
  EXPECT_EQ(resumed_steps, 2);
  std::ifstream in(run / "plan.txt");
  const std::string text(std::istreambuf_iterator<char>(in), {});
  EXPECT_NE(text.find("\nplan: full, the checkpoint's, as the run trained before it stopped, 2 layers\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\npolicy: full ("), std::string::npos) << text;

  fs::remove(run / "checkpoints" / "step-00000003.safetensors");
  fs::remove(run / "checkpoints" / "step-00000004.safetensors");
  rewrite_plan(saved_plan_json(full, {1, 1}));
  EXPECT_EQ(error_of<std::exception>([&] { train(saved, run.string()); }),
            "The checkpoint's plan (its \"plan\" metadata) splits the layers as [1,1], but this run puts its 2 layers "
            "on 1 pipeline stage; resume from a checkpoint this model's run wrote, or start the run again.");
  rewrite_plan("{\"policy\": 3}");
  EXPECT_NE(error_of<std::exception>([&] { train(saved, run.string()); })
                .find("The checkpoint's plan (its \"plan\" metadata) is "
                      "damaged"),
            std::string::npos);
}

// Non-finite weights at the start are the initialisation's fault, said as such, with the
// first bad parameter named and the weights left as they were; generate refuses them.
TEST_F(Trainer, NonFiniteWeightsAreNamedAndRefusedBeforeTheyAreUsed) {
  const TrainSummary s = train(config("nan"));
  const Config cfg = load_config((fs::path(s.run_dir) / "config.toml").string(), {});
  auto model = Model::create(cfg.model, at::kCPU, at::kFloat, 1);
  const std::string weights = (fs::path(s.run_dir) / "model.safetensors").string();
  model->load(weights);
  Param& p = model->params()[3];
  p.value.view(-1)[1] = std::nan("");
  model->save(weights, {});
  EXPECT_EQ(error_of<std::exception>([&] { generate_from_run(s.run_dir, "the", 4, 0.0, 0, 1); }),
            "The weights in " + weights + " hold non-finite values (first: " + p.name +
                "), so every sample would be noise; the run that wrote them diverged: train again with a lower "
                "train.lr.");

  const at::Tensor before = p.value.clone();
  const data::TokenDataset data(at::randint(cfg.model.vocab_size, {200}, at::detail::createCPUGenerator(1), at::kInt));
  TrainStep step(*model, cfg.train, 1);
  std::mt19937_64 rng(1);
  const std::string failure = error_of<std::exception>([&] { step.run(0, data, rng); });
  EXPECT_NE(failure.find("at step 1, before any update, so the initial model is at fault, not the learning rate: "
                         "parameter " +
                         p.name + " holds non-finite values; check model.init_std"),
            std::string::npos)
      << failure;
  EXPECT_TRUE(at::equal(p.value.nan_to_num(0), before.nan_to_num(0)));

  // The update itself overflowing: a decoupled weight decay of lr x decay = 1e36 on a
  // matrix entry of 1e3 (settings validation refuses such a learning rate; the step does not
  // rely on it).
  p.value.view(-1)[1] = 0.0;
  Param& matrix = *std::find_if(model->params().begin(), model->params().end(), [](const Param& q) { return q.decay; });
  matrix.value.view(-1)[0] = 1e3;
  TrainConfig huge = cfg.train;
  huge.lr = 1e37;
  huge.min_lr = 0;
  TrainStep overflowing(*model, huge, 1);
  const std::string update = error_of<std::exception>([&] { overflowing.run(0, data, rng); });
  EXPECT_EQ(update.rfind("The update of step 1 made parameter " + matrix.name + " non-finite", 0), 0u) << update;
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

// A corpus's folder names its text, format and tokenizer, so that two inputs never share one.
TEST(CorpusDir, NamesTheFilesTheFormatAndTheTokenizer) {
  DataConfig d;
  EXPECT_EQ(corpus_dir(d), "data/kjv-v2048");
  d.text = "books/psalms.txt";
  EXPECT_EQ(corpus_dir(d), "data/psalms-v2048");
  d.text = "web/shard_*.jsonl";
  d.format = DataFormat::jsonl;
  EXPECT_EQ(corpus_dir(d), "data/shard_all-jsonl-v2048");
  d.field = "content";
  EXPECT_EQ(corpus_dir(d), "data/shard_all-content-v2048");
  d.text = "fineweb10B/*.bin";
  d.format = DataFormat::tokens;
  d.tokenizer = "models/gpt2/tokenizer.json";
  EXPECT_EQ(corpus_dir(d), "data/fineweb10B-all-tokens-gpt2");
}

TEST(LearningRate, WarmsUpLinearlyThenReachesTheFloorAtTheLastStep) {
  TrainConfig t;
  t.steps = 100;
  t.warmup = 10;
  t.lr = 1e-3;
  t.min_lr = 1e-4;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(t, 4), 5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1e-3);
  EXPECT_NEAR(learning_rate(t, 10 + 89 / 2.0), 5.5e-4, 1e-5);  // halfway down the cosine
  EXPECT_DOUBLE_EQ(learning_rate(t, 99), 1e-4);
  for (int64_t s = 11; s < 100; ++s) EXPECT_LT(learning_rate(t, s), learning_rate(t, s - 1));
}

}  // namespace
}  // namespace remat
