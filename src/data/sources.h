// What a corpus is made from, read from the user's files (data.text, data.format): the
// files a glob names, the documents of text or JSONL files, and token ids already encoded
// (llm.c's and nanoGPT's .bin shards, Megatron's indexed dataset). Every file is read in
// chunks, refused when it is not a regular file, and refused with a sentence naming the file
// and the line or byte offset where it stops making sense.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "remat/config.h"
#include "util/sha256.h"

namespace remat::data {

/// The files `pattern` names: itself when it holds no glob character (* ? [), else its
/// matches in byte order of their paths; none is an error naming the pattern.
std::vector<std::string> expand_files(const std::string& pattern);

/// Documents in the order read, each a span of `text`.
struct Documents {
  /// Every document followed by a line break, so that a tokenizer trained on `text` meets
  /// each document's end as a line's.
  std::string text;
  struct Span {
    size_t begin = 0, size = 0;
  };
  std::vector<Span> spans;
  /// JSONL records whose text field was empty, left out.
  int64_t empty_records = 0;

  std::string_view document(size_t i) const { return std::string_view(text).substr(spans[i].begin, spans[i].size); }
  /// Bytes of the documents themselves (without the line breaks added between them).
  int64_t bytes() const;
  /// SHA-256 of the documents and their boundaries (each document's size, then its bytes).
  std::string sha256() const;
  /// Feeds what sha256() hashes to `h`: documents read in batches hash as if read at once.
  void hash_into(util::Sha256& h) const;
};

/// Each text file is a document (format text); each JSONL record's `field` is one (format
/// jsonl). Documents are UTF-8 without NUL bytes and with lines of at most 1 MiB, as a text
/// file must be (read_utf8_file), and all together at most 1 GiB.
Documents read_documents(const std::vector<std::string>& files, DataFormat format, const std::string& field);

/// What for_each_document_batch read.
struct DocumentsRead {
  std::string sha256;  ///< Documents::sha256 of them all, as read_documents would give it
  int64_t documents = 0;
  int64_t bytes = 0;  ///< of the documents themselves
  int64_t empty_records = 0;
};

/// The documents read_documents reads, passed to `batch` in order, a batch at a time: each
/// batch holds whole documents, at least `batch_bytes` of text but for the last, so that
/// memory holds a batch and not them all (a document itself may hold 1 GiB).
DocumentsRead for_each_document_batch(const std::vector<std::string>& files, DataFormat format,
                                      const std::string& field, size_t batch_bytes,
                                      const std::function<void(const Documents&)>& batch);

/// Receives token ids a chunk at a time, in the order they are read.
using TokenSink = std::function<void(const int32_t* ids, size_t n)>;

/// What token files hold, read without keeping their ids.
struct TokenStream {
  int64_t count = 0;
  /// The first token of each document (Megatron's) or of each shard and after each end of
  /// text: where the validation split may cut. 8 bytes a document, the one part held.
  std::vector<int64_t> starts;
  /// SHA-256 of the ids (as uint32) and the starts (as int64).
  std::string sha256;
};

/// Reads the token files in order, a chunk at a time, passing their ids to `sink` (if
/// any): a .bin with a .idx beside it (or a .idx, for its .bin) is a Megatron indexed
/// dataset; a .bin opening with llm.c's header (magic 20240520 for uint16 ids, 20240801
/// for uint32) is llm.c's; any other file is nanoGPT's raw uint16 ids. Every id must be
/// below `vocab_size`; `eos_id` (or -1) marks where documents end.
TokenStream read_token_files(const std::vector<std::string>& files, int vocab_size, int eos_id,
                             const TokenSink& sink = {});

}  // namespace remat::data
