#include "remat/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "data/test_text.h"
#include "util/atomic_file.h"
#include "util/error_of.h"
#include "util/paths.h"
#include "util/temp_dir.h"

namespace {

using remat::data::Tokenizer;
using remat::data::TokenizerTrainOptions;

TokenizerTrainOptions small_vocab() {
  TokenizerTrainOptions options;
  options.vocab_size = 512;
  return options;
}

// The process links LibTorch (libprotobuf.so.32); training and encoding here is the check
// that SentencePiece's bundled protobuf stays out of its way.
TEST(Tokenizer, RoundTripsTextItWasTrainedOn) {
  const std::string text = remat::testing::make_text(400);
  const Tokenizer tok = Tokenizer::train(text, small_vocab());
  EXPECT_EQ(tok.vocab_size(), 512);
  EXPECT_EQ(tok.unk_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.pad_id(), -1);

  const std::vector<int32_t> ids = tok.encode(text);
  // BPE merges must compress: fewer tokens than bytes, and no <unk>.
  EXPECT_LT(ids.size(), text.size() / 2);
  for (int32_t id : ids) ASSERT_NE(id, tok.unk_id());
  EXPECT_EQ(tok.decode(ids), text);
}

TEST(Tokenizer, UnseenCharactersFallBackToBytes) {
  const Tokenizer tok = Tokenizer::train(remat::testing::make_text(400), small_vocab());
  const std::string unseen = "Zürich \xE2\x88\x80x \xF0\x9F\x99\x82\tend\n  two  spaces";
  const std::vector<int32_t> ids = tok.encode(unseen);
  for (int32_t id : ids) ASSERT_NE(id, tok.unk_id());
  EXPECT_EQ(tok.decode(ids), unseen);
  // The 4-byte emoji is four byte pieces.
  const std::vector<int32_t> emoji = tok.encode("\xF0\x9F\x99\x82");
  ASSERT_EQ(emoji.size(), 4u);
  EXPECT_EQ(tok.piece(emoji[0]), "<0xF0>");
  EXPECT_EQ(tok.piece(emoji[3]), "<0x82>");
}

TEST(Tokenizer, TrainsOnTextWithoutLineBreaks) {
  // One ~15 kB line: cut into sentences for training, else SentencePiece would skip it.
  std::string text = remat::testing::make_text(250);
  for (char& c : text) {
    if (c == '\n') c = ' ';
  }
  const Tokenizer tok = Tokenizer::train(text, small_vocab());
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_LT(ids.size(), text.size() / 2);
  EXPECT_EQ(tok.decode(ids), text);
}

TEST(Tokenizer, TrainingIsDeterministic) {
  const std::string text = remat::testing::make_text(300);
  EXPECT_EQ(Tokenizer::train(text, small_vocab()).serialized(), Tokenizer::train(text, small_vocab()).serialized());
  // Subsampled (a 6 kB budget for ~18 kB of text): still deterministic for a seed.
  TokenizerTrainOptions capped = small_vocab();
  capped.vocab_size = 400;
  capped.max_training_bytes = 6000;
  const std::string a = Tokenizer::train(text, capped).serialized();
  EXPECT_EQ(a, Tokenizer::train(text, capped).serialized());
  EXPECT_NE(a, Tokenizer::train(text,
                                [&] {
                                  auto o = capped;
                                  o.max_training_bytes = 0;
                                  return o;
                                }())
                   .serialized());
}

TEST(Tokenizer, SavesAndLoads) {
  const std::string text = remat::testing::make_text(300);
  const Tokenizer tok = Tokenizer::train(text, small_vocab());
  const remat::testing::TempDir dir;
  const auto path = dir / "tokenizer.model";
  tok.save(path.string());
  const Tokenizer loaded = Tokenizer::load(path.string());
  EXPECT_EQ(loaded.encode(text), tok.encode(text));
  EXPECT_EQ(loaded.piece_to_id(tok.piece(300)), 300);
}

const std::string kHfDir = std::string(remat::testing::kSourceDir) + "/tests/data/hf_tokenizers/";

// A Hugging Face tokenizer.json, alone or as its model's folder, with its config's begin and
// end of text; what save() writes of it loads back the same.
TEST(Tokenizer, LoadsAHuggingFaceTokenizerItsFolderAndWhatItSaves) {
  const Tokenizer file = Tokenizer::load(kHfDir + "llama3/tokenizer.json");
  const Tokenizer folder = Tokenizer::load(kHfDir + "llama3");
  EXPECT_EQ(file.kind(), "byte-level BPE (Hugging Face)");
  EXPECT_EQ(folder.serialized(), file.serialized());
  EXPECT_EQ(file.bos_id(), file.piece_to_id("<|begin_of_text|>"));
  EXPECT_EQ(file.eos_id(), file.piece_to_id("<|end_of_text|>"));
  EXPECT_EQ(file.unk_id(), -1);
  EXPECT_EQ(file.pad_id(), -1);
  EXPECT_EQ(file.piece(file.eos_id()), "<|end_of_text|>");
  const std::string text = "In the beginning\n\n  God created \u00e9\U0001F642<|end_of_text|>";
  const std::vector<int32_t> ids = file.encode(text);
  EXPECT_EQ(ids.back(), file.eos_id());
  EXPECT_EQ(file.decode(ids), text);

  const remat::testing::TempDir dir;
  file.save(dir / "tokenizer.model");
  const Tokenizer saved = Tokenizer::load(dir / "tokenizer.model");
  EXPECT_EQ(saved.serialized(), file.serialized());
  EXPECT_EQ(saved.encode(text), ids);
  EXPECT_EQ(saved.eos_id(), file.eos_id());
  // Lines: the index of each line's first token, though a token may hold several newlines.
  std::vector<int64_t> line_starts;
  EXPECT_EQ(saved.encode_text(text, line_starts, 2), ids);
  ASSERT_EQ(line_starts.size(), 3u);
  EXPECT_EQ(line_starts[0], 0);
  EXPECT_EQ(saved.decode(std::vector<int32_t>(ids.begin() + line_starts[2], ids.end())).rfind("  God", 0), 0u);
}

TEST(Tokenizer, RefusesWhatIsNoTokenizerWithASentence) {
  const remat::testing::TempDir dir;
  EXPECT_EQ(remat::testing::error_of<std::runtime_error>([&] { Tokenizer::load(dir.path()); }),
            "The folder " + dir.path().string() +
                " holds neither tokenizer.json nor tokenizer.model; give a tokenizer file, or the folder of a model "
                "that has one.");
  remat::util::write_file_atomically(dir / "notes.txt", "plain words");
  EXPECT_EQ(remat::testing::error_of<std::runtime_error>([&] { Tokenizer::load(dir / "notes.txt"); })
                .rfind("The tokenizer " + (dir / "notes.txt").string() +
                           " is neither a SentencePiece model nor a Hugging Face tokenizer.json: ",
                       0),
            0u);
  remat::util::write_file_atomically(dir / "tokenizer.json", "{\"format\":\"remat-byte-level-bpe\",");
  EXPECT_EQ(remat::testing::error_of<std::runtime_error>([&] {
              Tokenizer::load(dir.path());
            }).rfind("The tokenizer " + (dir / "tokenizer.json").string() + " that remat saved is damaged (", 0),
            0u);
}

TEST(Tokenizer, ErrorsAreSentences) {
  try {
    Tokenizer::load("/nonexistent/tokenizer.model");
    FAIL() << "loading a missing model must fail";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tokenizer.model"), std::string::npos) << e.what();
  }
  TokenizerTrainOptions tiny;
  tiny.vocab_size = 100;
  EXPECT_THROW(Tokenizer::train("some text", tiny), std::runtime_error);
  // Too little text for the vocabulary: the most pieces it makes, and what to change.
  TokenizerTrainOptions many;
  many.vocab_size = 2048;
  const std::string what =
      remat::testing::error_of<std::runtime_error>([&] { Tokenizer::train("hello world\n", many); });
  EXPECT_EQ(what.rfind("The text is too small for a 2048-piece vocabulary: its 11 bytes (1 line) make at most ", 0), 0u)
      << "2048 pieces from 12 bytes must be refused: " << what;
  EXPECT_NE(what.find(" BPE pieces (the 256 bytes among them); set data.vocab_size to at most "), std::string::npos)
      << what;
  EXPECT_EQ(what.find("Internal"), std::string::npos) << what;

  // More distinct characters than the vocabulary holds beside the bytes (found by fuzzing;
  // SentencePiece's own words were "Internal: ... smaller than required_chars. 260 vs 282"):
  // "abc def" has 6 letters and the space, so 266 pieces, which then train.
  TokenizerTrainOptions least;
  least.vocab_size = 260;
  EXPECT_EQ(remat::testing::error_of<std::runtime_error>([&] { Tokenizer::train("abc def\n", least); }),
            "The text has 7 distinct characters, each of which needs a piece of its own beside the 256 byte pieces "
            "and the 3 special ones, so a 260-piece vocabulary cannot hold them; set data.vocab_size to at least "
            "266 (more leaves room for the merges that make tokens longer than a character).");
  least.vocab_size = 266;
  EXPECT_EQ(Tokenizer::train("abc def\n", least).vocab_size(), 266);

  const Tokenizer tok = Tokenizer::train(remat::testing::make_text(300), small_vocab());
  try {
    tok.decode(std::vector<int32_t>{5, 512});
    FAIL() << "an id outside the vocabulary must be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("512"), std::string::npos) << e.what();
  }
}

}  // namespace
