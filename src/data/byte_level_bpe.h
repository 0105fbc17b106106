// Hugging Face's byte-level BPE, read from a tokenizer.json as GPT-2 and Llama 3 ship it,
// encoding and decoding as the `tokenizers` library does (held to it by golden files,
// tests/data/hf_tokenizers/).
//
// What is read: a BPE model (vocab, merges as "a b" or ["a", "b"], ignore_merges), the
// added tokens (split out of the text first, leftmost-longest, those matched before
// normalisation ahead of the others, as `tokenizers` does), and one of two pre-tokenizer
// layouts: ByteLevel with its own regular expression (GPT-2's), or a Sequence of Split
// (a regular expression or a string, isolated) then ByteLevel without one (Llama 3's).
// Regular expressions run through PCRE2 in UTF and Unicode-property mode. Anything else
// (a normaliser, BPE dropout, suffixes, a prefix space, other pre-tokenizers) is refused
// with a sentence, as is a vocabulary without all 256 byte characters: with them, every
// text encodes, and decode(encode(t)) == t for valid UTF-8 t.
//
// Encoding sends no special token of its own (the post-processor's template is not
// applied); text that is not UTF-8 has each invalid sequence replaced by U+FFFD first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace remat::data {

class ByteLevelBpe {
 public:
  /// Parses `json` (a tokenizer.json's text) and `config` (its tokenizer_config.json's,
  /// or empty), naming `path` in errors (std::runtime_error, one sentence). The begin and
  /// end of text are the config's bos_token and eos_token, else the first added special
  /// token spelled as GPT-2's or Llama 3's.
  static std::shared_ptr<const ByteLevelBpe> parse(std::string_view json, std::string_view config,
                                                   const std::string& path);
  ~ByteLevelBpe();
  ByteLevelBpe(const ByteLevelBpe&) = delete;
  ByteLevelBpe& operator=(const ByteLevelBpe&) = delete;

  /// Token ids of `text`; where `starts` is given, it receives each token's byte offset
  /// in `text` (exact for valid UTF-8; what U+FFFD replaced counts as its replacement).
  std::vector<int32_t> encode(std::string_view text, std::vector<int64_t>* starts = nullptr) const;
  /// The bytes of `ids` (a token whose text is not byte-level characters, an added token
  /// such as "<|endoftext|>", gives its own UTF-8); each id must be a token's.
  std::string decode(const int32_t* ids, size_t count) const;

  /// One past the largest id.
  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  int bos_id() const { return bos_; }
  int eos_id() const { return eos_; }
  /// The token's text as tokenizer.json spells it ("Ġthe", "<|endoftext|>"); empty for an
  /// id no token has.
  const std::string& token(int id) const { return tokens_.at(static_cast<size_t>(id)); }
  /// The id of `token`, or -1.
  int token_to_id(std::string_view token) const;

 private:
  struct Impl;
  explicit ByteLevelBpe(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::vector<std::string> tokens_;
  int bos_ = -1, eos_ = -1;
};

}  // namespace remat::data
