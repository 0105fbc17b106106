// Training data: preparing a tokenized corpus directory, and drawing token batches from it.
//
// A corpus directory holds
//   tokenizer.model  the tokenizer, trained here or given (Tokenizer::save's form, see
//                    remat/tokenizer.h)
//   train.bin        training token ids, little-endian, uint16 (vocab <= 65536) or uint32
//   val.bin          validation token ids, same encoding
//   meta.json        source, text hash, options, token counts, checksums, unigram entropy
//
// The default text is the King James Bible from Debian's bible-kjv package, read by running
// `bible -l 100000 gen1:1-rev22:21`. Cleaning: verse numbers are dropped and each verse is
// one line; chapter headings ("Genesis 1") are kept as their own line, preceded by a blank
// line from the second chapter on, since they are part of the book's structure and cheap
// for a model to predict. Any other UTF-8 text file is used exactly as it is; documents
// (several files, JSONL records) and token ids are read as src/data/sources.h says.
//
// Validation split: the token stream is cut into `val_blocks` equal blocks and the last
// `val_fraction` of each block is validation, so validation samples the whole text (not
// only its end) in contiguous stretches long enough for whole sequences. Cut points move
// to the nearest line start (a document's, for documents and token ids) when one is close
// (within half a validation stretch).
//
// Errors are std::runtime_error with a one-sentence message naming the file or directory.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "remat/config.h"

namespace remat::data {

struct PrepareOptions {
  /// The file, or a glob of files, to read; unset means the King James Bible from the
  /// `bible` program.
  std::optional<std::string> text_file;
  /// What the files hold (remat/config.h). Several text files, or JSONL records, are
  /// documents, encoded one by one and separated by the tokenizer's end of text; a single
  /// text file is encoded whole, as it is. Token files are taken as written.
  DataFormat format = DataFormat::text;
  /// jsonl: the field holding each document's text.
  std::string field = "text";
  /// The corpus directory to write (created if missing).
  std::string out_dir = "data/kjv";
  /// Tokenizer vocabulary size, including 3 special and 256 byte pieces (>= 260).
  int vocab_size = 2048;
  /// A tokenizer to use instead of training one (any form Tokenizer::load reads: a
  /// Hugging Face tokenizer.json, a SentencePiece .model, a model's folder); vocab_size,
  /// max_training_bytes and seed then go unused.
  std::optional<std::string> tokenizer;
  /// Fraction of tokens held out for validation, in [0, 0.5].
  double val_fraction = 0.05;
  /// Number of contiguous validation stretches spread evenly through the text (>= 1).
  int val_blocks = 20;
  /// Text beyond this many bytes is subsampled (seeded) for tokenizer training only.
  int64_t max_training_bytes = int64_t{32} << 20;
  /// Seeds the tokenizer's subsampling; part of the cache key.
  uint32_t seed = 0;
  /// Rebuild even when the directory already holds a matching corpus.
  bool force = false;
  /// With a tokenizer given, documents are encoded a batch of at least this many bytes at a
  /// time (whole documents), their ids kept in a scratch file in out_dir until they are
  /// split: memory holds a batch, its ids and each document's start, not them all.
  size_t batch_bytes = size_t{32} << 20;
};

/// What meta.json records, plus where the files are.
struct CorpusInfo {
  std::string dir;
  std::string source;       // human-readable description of the text's origin
  std::string text_sha256;  // of the (cleaned) text that was tokenized
  int64_t text_bytes = 0;
  int vocab_size = 0;
  /// "trained", or the absolute path of the tokenizer given.
  std::string tokenizer_source;
  double val_fraction = 0;
  int val_blocks = 0;
  int64_t max_training_bytes = 0;
  uint32_t seed = 0;
  int token_bytes = 2;  // 2: uint16, 4: uint32
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  /// Entropy of the train tokens' unigram distribution, in nats/token: the loss of a
  /// model that ignores context. A trained model's validation loss must fall well below.
  double train_unigram_entropy = 0;
  std::string tokenizer_sha256, train_sha256, val_sha256;
  double prepare_seconds = 0;  // wall time of the run that built the directory
  /// True when prepare_corpus found a matching, intact corpus and did no work.
  bool cached = false;

  std::string tokenizer_path() const { return dir + "/tokenizer.model"; }
  std::string train_path() const { return dir + "/train.bin"; }
  std::string val_path() const { return dir + "/val.bin"; }
  std::string meta_path() const { return dir + "/meta.json"; }
  /// Mean UTF-8 bytes of text per token.
  double bytes_per_token() const {
    const int64_t tokens = train_tokens + val_tokens;
    return tokens == 0 ? 0.0 : static_cast<double>(text_bytes) / static_cast<double>(tokens);
  }
};

/// Reads the text, trains the tokenizer (or reads the one given), encodes, splits and
/// writes `options.out_dir`.
/// When the directory's meta.json records the same text hash and options and every file
/// checks out (sizes and SHA-256), nothing is rebuilt and the result has cached = true; a
/// damaged or stale directory is rebuilt, saying why through `log`. Every file is written
/// atomically and meta.json last, so an interrupted run never looks complete.
/// `log` receives progress lines (no trailing newline); may be empty.
CorpusInfo prepare_corpus(const PrepareOptions& options, const std::function<void(const std::string&)>& log = {});

/// Reads `dir`/meta.json and checks that the files it names exist with the recorded sizes.
/// A missing directory or file is an error that suggests running `remat prepare`.
CorpusInfo load_corpus_info(const std::string& dir);

/// The cleaned King James Bible text, from Debian's `bible` program (package bible-kjv).
std::string read_kjv_text();

/// `path`'s bytes after checking they are non-empty, valid UTF-8.
std::string read_utf8_file(const std::string& path);

/// Entropy, in nats, of the distribution that `counts` (of each id) give: a prepared
/// corpus's unigram entropy, from the counts its train split gathers as it is written.
double unigram_entropy(const std::vector<int64_t>& counts);

enum class Split { train, val };

/// A batch of next-token prediction examples.
struct Batch {
  at::Tensor tokens;   // [B, T] int64, inputs
  at::Tensor targets;  // [B, T] int64, targets[b][t] == the token after tokens[b][t]
};

/// The token stream of one split: a prepared corpus's token file mapped into memory, read
/// a window at a time as batches are drawn, so that a run holds none of it (its pages are
/// the kernel's file cache), or ids given in memory. Copies share the ids.
class TokenDataset {
 public:
  /// Maps train.bin or val.bin of a prepared corpus, checking its size against meta.json.
  /// Ids are checked against the vocabulary as they are read: a damaged file is refused
  /// by the first batch that meets its bad id, naming the id and its position.
  static TokenDataset open(const CorpusInfo& info, Split split);
  static TokenDataset open(const std::string& dir, Split split);
  /// Wraps ids already in memory (a 1-D integer tensor, copied as int32); `name` appears
  /// in errors.
  explicit TokenDataset(const at::Tensor& tokens, std::string name = "the token stream");

  /// Number of tokens.
  int64_t size() const { return size_; }
  /// The `count` ids from position `begin` (within [0, size()]), checked as a batch's are.
  std::vector<int32_t> ids(int64_t begin, int64_t count) const;

  /// `batch` windows of `seq` + 1 tokens at independent uniform offsets drawn from `rng`.
  /// The same rng state gives the same batch on every platform (no std distributions).
  /// Refuses seq + 1 > size() with a sentence.
  Batch sample(int64_t batch, int64_t seq, std::mt19937_64& rng) const;

  /// Deterministic batches for evaluation: window k covers tokens [k*seq, k*seq + seq]
  /// (targets overlap the next window's first input by one token), for k in
  /// [0, (size() - 1) / seq); batch i holds windows i*batch ... i*batch + batch - 1. The
  /// last batch has fewer rows when the windows do not divide evenly.
  int64_t num_sequential_batches(int64_t batch, int64_t seq) const;
  Batch sequential(int64_t index, int64_t batch, int64_t seq) const;

 private:
  TokenDataset() = default;
  void check_shape(int64_t batch, int64_t seq) const;
  // The id at `i`, refused with a sentence when it is not below vocab_.
  int64_t id_at(int64_t i) const;
  // Inputs and targets of the windows of seq + 1 ids starting at `starts`.
  Batch windows(const std::vector<int64_t>& starts, int64_t seq) const;

  std::shared_ptr<const void> owner_;  // what keeps data_ valid: a mapping, or a tensor
  const uint8_t* data_ = nullptr;
  int width_ = 4;  // bytes an id takes: 2 (uint16) or 4 (uint32, or int32 in memory)
  int64_t size_ = 0;
  uint32_t vocab_ = 0;  // ids must be below it; 0: not checked (ids given in memory)
  std::string path_;    // the token file, if any
  std::string name_;    // the split, for errors
};

}  // namespace remat::data
