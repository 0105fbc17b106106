// Feeds `remat prepare`'s inputs up to the tokenizer: read_utf8_file (the checks on a
// --text file: NUL bytes, whitespace only, line length, UTF-8), util::find_invalid_utf8, and
// the same bytes as a JSONL file (read_documents, and for_each_document_batch in batches) and
// as a token shard (read_token_files). The SentencePiece steps after it are the tokenizer
// harness's (fuzz/tokenizer.cpp): the shim is dlopen'ed with RTLD_DEEPBIND, which
// AddressSanitizer's runtime refuses.
// A finding: anything but a std::runtime_error sentence out of the readers (a crash, a
// sanitizer report, a hang), a text it accepts that is not the file's bytes, a document
// empty or not UTF-8, documents read in batches that differ from those read at once, an id
// outside the vocabulary or a count other than the ids passed on, or
// find_invalid_utf8 disagreeing with the decoder below, written the other way round: it
// decodes a code point first, then refuses overlong forms, surrogates and values above U+10FFFF.
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "harness.h"
#include "data/sources.h"
#include "remat/data.h"
#include "util/utf8.h"

namespace {

// The offset of the first ill-formed sequence, or npos: code points decoded, then range-checked.
size_t reference_invalid_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t length = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
    if (length == 0 || i + length > text.size()) return i;
    uint32_t cp = length == 1 ? lead : lead & (0x7F >> length);
    for (size_t k = 1; k < length; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (b & 0x3F);
    }
    const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += length;
  }
  return std::string_view::npos;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t got = remat::util::find_invalid_utf8(bytes), want = reference_invalid_utf8(bytes);
  if (got != want) {
    remat::fuzz::finding("find_invalid_utf8 says " + std::to_string(got) + ", the reference decoder " +
                         std::to_string(want));
  }
  const remat::fuzz::TempFile file(remat::fuzz::temp_path("prepare"), data, size);
  try {
    const std::string text = remat::data::read_utf8_file(file.path());
    if (text != bytes) remat::fuzz::finding("read_utf8_file returned other bytes than the file holds");
  } catch (const std::runtime_error&) {
  }
  // The same bytes as JSONL records and as token shards (GPT-2's vocabulary and end of text).
  try {
    const auto docs = remat::data::read_documents({file.path()}, remat::DataFormat::jsonl, "text");
    for (size_t i = 0; i < docs.spans.size(); ++i) {
      if (docs.document(i).empty() || remat::util::find_invalid_utf8(docs.document(i)) != std::string_view::npos) {
        remat::fuzz::finding("read_documents accepted an empty or invalid document");
      }
    }
    // Read in batches of a few bytes, they are the same documents with the same digest.
    size_t passed = 0;
    const auto read = remat::data::for_each_document_batch(
        {file.path()}, remat::DataFormat::jsonl, "text", 16,
        [&](const remat::data::Documents& batch) { passed += batch.spans.size(); });
    if (read.sha256 != docs.sha256() || passed != docs.spans.size()) {
      remat::fuzz::finding("for_each_document_batch read other documents than read_documents");
    }
  } catch (const std::runtime_error&) {
  }
  try {
    constexpr int kVocab = 50257;
    int64_t passed = 0;
    const auto tokens =
        remat::data::read_token_files({file.path()}, kVocab, kVocab - 1, [&](const int32_t* ids, size_t n) {
          for (size_t i = 0; i < n; ++i) {
            if (ids[i] < 0 || ids[i] >= kVocab) {
              remat::fuzz::finding("read_token_files accepted id " + std::to_string(ids[i]));
            }
          }
          passed += static_cast<int64_t>(n);
        });
    if (passed != tokens.count) remat::fuzz::finding("read_token_files counted other ids than it passed on");
  } catch (const std::runtime_error&) {
  }
  return 0;
}
