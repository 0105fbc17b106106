// A run directory nobody can corrupt: one owner at a time, checkpoints verified before they
// are trusted (with a fallback to the previous whole one), runs that stopped before their
// final files finished by --resume, and no resume onto other data than the run trained on.
#include "remat/safetensors.h"
#include "remat/trainer.h"
#include "train/checkpoint_files.h"
#include "train/checkpoints.h"
#include "train/run_dir.h"
#include "util/error_of.h"
#include "util/file_limit.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>

namespace remat {
namespace {

namespace fs = std::filesystem;

std::string bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

using testing::error_of;

class Resume : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_.emplace();
    write_text(*dir_ / "corpus.txt", 12345);
  }
  static void TearDownTestSuite() { dir_.reset(); }

  // 1,500 lines of ten words drawn by `seed` from a small vocabulary, or another one.
  static void write_text(const fs::path& path, uint64_t seed, bool other_words = false) {
    std::ofstream text(path);
    const char* some[] = {"the",   "lord",     "said",   "unto",  "moses",  "and", "it",    "was",  "so",
                          "light", "darkness", "waters", "earth", "heaven", "day", "night", "good", "made"};
    const char* others[] = {"a",     "ship",  "sailed", "over",  "quiet", "grey", "seas", "while", "gulls",
                            "cried", "above", "its",    "masts", "in",    "cold", "wind", "at",    "dawn"};
    const char** words = other_words ? others : some;
    uint64_t x = seed;
    for (int line = 0; line < 1500; ++line) {
      for (int w = 0; w < 10; ++w) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        text << words[(x >> 33) % 18] << (w == 9 ? ".\n" : " ");
      }
    }
  }

  // Four steps, a checkpoint after each, all kept.
  static Config config(const std::string& name, const fs::path& text = *dir_ / "corpus.txt",
                       const fs::path& data = *dir_ / "data") {
    return load_config(
        "", {"model.preset=tiny-gpt2", "model.vocab_size=0", "train.steps=4", "train.batch=2", "train.seq=16",
             "train.warmup=1", "train.eval_every=2", "train.eval_batches=2", "train.checkpoint_every=1",
             "train.keep_checkpoints=4", "data.vocab_size=300", "data.text=" + text.string(),
             "data.dir=" + data.string(), "run.out_dir=" + (*dir_ / "runs").string(), "run.name=" + name,
             "run.threads=1", "run.sample_tokens=8", "run.progress=false"});
  }
  static Config saved_config(const fs::path& run) { return load_config((run / "config.toml").string(), {}); }
  static fs::path checkpoint(const fs::path& run, int steps) {
    return run / "checkpoints" / fmt::format("step-{:08d}.safetensors", steps);
  }

  static inline std::optional<remat::testing::TempDir> dir_;  // the suite's scratch directory
};

// `--resume` of a run another process is training lost that run's metrics; it is refused
// with the owner's pid before anything in the directory is touched.
TEST_F(Resume, ARunInUseIsRefusedNamingItsOwner) {
  const TrainSummary s = train(config("live"));
  const fs::path run = s.run_dir;
  fs::remove(checkpoint(run, 4));
  const std::string metrics = bytes(run / "metrics.jsonl");
  const RunLock owner(run.string());
  EXPECT_EQ(error_of<std::exception>([&] { train(saved_config(run), run.string()); }),
            run.string() + " is in use by another remat process (pid " + std::to_string(::getpid()) +
                "): one process at a time writes a run directory; wait for it to finish (or stop it) before resuming "
                "the run.");
  EXPECT_EQ(bytes(run / "metrics.jsonl"), metrics);
  EXPECT_TRUE(fs::exists(checkpoint(run, 3)));
}

// A run that stopped after its last checkpoint but before its final files (a full disk, a
// kill during the sample) is finished by --resume, with the files the whole run wrote; the
// temporary files of remat's own killed writes go, anyone else's stay.
TEST_F(Resume, ARunStoppedBeforeItsFinalFilesIsFinishedByResume) {
  const TrainSummary whole = train(config("unfinished"));
  const fs::path run = whole.run_dir;
  const std::string weights = bytes(run / "model.safetensors");
  for (const char* f : {"model.safetensors", "summary.json", "sample.txt", "loss.png"}) fs::remove(run / f);
  EXPECT_EQ(error_of<std::exception>([&] { generate_from_run(run.string(), "the", 4, 0.8, 40, 0); }),
            run.string() +
                " has no model.safetensors; the run stopped before writing its final weights: `remat train "
                "--resume " +
                run.string() +
                "` writes them (from its last checkpoint, training the steps it had left "
                "first).");
  std::ofstream(run / "model.safetensors.tmp.4242") << "cut short";
  std::ofstream(run / "checkpoints" / "step-00000005.safetensors.tmp.77") << "cut short";
  for (const char* theirs : {"notes.tmp.1", "metrics.jsonl.tmp.old", "checkpoints/mine.tmp.3"}) {
    std::ofstream(run / theirs) << "a user's file";
  }

  const TrainSummary finished = train(saved_config(run), run.string());
  EXPECT_EQ(bytes(run / "model.safetensors"), weights);
  EXPECT_EQ(finished.losses, whole.losses);
  EXPECT_EQ(finished.final_val_loss, whole.final_val_loss);
  EXPECT_EQ(finished.sample, whole.sample);
  EXPECT_EQ(nlohmann::json::parse(bytes(run / "summary.json"))["final_train_loss"].get<double>(), whole.losses.back());
  EXPECT_FALSE(fs::exists(run / "model.safetensors.tmp.4242"));
  EXPECT_FALSE(fs::exists(run / "checkpoints" / "step-00000005.safetensors.tmp.77"));
  for (const char* theirs : {"notes.tmp.1", "metrics.jsonl.tmp.old", "checkpoints/mine.tmp.3"}) {
    EXPECT_TRUE(fs::exists(run / theirs)) << theirs;
  }
  EXPECT_EQ(error_of<std::exception>([&] { train(saved_config(run), run.string()); }),
            run.string() + " finished all 4 steps; there is nothing to resume.");
  EXPECT_NE(error_of<std::exception>([&] {
              generate_from_run(run.string(), "the", 4, std::nan(""), 40, 0);
            }).find("The sampling temperature must be a number from 0 (greedy) to 100, got nan"),
            std::string::npos);
  // An edited config.toml asking for a far larger model is refused before any allocation.
  Config edited = saved_config(run);
  edited.model.d_ff = 1 << 18;
  std::ofstream(run / "config.toml") << config_to_toml(edited);
  EXPECT_NE(error_of<std::exception>([&] {
              generate_from_run(run.string(), "the", 4, 0.8, 40, 0);
            }).find("bytes: the config was changed after the run; restore the config.toml the run wrote."),
            std::string::npos);
}

// A damaged newest checkpoint (a flipped bit in its tensors, or junk under a checkpoint's
// name) is set aside with a sentence and the previous whole one resumed from, bitwise.
TEST_F(Resume, DamagedCheckpointsAreSetAsideAndTheWholeOneBeforeThemUsed) {
  const TrainSummary whole = train(config("damaged"));
  const fs::path run = whole.run_dir;
  const std::string weights = bytes(run / "model.safetensors");
  fs::remove(checkpoint(run, 4));
  fs::remove(run / "model.safetensors");
  {
    std::fstream third(checkpoint(run, 3), std::ios::in | std::ios::out | std::ios::binary);
    third.seekg(-1000, std::ios::end);
    const char byte = static_cast<char>(third.get());
    third.seekp(-1000, std::ios::end);
    third.put(static_cast<char>(byte ^ 0x10));
  }
  std::ofstream(checkpoint(run, 9)) << "junk";
  EXPECT_EQ(checkpoint_problem(checkpoint(run, 3).string()),
            "its bytes are not those written (the checksum over its tensors and metadata differs)");

  ::testing::internal::CaptureStderr();
  const TrainSummary resumed = train(saved_config(run), run.string());
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(resumed.losses, whole.losses);
  EXPECT_EQ(bytes(run / "model.safetensors"), weights);
  EXPECT_NE(log.find("The checkpoint " + checkpoint(run, 9).string() +
                     " cannot be resumed from: The safetensors file " + checkpoint(run, 9).string() +
                     " is invalid: it has 4 bytes, fewer than the 8-byte header length; "
                     "it is kept as step-00000009.safetensors.damaged, and the previous one is tried."),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("The checkpoint " + checkpoint(run, 3).string() +
                     " cannot be resumed from: its bytes are not "
                     "those written (the checksum over its tensors and metadata differs); it is kept as "
                     "step-00000003.safetensors.damaged, and the previous one is tried."),
            std::string::npos)
      << log;
  EXPECT_TRUE(fs::exists(run / "checkpoints" / "step-00000003.safetensors.damaged"));
  EXPECT_FALSE(fs::exists(checkpoint(run, 9)));
}

// Metadata a resume would trust (the data cursor, the optimizer's step count, the step) is
// checked field by field, with a sentence for each; a NaN in the tensors is the file's fault.
TEST_F(Resume, CheckpointMetadataIsCheckedFieldByField) {
  const TrainSummary whole = train(config("metadata"));
  const fs::path run = whole.run_dir;
  const std::string second = checkpoint(run, 2).string();
  EXPECT_EQ(checkpoint_problem(second), "");
  const auto problem_with = [&](const std::string& key, const std::string& value) {
    const std::string copy = (run / "edited.safetensors").string();
    fs::copy_file(second, copy, fs::copy_options::overwrite_existing);
    testing::rewrite_checkpoint(copy, [&](model::SafeTensors& file) {
      if (value.empty()) {
        file.metadata.erase(key);
      } else {
        file.metadata[key] = value;
      }
    });
    return checkpoint_problem(copy);
  };
  EXPECT_EQ(problem_with("rng", "12 34 x"), "its 'rng' is not the state of the data sampler's generator");
  EXPECT_EQ(problem_with("rng", ""), "its metadata has no 'rng'");
  EXPECT_EQ(problem_with("adam_steps", "7"),
            "its 'adam_steps' (7) is not its 'steps' (2): every step makes one optimizer update");
  EXPECT_EQ(problem_with("steps", "99999999999999999999"),
            "its 'steps' is '99999999999999999999', not a count from 1 to 2^30");
  EXPECT_EQ(problem_with("steps", "-1"), "its 'steps' is '-1', not a count from 1 to 2^30");
  EXPECT_EQ(problem_with("format", "something else"),
            "its format is \"something else\", not 'remat training checkpoint 1'");
  // A checkpoint without its checksum was once resumed from unverified, and silently.
  model::SafeTensors unsummed = model::load_safetensors(second);
  std::erase_if(unsummed.tensors, [](const auto& named) { return named.first == model::kChecksumTensor; });
  const std::string copy = (run / "unsummed.safetensors").string();
  model::save_safetensors(copy, unsummed.tensors, unsummed.metadata, /*checksum=*/false);
  EXPECT_EQ(checkpoint_problem(copy),
            "it has no checksum (the 'remat.sha256' tensor every checkpoint remat writes ends with), so its bytes "
            "cannot be verified");

  // Only whole older checkpoints left, one of them holding a NaN the checksum vouches for.
  for (int s : {3, 4}) fs::remove(checkpoint(run, s));
  fs::remove(run / "model.safetensors");
  testing::rewrite_checkpoint(second, [](model::SafeTensors& file) {
    for (auto& [name, t] : file.tensors) {
      if (name.rfind("param.", 0) == 0) {
        t.view(-1)[0] = std::nan("");
        break;
      }
    }
  });
  const std::string error = error_of<std::exception>([&] { train(saved_config(run), run.string()); });
  EXPECT_EQ(error.rfind("The checkpoint " + second + " holds a NaN or an infinity in 'param.", 0), 0u) << error;
  EXPECT_NE(error.find("so the file was damaged after it was written (not by the learning rate)"), std::string::npos);
  // A negative second moment, which the checksum also vouches for, was once blamed on the
  // learning rate when its square root made the loss NaN.
  testing::rewrite_checkpoint(second, [](model::SafeTensors& file) {
    for (auto& [name, t] : file.tensors) {
      if (name.rfind("param.", 0) == 0) t.view(-1)[0] = 0.5;
      if (name.rfind("exp_avg_sq.", 0) == 0) t.view(-1)[0] = -1e-8;
    }
  });
  const std::string negative = error_of<std::exception>([&] { train(saved_config(run), run.string()); });
  EXPECT_EQ(negative.rfind("The checkpoint " + second + " holds a negative AdamW second moment in 'exp_avg_sq.", 0), 0u)
      << negative;
}

// A config.toml edited by hand between a stop and its resume (the learning rate here) once
// went on silently; the resumed run names each changed key, but not the final sample's.
TEST_F(Resume, AHandEditedConfigIsNamedWhenTheRunResumes) {
  const fs::path run = train(config("edited")).run_dir;
  for (int s : {3, 4}) fs::remove(checkpoint(run, s));
  fs::remove(run / "model.safetensors");
  Config edited = saved_config(run);
  edited.train.lr /= 2;
  edited.run.sample_tokens = 0;
  std::ofstream(run / "config.toml") << config_to_toml(edited);
  ::testing::internal::CaptureStderr();
  train(saved_config(run), run.string());
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("note: " + run.string() +
                     "/config.toml was changed since step-00000002.safetensors was written (train.lr = "),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("); the run goes on with config.toml's values, so it is no longer the run it began as."),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("sample_tokens"), std::string::npos) << log;
}

// A checkpoint a full disk cannot take stops the run with a sentence that says how to go
// on: with no checkpoint yet, start again (a message once promised one to resume from).
TEST_F(Resume, AFullDiskAtTheFirstCheckpointSaysToStartAgain) {
  const fs::path run = *dir_ / "runs" / "full";
  prepare_data(config("full").data);
  std::string error;
  {
    // The metrics and the run's small files fit; a checkpoint of every weight and both
    // moments (140 KiB) does not.
    const testing::FileSizeLimit full(64 << 10);
    error = error_of<std::exception>([&] { train(config("full")); });
  }
  EXPECT_NE(error.find(": File too large. The checkpoint after step 1 is not written, so the run stops here; it has "
                       "no checkpoint yet, so free space (or fix the file) and start it again with `remat train "
                       "--config " +
                       run.string() + "/config.toml`."),
            std::string::npos)
      << error;
  EXPECT_TRUE(list_checkpoints(run.string()).empty());
}

// Resuming after the training text changed retrained the tokenizer, overwrote the run's and
// went on with other token ids; it is refused, and the run's tokenizer kept.
TEST_F(Resume, AChangedTrainingTextIsRefused) {
  const fs::path text = *dir_ / "changing.txt";
  write_text(text, 777);
  const TrainSummary s = train(config("text", text, *dir_ / "changing-data"));
  const fs::path run = s.run_dir;
  fs::remove(checkpoint(run, 4));
  const std::string tokenizer = bytes(run / "tokenizer.model");
  write_text(text, 4242, /*other_words=*/true);
  EXPECT_NE(error_of<std::exception>([&] {
              train(saved_config(run), run.string());
            }).find(", recorded in its checkpoint): it changed since the run started"),
            std::string::npos);
  EXPECT_EQ(bytes(run / "tokenizer.model"), tokenizer);

  // The same tokenizer over another text: the text's digest in the checkpoint tells.
  write_text(text, 777);
  testing::rewrite_checkpoint(checkpoint(run, 3).string(), [](model::SafeTensors& file) {
    file.metadata["data.text_sha256"] = std::string(64, '0');
  });
  EXPECT_NE(error_of<std::exception>([&] { train(saved_config(run), run.string()); })
                .find("is not the one the run trained on (SHA-256 " + std::string(64, '0') +
                      ", recorded in its checkpoint): it changed since the run started"),
            std::string::npos);
}

// A missing or damaged tokenizer.model blocked --resume (the damaged one blamed a changed
// text) though the corpus prepares the very tokenizer the checkpoint records: it is
// written back, said, and the run goes on; one the checkpoint does not record is refused.
TEST_F(Resume, TheRunsTokenizerIsRestoredFromTheCorpusWhenTheCheckpointVouchesForIt) {
  const TrainSummary s = train(config("tokenizer"));
  const fs::path run = s.run_dir;
  const std::string tokenizer = bytes(run / "tokenizer.model");
  for (const bool damage : {false, true}) {
    for (int step : {3, 4}) fs::remove(checkpoint(run, step));
    fs::remove(run / "model.safetensors");
    if (damage) {
      std::ofstream(run / "tokenizer.model", std::ios::binary | std::ios::trunc) << "not a tokenizer";
    } else {
      fs::remove(run / "tokenizer.model");
    }
    const TrainSummary resumed = train(saved_config(run), run.string());
    EXPECT_EQ(resumed.losses.size(), 4u) << damage;
    EXPECT_EQ(bytes(run / "tokenizer.model"), tokenizer) << damage;
  }
  // A checkpoint recording another tokenizer is no run of this corpus.
  for (int step : {3, 4}) fs::remove(checkpoint(run, step));
  fs::remove(run / "model.safetensors");
  testing::rewrite_checkpoint(checkpoint(run, 2).string(), [](model::SafeTensors& file) {
    file.metadata["data.tokenizer_sha256"] = std::string(64, '1');
  });
  EXPECT_NE(error_of<std::exception>([&] {
              train(saved_config(run), run.string());
            }).find("differs from the one the run trained with (recorded in its checkpoint)"),
            std::string::npos);
}

}  // namespace
}  // namespace remat
