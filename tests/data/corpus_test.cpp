#include "util/error_of.h"
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sys/stat.h>

#include "util/atomic_file.h"
#include "util/paths.h"
#include "data/test_text.h"
#include "remat/data.h"
#include "remat/tokenizer.h"
#include "util/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using namespace remat::data;
using remat::testing::TempDir;

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::runtime_error>(f); }

// A small corpus: ~2000 lines, a 512-piece vocabulary; prepares in well under a second.
PrepareOptions small_options(const TempDir& dir, const std::string& text) {
  write(dir / "text.txt", text);
  PrepareOptions options;
  options.text_file = dir / "text.txt";
  options.out_dir = dir / "corpus";
  options.vocab_size = 512;
  return options;
}

// Options for `format` files at `text` with the GPT-2-layout test tokenizer, the
// validation split at the end, so that the train split then the validation one is the
// stream of ids.
const std::string kGpt2Tokenizer =
    std::string(remat::testing::kSourceDir) + "/tests/data/hf_tokenizers/gpt2/tokenizer.json";

PrepareOptions gpt2_options(remat::DataFormat format, const std::string& text, const std::string& out_dir) {
  PrepareOptions options;
  options.val_blocks = 1;
  options.tokenizer = kGpt2Tokenizer;
  options.format = format;
  options.text_file = text;
  options.out_dir = out_dir;
  return options;
}

std::vector<int32_t> ids_of(const CorpusInfo& info) {
  std::vector<int32_t> ids;
  for (const Split split : {Split::train, Split::val}) {
    const TokenDataset d = TokenDataset::open(info, split);
    const std::vector<int32_t> part = d.ids(0, d.size());
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

TEST(Corpus, PreparesSmallTextIntoTokenFiles) {
  TempDir dir;
  const std::string text = remat::testing::make_text(2000);
  const PrepareOptions options = small_options(dir, text);
  std::vector<std::string> lines;
  const CorpusInfo info = prepare_corpus(options, [&](const std::string& l) { lines.push_back(l); });

  EXPECT_FALSE(info.cached);
  EXPECT_FALSE(lines.empty());
  EXPECT_EQ(info.vocab_size, 512);
  EXPECT_EQ(info.token_bytes, 2);
  EXPECT_EQ(info.text_bytes, static_cast<int64_t>(text.size()));
  EXPECT_EQ(fs::file_size(info.train_path()), static_cast<uintmax_t>(2 * info.train_tokens));
  EXPECT_EQ(fs::file_size(info.val_path()), static_cast<uintmax_t>(2 * info.val_tokens));

  // Every token of the text is in exactly one split, and the split is ~5%.
  const Tokenizer tok = Tokenizer::load(info.tokenizer_path());
  EXPECT_EQ(info.train_tokens + info.val_tokens, static_cast<int64_t>(tok.encode(text).size()));
  const double val_share =
      static_cast<double>(info.val_tokens) / static_cast<double>(info.train_tokens + info.val_tokens);
  EXPECT_NEAR(val_share, 0.05, 0.01);

  // The train and val text together are the whole text (ASCII, so no byte piece splits).
  const TokenDataset train = TokenDataset::open(info, Split::train);
  const TokenDataset val = TokenDataset::open(info, Split::val);
  ASSERT_EQ(train.size(), info.train_tokens);
  ASSERT_EQ(val.size(), info.val_tokens);
  const std::vector<int32_t> tt = train.ids(0, train.size()), vt = val.ids(0, val.size());
  const std::string train_text = tok.decode(tt), val_text = tok.decode(vt);
  EXPECT_EQ(train_text.size() + val_text.size(), text.size());
  // Validation is spread through the text, not only its end: its first stretch comes
  // from the first block (the first twentieth).
  const std::string first_val_line = val_text.substr(0, val_text.find('\n'));
  ASSERT_FALSE(first_val_line.empty());
  EXPECT_LT(text.find(first_val_line), text.size() / 15);
  // Stretches start at line starts when one is near: the first val line is a whole line.
  EXPECT_NE(text.find("\n" + first_val_line + "\n"), std::string::npos);

  // Entropy is positive and below the uniform bound ln(vocab).
  EXPECT_GT(info.train_unigram_entropy, 1.0);
  EXPECT_LT(info.train_unigram_entropy, std::log(512.0));

  const CorpusInfo loaded = load_corpus_info(options.out_dir);
  EXPECT_EQ(loaded.train_tokens, info.train_tokens);
  EXPECT_EQ(loaded.text_sha256, info.text_sha256);
  EXPECT_DOUBLE_EQ(loaded.train_unigram_entropy, info.train_unigram_entropy);
}

TEST(Corpus, SecondPrepareIsACacheHit) {
  TempDir dir;
  PrepareOptions options = small_options(dir, remat::testing::make_text(1000));
  const CorpusInfo first = prepare_corpus(options);
  ASSERT_FALSE(first.cached);
  const auto train_mtime = fs::last_write_time(first.train_path());
  const auto model_mtime = fs::last_write_time(first.tokenizer_path());

  const CorpusInfo second = prepare_corpus(options);
  EXPECT_TRUE(second.cached);
  EXPECT_EQ(second.train_sha256, first.train_sha256);
  EXPECT_EQ(fs::last_write_time(first.train_path()), train_mtime);
  EXPECT_EQ(fs::last_write_time(first.tokenizer_path()), model_mtime);

  // Another option or another text is a miss.
  options.vocab_size = 600;
  EXPECT_FALSE(prepare_corpus(options).cached);
  write(*options.text_file, remat::testing::make_text(1000, 7));
  std::vector<std::string> log;
  EXPECT_FALSE(prepare_corpus(options, [&](const std::string& l) { log.push_back(l); }).cached);
  bool said_why = false;
  for (const auto& l : log) said_why |= l.find("the text changed") != std::string::npos;
  EXPECT_TRUE(said_why);
  // force rebuilds a matching corpus.
  options.force = true;
  EXPECT_FALSE(prepare_corpus(options).cached);
}

// A Hugging Face tokenizer given instead of one trained: its vocabulary and encoding of the
// whole text (tokens may span lines), kept in the corpus under the same name, and a cache
// that a changed tokenizer misses.
TEST(Corpus, PreparesWithAGivenHuggingFaceTokenizer) {
  TempDir dir;
  const std::string text = remat::testing::make_text(600) + "\n\n  tail, with\n\n\nblank lines \U0001F642\n";
  PrepareOptions options = small_options(dir, text);
  const std::string fixtures = std::string(remat::testing::kSourceDir) + "/tests/data/hf_tokenizers/";
  fs::copy(fixtures + "llama3", dir / "llama3");
  options.tokenizer = dir / "llama3";
  const CorpusInfo info = prepare_corpus(options);
  const Tokenizer given = Tokenizer::load(dir / "llama3" / "tokenizer.json");
  EXPECT_EQ(info.vocab_size, given.vocab_size());
  EXPECT_EQ(info.tokenizer_source, (dir / "llama3").string());
  const Tokenizer kept = Tokenizer::load(info.tokenizer_path());
  EXPECT_EQ(kept.kind(), "byte-level BPE (Hugging Face)");
  EXPECT_EQ(kept.serialized(), given.serialized());
  EXPECT_EQ(kept.eos_id(), given.piece_to_id("<|end_of_text|>"));
  EXPECT_EQ(info.train_tokens + info.val_tokens, static_cast<int64_t>(given.encode(text).size()));
  const TokenDataset train = TokenDataset::open(info, Split::train), val = TokenDataset::open(info, Split::val);
  const std::string both = kept.decode(train.ids(0, train.size())) + kept.decode(val.ids(0, val.size()));
  EXPECT_EQ(both.size(), text.size());

  EXPECT_TRUE(prepare_corpus(options).cached);
  remat::util::write_file_atomically(dir / "llama3" / "tokenizer_config.json", R"({"eos_token": "<|begin_of_text|>"})");
  std::vector<std::string> log;
  EXPECT_FALSE(prepare_corpus(options, [&](const std::string& l) { log.push_back(l); }).cached);
  EXPECT_NE(std::find(log.begin(), log.end(), "rebuilding " + options.out_dir + ": the tokenizer changed"), log.end());
  options.tokenizer.reset();
  EXPECT_FALSE(prepare_corpus(options).cached);
}

// Documents (several text files, or JSONL records) are encoded one by one and separated by
// the tokenizer's end of text; the two spellings of the same documents give the same ids.
TEST(Corpus, PreparesDocumentsSeparatedByTheEndOfText) {
  TempDir dir;
  const Tokenizer tok = Tokenizer::load(kGpt2Tokenizer);
  std::vector<std::string> docs;
  std::vector<int32_t> expected;
  std::string jsonl;
  fs::create_directories(dir / "texts");
  for (int d = 0; d < 40; ++d) {
    docs.push_back(remat::testing::make_text(5 + d % 7, static_cast<uint64_t>(d) + 1));
    write(dir / "texts" / fmt::format("{:02}.txt", d), docs.back());
    jsonl += nlohmann::json{{"id", d}, {"text", docs.back()}}.dump() + "\n";
    if (d > 0) expected.push_back(tok.eos_id());
    const std::vector<int32_t> ids = tok.encode(docs.back());
    expected.insert(expected.end(), ids.begin(), ids.end());
  }
  write(dir / "docs.jsonl", jsonl);
  const CorpusInfo from_jsonl =
      prepare_corpus(gpt2_options(remat::DataFormat::jsonl, dir / "docs.jsonl", dir / "jsonl"));
  const PrepareOptions options = gpt2_options(remat::DataFormat::text, dir / "texts" / "*.txt", dir / "text");
  const CorpusInfo from_text = prepare_corpus(options);
  for (const CorpusInfo& info : {from_jsonl, from_text}) {
    EXPECT_EQ(ids_of(info), expected) << info.source;
    EXPECT_GT(info.val_tokens, 0);
  }
  EXPECT_EQ(from_jsonl.text_sha256, from_text.text_sha256);
  EXPECT_EQ(from_jsonl.train_sha256, from_text.train_sha256);
  EXPECT_EQ(from_jsonl.source, "the field \"text\" of the JSONL file " + (dir / "docs.jsonl").string());
  EXPECT_EQ(from_text.source, "40 text files matching " + (dir / "texts" / "*.txt").string());
  EXPECT_TRUE(prepare_corpus(options).cached);

  // A few documents at a time through the scratch file, as a corpus of any size is: the
  // same files, and the scratch file gone.
  PrepareOptions batched = gpt2_options(remat::DataFormat::jsonl, dir / "docs.jsonl", dir / "batched");
  batched.batch_bytes = 1000;
  std::vector<std::string> log;
  const CorpusInfo from_batches = prepare_corpus(batched, [&](const std::string& l) { log.push_back(l); });
  EXPECT_EQ(ids_of(from_batches), expected);
  EXPECT_EQ(from_batches.train_sha256, from_jsonl.train_sha256);
  EXPECT_EQ(from_batches.val_sha256, from_jsonl.val_sha256);
  EXPECT_EQ(from_batches.text_sha256, from_jsonl.text_sha256);
  EXPECT_GT(std::count_if(log.begin(), log.end(), [](const std::string& l) { return l.rfind("encoded ", 0) == 0; }), 5);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir / "batched")) files.push_back(e.path().filename());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"meta.json", "tokenizer.model", "train.bin", "val.bin"}));
}

// Token ids are taken as written, every one held to the given tokenizer's vocabulary.
TEST(Corpus, PreparesTokenShardsAsWritten) {
  TempDir dir;
  const Tokenizer tok = Tokenizer::load(kGpt2Tokenizer);
  std::vector<int32_t> all;
  for (int shard = 0; shard < 3; ++shard) {
    // llm.c's layout: an end of text before each document.
    std::vector<uint16_t> ids = {static_cast<uint16_t>(tok.eos_id())};
    for (int32_t id : tok.encode(remat::testing::make_text(60, static_cast<uint64_t>(shard) + 3))) {
      ids.push_back(static_cast<uint16_t>(id));
    }
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 1;
    header[2] = static_cast<int32_t>(ids.size());
    write(dir / fmt::format("shard_{:03}.bin", shard),
          std::string(reinterpret_cast<const char*>(header.data()), 1024) +
              std::string(reinterpret_cast<const char*>(ids.data()), 2 * ids.size()));
    all.insert(all.end(), ids.begin(), ids.end());
  }
  PrepareOptions options = gpt2_options(remat::DataFormat::tokens, dir / "shard_*.bin", dir / "corpus");
  std::vector<std::string> log;
  const CorpusInfo info = prepare_corpus(options, [&](const std::string& l) { log.push_back(l); });
  EXPECT_EQ(info.vocab_size, tok.vocab_size());
  EXPECT_EQ(info.text_bytes, 0);
  EXPECT_EQ(ids_of(info), all);
  EXPECT_EQ(info.source, "the ids of 3 token files matching " + (dir / "shard_*.bin").string());
  EXPECT_NE(std::find(log.begin(), log.end(), "reading 3 token files matching " + (dir / "shard_*.bin").string()),
            log.end());

  EXPECT_TRUE(prepare_corpus(options).cached);
  options.tokenizer.reset();
  EXPECT_EQ(error_of([&] { prepare_corpus(options); }),
            "Token ids can be prepared only with the tokenizer that wrote them; give it.");
}

// Token shards are split a chunk at a time as they are read, with the cut rule the
// documents' encoded ids get in memory: shards holding the ids of JSONL documents, joined
// by the end of text and broken at document starts, give train.bin and val.bin byte for
// byte, across 20 validation blocks.
TEST(Corpus, TokenShardsSplitAsTheirDocumentsDo) {
  TempDir dir;
  const Tokenizer tok = Tokenizer::load(kGpt2Tokenizer);
  std::string jsonl;
  std::vector<std::vector<uint16_t>> shards(7);
  for (int d = 0; d < 120; ++d) {
    const std::string text = remat::testing::make_text(3 + d % 11, static_cast<uint64_t>(d) + 5);
    jsonl += nlohmann::json{{"text", text}}.dump() + "\n";
    std::vector<uint16_t>& shard = shards[static_cast<size_t>(d * 7 / 120)];
    if (d > 0 && !shard.empty()) shard.push_back(static_cast<uint16_t>(tok.eos_id()));
    for (int32_t id : tok.encode(text)) shard.push_back(static_cast<uint16_t>(id));
    if (d + 1 < 120 && (d + 1) * 7 / 120 != d * 7 / 120) shard.push_back(static_cast<uint16_t>(tok.eos_id()));
  }
  for (size_t k = 0; k < shards.size(); ++k) {
    write(dir / fmt::format("shard_{}.bin", k),
          std::string(reinterpret_cast<const char*>(shards[k].data()), 2 * shards[k].size()));
  }
  write(dir / "docs.jsonl", jsonl);
  PrepareOptions from_docs = gpt2_options(remat::DataFormat::jsonl, dir / "docs.jsonl", dir / "docs");
  PrepareOptions from_shards = gpt2_options(remat::DataFormat::tokens, dir / "shard_*.bin", dir / "shards");
  from_docs.val_blocks = from_shards.val_blocks = 20;
  const CorpusInfo docs = prepare_corpus(from_docs), ids = prepare_corpus(from_shards);
  EXPECT_GT(docs.val_tokens, 0);
  EXPECT_EQ(ids.train_tokens, docs.train_tokens);
  EXPECT_EQ(ids.train_sha256, docs.train_sha256);
  EXPECT_EQ(ids.val_sha256, docs.val_sha256);
  EXPECT_DOUBLE_EQ(ids.train_unigram_entropy, docs.train_unigram_entropy);
}

// The process's resident bytes now (VmRSS), its anonymous ones (RssAnon), or all at their
// peak since reset_peak_resident (VmHWM), from Linux's /proc/self/status.
int64_t resident_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  ADD_FAILURE() << "/proc/self/status has no " << field;
  return 0;
}
void reset_peak_resident() { std::ofstream("/proc/self/clear_refs") << "5"; }

// Token files of any size: prepare reads them a chunk at a time (twice: to count, then to
// write the splits) and a run maps the splits, so neither holds the ids. 16M ids would take
// 64 MiB as int32, and as much again for the splits' copies; the peak grows by a few MiB.
TEST(Corpus, TokenFilesArePreparedAndReadInBoundedMemory) {
  TempDir dir;
  const CorpusInfo small = prepare_corpus(small_options(dir, remat::testing::make_text(1000)));
  const int vocab = small.vocab_size, eos = Tokenizer::load(small.tokenizer_path()).eos_id();
  constexpr int64_t kShards = 4, kShardIds = int64_t{1} << 22;
  // No end of text among them, so that the one cut falls at its 95%.
  const auto id_at = [&](int64_t i) {
    const int64_t id = (i * 7919) % (vocab - 1);
    return static_cast<uint16_t>(id >= eos ? id + 1 : id);
  };
  for (int64_t k = 0; k < kShards; ++k) {
    std::vector<uint16_t> ids(kShardIds);
    for (int64_t i = 0; i < kShardIds; ++i) ids[static_cast<size_t>(i)] = id_at(k * kShardIds + i);
    write(dir / fmt::format("ids_{}.bin", k), std::string(reinterpret_cast<const char*>(ids.data()), 2 * ids.size()));
  }
  PrepareOptions options;
  options.format = remat::DataFormat::tokens;
  options.text_file = dir / "ids_*.bin";
  options.tokenizer = small.tokenizer_path();
  options.out_dir = dir / "ids";
  options.val_blocks = 1;

  reset_peak_resident();
  const int64_t before = resident_bytes("VmRSS");
  const CorpusInfo info = prepare_corpus(options);
  EXPECT_LT(resident_bytes("VmHWM") - before, int64_t{12} << 20);
  ASSERT_EQ(info.train_tokens + info.val_tokens, kShards * kShardIds);
  EXPECT_NEAR(static_cast<double>(info.val_tokens) / static_cast<double>(kShards * kShardIds), 0.05, 1e-6);

  // Opening the splits and drawing batches from them adds no anonymous memory beyond the
  // batches' (int32 copies of the splits would add 64 MiB): the mapped pages are the
  // kernel's file cache, however many of them the kernel maps around each window.
  const int64_t anonymous = resident_bytes("RssAnon");
  const TokenDataset train = TokenDataset::open(info, Split::train), val = TokenDataset::open(info, Split::val);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 5; ++i) {
    const Batch b = train.sample(4, 256, rng);
    EXPECT_EQ(b.tokens[0][1].item<int64_t>(), b.targets[0][0].item<int64_t>());
  }
  EXPECT_LT(resident_bytes("RssAnon") - anonymous, int64_t{8} << 20);

  // The splits are the ids as written: train, then the validation stretch at the end.
  const std::vector<int32_t> last = val.ids(val.size() - 3, 3), first = train.ids(0, 3);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(first[static_cast<size_t>(i)], id_at(i));
    EXPECT_EQ(last[static_cast<size_t>(i)], id_at(kShards * kShardIds - 3 + i));
  }
  EXPECT_EQ(val.ids(0, 1)[0], id_at(info.train_tokens));
}

TEST(Corpus, DamagedCacheIsReportedAndRebuilt) {
  TempDir dir;
  const PrepareOptions options = small_options(dir, remat::testing::make_text(1000));
  const CorpusInfo info = prepare_corpus(options);

  // Truncated: load_corpus_info names the file and the fix; prepare rebuilds.
  fs::resize_file(info.train_path(), 10);
  const std::string error = error_of([&] { load_corpus_info(options.out_dir); });
  EXPECT_NE(error.find("train.bin has 10 bytes"), std::string::npos) << error;
  EXPECT_NE(error.find("remat prepare"), std::string::npos) << error;
  std::vector<std::string> log;
  const CorpusInfo rebuilt = prepare_corpus(options, [&](const std::string& l) { log.push_back(l); });
  EXPECT_FALSE(rebuilt.cached);
  EXPECT_EQ(rebuilt.train_sha256, info.train_sha256);  // deterministic

  // Same size, one byte changed: only the checksum notices.
  {
    std::fstream f(info.val_path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(3);
    f.put('\x7f');
  }
  EXPECT_FALSE(prepare_corpus(options).cached);
  EXPECT_TRUE(prepare_corpus(options).cached);

  // A missing tokenizer and garbage meta.json are rebuilt too.
  fs::remove(info.tokenizer_path());
  EXPECT_FALSE(prepare_corpus(options).cached);
  write(info.meta_path(), "{not json");
  EXPECT_NE(error_of([&] { load_corpus_info(options.out_dir); }).find("meta.json"), std::string::npos);
  EXPECT_FALSE(prepare_corpus(options).cached);
  EXPECT_TRUE(prepare_corpus(options).cached);
}

// A number out of its field's range in meta.json (a damaged or hand-edited file) was
// converted with undefined behaviour (1e300 into an int) or overflowed the size check (a
// count near 2^62 times the token width), as fuzz/corpus_meta.cpp's sanitizers show on
// these inputs. Its own suite: no SentencePiece, so scripts/sanitize.sh runs it.
TEST(CorpusMeta, RefusesNumbersOutOfRange) {
  TempDir dir;
  for (const char* name : {"tokenizer.model", "train.bin", "val.bin"}) write(dir / name, std::string(8, '\0'));
  nlohmann::json meta = {
      {"format", "remat-corpus"},
      {"recipe", 1},
      {"source", "test"},
      {"text", {{"sha256", "00"}, {"bytes", 64}}},
      {"tokenizer", {{"sha256", "00"}, {"vocab_size", 512}, {"max_training_bytes", 1024}, {"seed", 0}}},
      {"split", {{"val_fraction", 0.05}, {"val_blocks", 20}}},
      {"tokens",
       {{"dtype", "uint16"}, {"train", {{"count", 4}, {"sha256", "aa"}}}, {"val", {{"count", 4}, {"sha256", "bb"}}}}},
      {"train_unigram_entropy_nats", 1.5},
  };
  const auto error_for = [&](const nlohmann::json& changed) {
    write(dir / "meta.json", changed.dump());
    return error_of([&] { load_corpus_info(dir.path().string()); });
  };
  EXPECT_EQ(error_for(meta), "");
  nlohmann::json bad = meta;
  bad["tokenizer"]["vocab_size"] = 1e300;
  EXPECT_EQ(error_for(bad),
            (dir / "meta.json").string() +
                " is not valid corpus metadata (tokenizer.vocab_size is 1e+300, not a whole number from 1 "
                "to 16777216); run `remat prepare` to rebuild it.");
  bad = meta;
  bad["tokens"]["train"]["count"] = int64_t{1} << 62;
  EXPECT_EQ(error_for(bad), (dir / "meta.json").string() +
                                " is not valid corpus metadata (tokens.train.count is 4611686018427387904, not a whole "
                                "number from 0 to 1099511627776); run `remat prepare` to rebuild it.");
  bad = meta;
  bad["split"]["val_blocks"] = 2.5;
  EXPECT_NE(error_for(bad).find("(split.val_blocks is 2.5, not a whole number from 1 to 2147483647)"),
            std::string::npos);
  bad = meta;
  bad["format"] = "other";
  EXPECT_EQ(error_for(bad), (dir / "meta.json").string() +
                                " is not valid corpus metadata (format is not remat-corpus); run `remat prepare` to "
                                "rebuild it.");
}

TEST(Corpus, MissingDirectorySuggestsPrepare) {
  const std::string error = error_of([] { load_corpus_info("/nonexistent/corpus"); });
  EXPECT_NE(error.find("/nonexistent/corpus"), std::string::npos) << error;
  EXPECT_NE(error.find("remat prepare"), std::string::npos) << error;
  TempDir dir;
  const std::string no_meta = error_of([&] { load_corpus_info(dir.path().string()); });
  EXPECT_NE(no_meta.find("meta.json"), std::string::npos) << no_meta;
}

TEST(Corpus, RefusesMissingEmptyAndNonUtf8Files) {
  TempDir dir;
  PrepareOptions options;
  options.out_dir = dir / "corpus";

  options.text_file = dir / "missing.txt";
  std::string error = error_of([&] { prepare_corpus(options); });
  EXPECT_EQ(error, "The text file " + *options.text_file + " does not exist.");

  options.text_file = dir / "empty.txt";
  write(*options.text_file, "");
  error = error_of([&] { prepare_corpus(options); });
  EXPECT_EQ(error, "The text file " + *options.text_file + " is empty.");

  options.text_file = dir / "latin1.txt";
  write(*options.text_file, "caf\xC3\xA9 ok, then Latin-1: caf\xE9!");
  error = error_of([&] { prepare_corpus(options); });
  EXPECT_EQ(error, "The text file " + *options.text_file +
                       " is not valid UTF-8: the sequence at byte offset 27 (starting 0xE9) is "
                       "invalid.");

  options.text_file = dir / "binary.txt";
  write(*options.text_file, std::string("text\0more", 9));
  error = error_of([&] { prepare_corpus(options); });
  EXPECT_EQ(error, "The text file " + *options.text_file +
                       " holds a NUL byte at offset 4: it is binary data, not "
                       "text; give a UTF-8 text file.");

  // Endless or blocking sources: refused before a byte is read, not after filling memory
  // or waiting for a writer for ever.
  const std::string fifo = dir / "text.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& source : {std::string("/dev/zero"), fifo}) {
    options.text_file = source;
    error = error_of([&] { prepare_corpus(options); });
    EXPECT_EQ(error, "The text file " + source +
                         " is not a regular file (a FIFO, device or socket); remat reads its inputs only from "
                         "regular files, which cannot make it wait or read for ever: give a file.");
  }

  options.text_file = dir / "blank.txt";
  write(*options.text_file, " \n\n\t\n");
  error = error_of([&] { prepare_corpus(options); });
  EXPECT_EQ(error, "The text file " + *options.text_file + " holds only whitespace; there is no text to train on.");

  // One 2 MiB line, which SentencePiece would take minutes and gigabytes over.
  options.text_file = dir / "long_line.txt";
  write(*options.text_file, "a short line\n" + std::string(size_t{2} << 20, 'x') + "\n");
  error = error_of([&] { prepare_corpus(options); });
  EXPECT_EQ(error, "Line 2 of the text file " + *options.text_file +
                       " is 2097152 bytes long, more than the 1 MiB remat tokenizes at once; break the text into lines "
                       "(paragraphs).");

  options.text_file = dir.path().string();
  error = error_of([&] { prepare_corpus(options); });
  EXPECT_NE(error.find("is a directory"), std::string::npos) << error;
  EXPECT_FALSE(fs::exists(dir / "corpus"));  // nothing written for a refused input
}

TEST(Corpus, MissingBibleProgramNamesThePackage) {
  const std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  ::setenv("PATH", "/nonexistent", 1);
  const std::string error = error_of([] { read_kjv_text(); });
  ::setenv("PATH", path.c_str(), 1);
  EXPECT_NE(error.find("`bible` program"), std::string::npos) << error;
  EXPECT_NE(error.find("bible-kjv"), std::string::npos) << error;
}

TEST(Corpus, FailedRebuildLeavesTheOldCorpus) {
  TempDir dir;
  PrepareOptions options = small_options(dir, remat::testing::make_text(300));
  const CorpusInfo info = prepare_corpus(options);
  options.vocab_size = 60000;  // far more pieces than this text can make
  const std::string error = error_of([&] { prepare_corpus(options); });
  EXPECT_NE(error.find("too small for a 60000-piece vocabulary"), std::string::npos) << error;
  EXPECT_EQ(load_corpus_info(options.out_dir).train_sha256, info.train_sha256);
}

// A validation share too small for the text once wrote an empty split, found only by a
// run's first validation.
TEST(Corpus, AValidationSplitThatWouldBeEmptyIsRefused) {
  TempDir dir;
  PrepareOptions options = small_options(dir, remat::testing::make_text(300));
  options.val_fraction = 1e-7;
  const std::string error = error_of([&] { prepare_corpus(options); });
  EXPECT_EQ(error.rfind("The text file " + *options.text_file + " encodes to ", 0), 0u) << error;
  EXPECT_NE(error.find("tokens, too few for a validation split of data.val_fraction = 1e-07: it would be empty"),
            std::string::npos)
      << error;
  EXPECT_FALSE(fs::exists(options.out_dir));
}

TEST(Corpus, RefusesBadOptions) {
  PrepareOptions options;
  options.text_file = "/unused";
  options.vocab_size = 100;
  EXPECT_NE(error_of([&] { prepare_corpus(options); }).find("got 100"), std::string::npos);
  options.vocab_size = 512;
  options.val_fraction = 0.7;
  EXPECT_NE(error_of([&] { prepare_corpus(options); }).find("[0, 0.5]"), std::string::npos);
}

TEST(Corpus, UnigramEntropy) {
  // The counts of ids {3, 3, 3} in 8 pieces, of {0, 1, 2, 3} and of {0, 0, 1, 1} in 4.
  EXPECT_DOUBLE_EQ(unigram_entropy({0, 0, 0, 3, 0, 0, 0, 0}), 0.0);
  EXPECT_NEAR(unigram_entropy({1, 1, 1, 1}), std::log(4.0), 1e-12);
  EXPECT_NEAR(unigram_entropy({2, 2, 0, 0}), std::log(2.0), 1e-12);
  EXPECT_DOUBLE_EQ(unigram_entropy({0, 0}), 0.0);  // an empty split
}

// The real default corpus, end to end (about 2-3 s on 2 cores). Skipped where Debian's
// bible-kjv is not installed.
TEST(Corpus, KingJamesBible) {
  std::string text;
  try {
    text = read_kjv_text();
  } catch (const std::runtime_error& e) {
    GTEST_SKIP() << e.what();
  }
  EXPECT_EQ(text.rfind("Genesis 1\nIn the beginning God created the heaven and the earth.\n", 0), 0u);
  EXPECT_NE(text.find("\n\nGenesis 2\nThus the heavens and the earth were finished"), std::string::npos);
  EXPECT_NE(text.find("\n\nRevelation 22\n"), std::string::npos);
  const std::string last_verse = "\nThe grace of our Lord Jesus Christ be with you all. Amen.\n";
  EXPECT_EQ(text.substr(text.size() - last_verse.size()), last_verse);

  TempDir dir;
  PrepareOptions options;
  options.out_dir = dir / "kjv";
  const auto start = std::chrono::steady_clock::now();
  // The log goes to the test output: it is the record of what the default corpus is.
  const CorpusInfo info = prepare_corpus(options, [](const std::string& line) { std::printf("  %s\n", line.c_str()); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 20.0);
  EXPECT_EQ(info.vocab_size, 2048);
  EXPECT_GT(info.train_tokens, 900000);
  EXPECT_GT(info.val_tokens, 40000);
  EXPECT_GT(info.bytes_per_token(), 3.0);
  EXPECT_GT(info.train_unigram_entropy, 5.0);
  EXPECT_LT(info.train_unigram_entropy, std::log(2048.0));
  EXPECT_TRUE(prepare_corpus(options).cached);
}

}  // namespace
