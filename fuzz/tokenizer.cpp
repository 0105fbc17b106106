// Feeds `remat prepare`'s text past the checks the prepare harness covers, into the
// tokenizer through the real SentencePiece library: every valid UTF-8 text without NUL
// bytes (what read_utf8_file lets through) is encoded with a fixed model and used to train
// a model of its own. Every input, valid UTF-8 or not, also goes through the Hugging Face
// byte-level BPE of the tests (Llama 3's layout), which must give back the text with each
// invalid sequence replaced by U+FFFD.
// A finding: a crash, an exception that is not a std::runtime_error sentence, an id outside
// the vocabulary, or a text that does not decode back to itself (the models trained here
// normalise nothing and fall back to bytes, so every text round-trips exactly, but for
// SentencePiece's whitespace mark U+2581, which may decode as a space: found here).
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include "harness.h"
#include "remat/tokenizer.h"
#include "util/utf8.h"

namespace {

// `text` with SentencePiece's mark for a space (U+2581) written as a space: where a model's
// piece holds the mark, it decodes as one wherever it came from (bytes fall back as they are).
std::string marks_as_spaces(std::string text) {
  constexpr std::string_view mark = "\xE2\x96\x81";
  for (size_t at = text.find(mark); at != std::string::npos; at = text.find(mark, at + 1)) {
    text.replace(at, mark.size(), " ");
  }
  return text;
}

// `tok` encodes `text` into its vocabulary and decodes it back to the same bytes.
void check_round_trip(const remat::data::Tokenizer& tok, std::string_view text, const char* which) {
  const std::vector<int32_t> ids = tok.encode(text);
  for (const int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) {
      remat::fuzz::finding(std::string(which) + " gave id " + std::to_string(id) + " outside its " +
                           std::to_string(tok.vocab_size()) + "-piece vocabulary");
    }
  }
  if (marks_as_spaces(tok.decode(ids)) != marks_as_spaces(std::string(text))) {
    remat::fuzz::finding(std::string(which) + ": the text does not decode back to itself");
  }
}

// A model trained once on generated words, as the tests' corpora are.
const remat::data::Tokenizer& fixed_model() {
  static const remat::data::Tokenizer tok = [] {
    const char* words[] = {"the",   "lord",     "said",   "unto",  "moses",  "and", "it",    "was",  "so",
                           "light", "darkness", "waters", "earth", "heaven", "day", "night", "good", "made"};
    std::string text;
    uint64_t x = 12345;
    for (int line = 0; line < 1500; ++line) {
      for (int w = 0; w < 10; ++w) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        text += std::string(words[(x >> 33) % 18]) + (w == 9 ? ".\n" : " ");
      }
    }
    remat::data::TokenizerTrainOptions options;
    options.vocab_size = 300;
    options.num_threads = 1;
    return remat::data::Tokenizer::train(text, options);
  }();
  return tok;
}

const remat::data::Tokenizer& byte_level() {
  static const remat::data::Tokenizer tok =
      remat::data::Tokenizer::load(REMAT_SOURCE_DIR "/tests/data/hf_tokenizers/llama3/tokenizer.json");
  return tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check_round_trip(byte_level(), remat::util::replace_invalid_utf8(text), "the byte-level BPE");
  const std::vector<int32_t> raw = byte_level().encode(text);
  if (raw != byte_level().encode(remat::util::replace_invalid_utf8(text))) {
    remat::fuzz::finding("the byte-level BPE encodes invalid UTF-8 other than its replacement");
  }
  // What `remat prepare` refuses before the tokenizer sees it.
  if (remat::util::find_invalid_utf8(text) != std::string_view::npos || text.find('\0') != std::string_view::npos) {
    return 0;
  }
  check_round_trip(fixed_model(), text, "the fixed model");
  // The least vocabulary first; where the text has too many distinct characters for it,
  // the size the sentence asks for, which must then train.
  remat::data::TokenizerTrainOptions options;
  options.vocab_size = 260;
  options.num_threads = 1;
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      const remat::data::Tokenizer own = remat::data::Tokenizer::train(text, options);
      check_round_trip(own, text, "a model trained on the text");
      return 0;
    } catch (const std::runtime_error& e) {
      // A sentence: too little text for the vocabulary, only empty lines, or too many
      // characters for it.
      const std::string said = e.what(), ask = "set data.vocab_size to at least ";
      const size_t at = said.find(ask);
      if (at == std::string::npos) return 0;
      if (attempt == 1) remat::fuzz::finding("the vocabulary the sentence asked for does not train: " + said);
      options.vocab_size = std::stoi(said.substr(at + ask.size()));
    } catch (const std::exception& e) {
      remat::fuzz::finding(std::string("training threw a ") + typeid(e).name() + " instead of a sentence: " + e.what());
    }
  }
  return 0;
}
