// The tokenizer: a SentencePiece BPE model that remat trains (or any SentencePiece
// .model, such as Llama 2's), or a Hugging Face byte-level BPE read from a tokenizer.json
// (GPT-2's, Llama 3's; src/data/byte_level_bpe.h says what is read). Training, loading,
// encoding and decoding.
//
// SentencePiece lives in a separate shared library (libremat_sentencepiece.so) that is
// opened at run time with its symbols kept private, because Debian's libsentencepiece
// carries its own copy of protobuf that clashes with the one LibTorch loads. Nothing of
// that shows here: a Tokenizer is an ordinary value type. The library is looked up at the
// path it was built to and then next to the running executable; failing both is an error
// that names the paths tried.
//
// Every model trained here uses the same conventions, chosen so that decode(encode(t)) == t
// for any UTF-8 text t, byte for byte:
//   - BPE, byte fallback on: a character outside the vocabulary becomes its UTF-8 bytes
//     (pieces "<0x00>".."<0xFF>"), so nothing ever maps to <unk>;
//   - identity normalisation, whitespace kept as is, no dummy space prefix;
//   - digits split into single pieces;
//   - ids 0, 1, 2 are <unk>, <s> (bos), </s> (eos); there is no padding id.
// Errors (missing library or file, bad model, SentencePiece refusing the options) are
// std::runtime_error with a one-sentence message.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace remat::data {

struct TokenizerTrainOptions {
  /// Total number of pieces, including <unk>, <s>, </s> and the 256 byte pieces; at
  /// least 260 and no more than the text supports (SentencePiece refuses otherwise).
  int vocab_size = 2048;
  /// Trainer threads. Training is deterministic for a given text, options and seed.
  int num_threads = 2;
  /// Text beyond this many bytes is subsampled (by lines, seeded) before training, so
  /// training a large corpus takes seconds; the whole text is still encoded afterwards.
  int64_t max_training_bytes = int64_t{32} << 20;
  /// Fraction of characters that get their own piece; the rarest rest use byte fallback.
  double character_coverage = 0.9995;
  /// Seeds SentencePiece's subsampling (unused when the text fits max_training_bytes).
  uint32_t seed = 0;
};

class ByteLevelBpe;

class Tokenizer {
 public:
  /// Trains on `text`. Lines are training sentences; lines longer than 2048 bytes are
  /// cut at a space (or a character boundary) first, since SentencePiece skips long ones.
  static Tokenizer train(std::string_view text, const TokenizerTrainOptions& options = {});
  /// Reads a model written by save(), a SentencePiece .model file, a Hugging Face
  /// tokenizer.json (with the tokenizer_config.json beside it, where there is one, for
  /// the begin and end of text), or a folder holding tokenizer.json or tokenizer.model.
  static Tokenizer load(const std::string& path);
  /// Writes the model to `model_path` atomically (a temporary file, then a rename).
  void save(const std::string& model_path) const;
  /// The serialized model (what save() writes): SentencePiece's bytes, or a JSON object
  /// holding a tokenizer.json's and its tokenizer_config.json's texts.
  const std::string& serialized() const { return model_; }
  /// The files that load it into Hugging Face's tokenizers and transformers, by name: a
  /// byte-level BPE's tokenizer.json and, where it came with one, its tokenizer_config.json;
  /// none for a SentencePiece model (saved, it is already a tokenizer.model).
  std::vector<std::pair<std::string, std::string>> hf_files() const;
  /// "SentencePiece BPE" or "byte-level BPE (Hugging Face)".
  std::string kind() const;

  /// Token ids of `text`. A SentencePiece model's cost grows faster than linearly with
  /// the length of a single line, so long texts are best given to encode_text.
  std::vector<int32_t> encode(std::string_view text) const;
  /// Token ids of a whole text, with the index of each line's first token (the first
  /// token starting at or after the line's first byte) in `line_starts`. A SentencePiece
  /// model trained here encodes line by line on `threads` threads (no piece spans a
  /// newline); a byte-level BPE, whose pieces may, encodes the text whole, as its own
  /// library would.
  std::vector<int32_t> encode_text(std::string_view text, std::vector<int64_t>& line_starts, int threads) const;
  /// The text of `ids`; every id must be in [0, vocab_size()).
  std::string decode(const int32_t* ids, size_t count) const;
  std::string decode(const std::vector<int32_t>& ids) const { return decode(ids.data(), ids.size()); }

  int vocab_size() const;
  /// -1 where the model has none (a byte-level BPE never needs one).
  int unk_id() const;
  /// -1 where the model has none.
  int bos_id() const;
  /// -1 where the model has none.
  int eos_id() const;
  /// -1 when the model has no padding piece (the case for models trained here).
  int pad_id() const;
  /// The piece of `id`, e.g. "▁the", "<0xE2>" or "Ġthe".
  std::string piece(int id) const;
  /// The id of `piece`, or unk_id() if the vocabulary lacks it.
  int piece_to_id(std::string_view piece) const;

 private:
  struct Handle;
  Tokenizer(std::shared_ptr<Handle> handle, std::shared_ptr<const ByteLevelBpe> bpe, std::string model);
  // Shared: encoding is thread-safe and copies are cheap. One of the two is set.
  std::shared_ptr<Handle> handle_;
  std::shared_ptr<const ByteLevelBpe> bpe_;
  std::string model_;
};

}  // namespace remat::data
