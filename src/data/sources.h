// What a corpus is made from, read from the user's files (data.text, data.format): the
// files a glob names, the documents of text or JSONL files, and token ids already encoded
// (llm.c's and nanoGPT's .bin shards, Megatron's indexed dataset). Every file is read in
// chunks, refused when it is not a regular file, and refused with a sentence naming the file
// and the line or byte offset where it stops making sense.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/config.h"

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
};

/// Each text file is a document (format text); each JSONL record's `field` is one (format
/// jsonl). Documents are UTF-8 without NUL bytes and with lines of at most 1 MiB, as a text
/// file must be (read_utf8_file), and all together at most 1 GiB.
Documents read_documents(const std::vector<std::string>& files, DataFormat format, const std::string& field);

/// Token ids read from shards, and where documents start in them.
struct TokenStream {
  std::vector<int32_t> ids;
  /// The first token of each document (Megatron's) or of each shard and after each end of
  /// text: where the validation split may cut.
  std::vector<int64_t> starts;
  /// SHA-256 of the ids (as uint32) and the starts (as int64).
  std::string sha256() const;
};

/// Reads the token files in order: a .bin with a .idx beside it (or a .idx, for its .bin)
/// is a Megatron indexed dataset; a .bin opening with llm.c's header (magic 20240520 for
/// uint16 ids, 20240801 for uint32) is llm.c's; any other file is nanoGPT's raw uint16 ids.
/// Every id must be below `vocab_size`; `eos_id` (or -1) marks where documents end. At most
/// 2^28 tokens in all, since a corpus is held in memory while it trains.
TokenStream read_token_files(const std::vector<std::string>& files, int vocab_size, int eos_id);

}  // namespace remat::data
