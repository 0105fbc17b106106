// The readers of the user's files (src/data/sources.h): globs, text and JSONL documents,
// llm.c's, nanoGPT's and Megatron's token files, and the sentences that refuse each kind
// of damage, held to files written here byte by byte as those projects write them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "data/sources.h"
#include "util/error_of.h"
#include "util/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using namespace remat::data;
using remat::DataFormat;
using remat::testing::TempDir;

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::runtime_error>(f); }

template <class T>
std::string bytes_of(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// llm.c's shard: 256 int32 of header (magic, version, count), then the ids.
template <class T>
std::string llmc_shard(const std::vector<T>& ids) {
  std::vector<int32_t> header(256, 0);
  header[0] = sizeof(T) == 2 ? 20240520 : 20240801;
  header[1] = sizeof(T) == 2 ? 1 : 7;
  header[2] = static_cast<int32_t>(ids.size());
  return bytes_of(header) + bytes_of(ids);
}

// Megatron's indexed dataset of `docs`, each one sequence, the ids as uint16 (dtype code 8).
void write_megatron(const std::string& prefix, const std::vector<std::vector<uint16_t>>& docs) {
  std::string bin;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers, doc_index = {0};
  for (const auto& doc : docs) {
    pointers.push_back(static_cast<int64_t>(bin.size()));
    lengths.push_back(static_cast<int32_t>(doc.size()));
    bin += bytes_of(doc);
    doc_index.push_back(static_cast<int64_t>(lengths.size()));
  }
  std::string idx("MMIDIDX\0\0", 9);
  const uint64_t version = 1, sequences = lengths.size(), documents = doc_index.size();
  idx += std::string(reinterpret_cast<const char*>(&version), 8) + std::string(1, '\x08') +
         std::string(reinterpret_cast<const char*>(&sequences), 8) +
         std::string(reinterpret_cast<const char*>(&documents), 8);
  idx += bytes_of(lengths) + bytes_of(pointers) + bytes_of(doc_index);
  write(prefix + ".bin", bin);
  write(prefix + ".idx", idx);
}

// What read_token_files finds, and the ids it passes on.
std::pair<TokenStream, std::vector<int32_t>> read_ids(const std::vector<std::string>& files, int vocab, int eos) {
  std::vector<int32_t> ids;
  TokenStream s =
      read_token_files(files, vocab, eos, [&](const int32_t* p, size_t n) { ids.insert(ids.end(), p, p + n); });
  return {std::move(s), std::move(ids)};
}

TEST(Sources, AGlobNamesItsMatchesInByteOrder) {
  TempDir dir;
  for (const char* name : {"b.jsonl", "a.jsonl", "B.jsonl", "c.txt"}) write(dir / name, "{}\n");
  EXPECT_EQ(expand_files(dir / "*.jsonl"),
            (std::vector<std::string>{dir / "B.jsonl", dir / "a.jsonl", dir / "b.jsonl"}));
  EXPECT_EQ(expand_files(dir / "missing.txt"), std::vector<std::string>{dir / "missing.txt"});
  EXPECT_EQ(error_of([&] { expand_files(dir / "*.bin"); }),
            "No file matches data.text = '" + (dir / "*.bin").string() +
                "'; give a path, or a glob such as data/shards/*.jsonl.");
}

TEST(Sources, ReadsJsonlRecordsAsDocuments) {
  TempDir dir;
  write(dir / "a.jsonl",
        "{\"text\": \"first\\ndocument\", \"id\": 1}\n"
        "\n"
        "{\"id\": 2, \"text\": \"\"}\n"
        "  {\"text\": \"caf\\u00e9 \\ud83d\\ude42\"}\r\n");
  write(dir / "b.jsonl", "{\"body\": 3, \"text\": \"last, no line break\"}");
  const Documents docs = read_documents(expand_files(dir / "*.jsonl"), DataFormat::jsonl, "text");
  ASSERT_EQ(docs.spans.size(), 3u);
  EXPECT_EQ(docs.document(0), "first\ndocument");
  EXPECT_EQ(docs.document(1), "caf\xC3\xA9 \xF0\x9F\x99\x82");
  EXPECT_EQ(docs.document(2), "last, no line break");
  EXPECT_EQ(docs.empty_records, 1);
  EXPECT_EQ(docs.bytes(), 14 + 10 + 19);
  EXPECT_EQ(docs.text, "first\ndocument\ncaf\xC3\xA9 \xF0\x9F\x99\x82\nlast, no line break\n");

  write(dir / "other.jsonl", "{\"content\": \"x\"}\n");
  EXPECT_EQ(read_documents({dir / "other.jsonl"}, DataFormat::jsonl, "content").document(0), "x");
}

TEST(Sources, TextFilesAreOneDocumentEach) {
  TempDir dir;
  write(dir / "1.txt", "one\n");
  write(dir / "2.txt", "two");
  const Documents docs = read_documents({dir / "1.txt", dir / "2.txt"}, DataFormat::text, "text");
  ASSERT_EQ(docs.spans.size(), 2u);
  EXPECT_EQ(docs.document(0), "one\n");
  EXPECT_EQ(docs.document(1), "two");
  // The hash covers where documents end, not only their bytes.
  write(dir / "3.txt", "one");
  write(dir / "4.txt", "\ntwo");
  EXPECT_NE(read_documents({dir / "3.txt", dir / "4.txt"}, DataFormat::text, "text").sha256(), docs.sha256());
  EXPECT_EQ(read_documents({dir / "1.txt", dir / "2.txt"}, DataFormat::text, "text").sha256(), docs.sha256());
}

TEST(Sources, RefusesMalformedJsonlNamingTheLine) {
  TempDir dir;
  const std::string path = dir / "bad.jsonl";
  auto refusal = [&](const std::string& records, const std::string& field = "text") {
    write(path, records);
    return error_of([&] { read_documents({path}, DataFormat::jsonl, field); });
  };
  const std::string line2 = "line 2 of the JSONL file " + path;
  EXPECT_EQ(refusal("{\"text\": \"ok\"}\n{\"id\": 7, \"title\": \"t\"}\n"),
            "Line 2 of the JSONL file " + path +
                " has no field \"text\" (its fields: id, title); set data.field to the one holding the text.");
  EXPECT_EQ(refusal("{\"text\": \"ok\"}\n{\"text\": [1, 2]}\n"),
            "The field \"text\" of " + line2 + " is a JSON array, not a string of text.");
  EXPECT_EQ(refusal("{\"text\": \"ok\"}\n[\"text\"]\n"),
            "Line 2 of the JSONL file " + path + " is a JSON array, not an object.");
  EXPECT_EQ(refusal("{\"text\": \"ok\"}\n{\"text\": \"NUL\\u0000\"}\n"),
            "The field \"text\" of " + line2 +
                " holds a NUL byte at offset 3: it is binary data, not text; give "
                "UTF-8 text.");
  std::string error = refusal("{\"text\": \"ok\"}\n{\"text\": \"cut\n");
  EXPECT_EQ(
      error.rfind("Line 2 of the JSONL file " + path + " is not JSON remat reads ([json.exception.parse_error", 0), 0u)
      << error;
  // nlohmann's parser throws another kind of exception for a number beyond a double's range.
  error = refusal("{\"text\": \"ok\", \"n\": 68E8328}\n");
  EXPECT_EQ(
      error.rfind("Line 1 of the JSONL file " + path + " is not JSON remat reads ([json.exception.out_of_range", 0), 0u)
      << error;
  error = refusal("{\"text\": \"Latin-1: caf\xE9\"}\n");
  EXPECT_EQ(error.rfind("Line 1 of the JSONL file " + path + " is not JSON", 0), 0u) << error;
  EXPECT_EQ(refusal("\n{\"text\": \"\"}\n"),
            "The JSONL file " + path +
                " holds no document: every line is blank or its field \"text\" is empty; give "
                "records with text.");
  EXPECT_EQ(refusal("{\"text\": \"" + std::string(size_t{1} << 20, 'x') + "x\"}\n"),
            "Line 1 of the field \"text\" of line 1 of the JSONL file " + path +
                " is 1048577 bytes long, more than the 1 MiB remat tokenizes at once; break the text into lines "
                "(paragraphs).");
}

// Documents pass a batch at a time, whole, and hash as when read at once.
TEST(Sources, DocumentsPassInBatchesOfWholeDocuments) {
  TempDir dir;
  std::string jsonl;
  for (int d = 0; d < 50; ++d)
    jsonl += "{\"text\": \"" + std::string(static_cast<size_t>(10 + d), static_cast<char>('a' + d % 26)) + "\"}\n";
  write(dir / "a.jsonl", jsonl + "{\"text\": \"\"}\n");
  write(dir / "b.jsonl", jsonl);
  const std::vector<std::string> files = expand_files(dir / "*.jsonl");
  const Documents whole = read_documents(files, DataFormat::jsonl, "text");
  std::vector<std::string> seen;
  std::vector<size_t> sizes;
  const DocumentsRead read = for_each_document_batch(files, DataFormat::jsonl, "text", 200, [&](const Documents& b) {
    sizes.push_back(b.text.size());
    for (size_t i = 0; i < b.spans.size(); ++i) seen.emplace_back(b.document(i));
  });
  ASSERT_EQ(seen.size(), whole.spans.size());
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], whole.document(i));
  EXPECT_EQ(read.sha256, whole.sha256());
  EXPECT_EQ(read.documents, 100);
  EXPECT_EQ(read.bytes, whole.bytes());
  EXPECT_EQ(read.empty_records, 1);
  EXPECT_GT(sizes.size(), 10u);
  for (size_t i = 0; i + 1 < sizes.size(); ++i) EXPECT_GE(sizes[i], 200u);
}

TEST(Sources, ReadsLlmcNanoGptAndMegatronTokenFiles) {
  TempDir dir;
  constexpr int kVocab = 300, kEos = 299;
  write(dir / "a_000.bin", llmc_shard<uint16_t>({kEos, 5, 6, kEos, 7}));
  write(dir / "a_001.bin", llmc_shard<uint32_t>({kEos, 8}));
  const auto [llmc, llmc_ids] = read_ids(expand_files(dir / "a_*.bin"), kVocab, kEos);
  EXPECT_EQ(llmc_ids, (std::vector<int32_t>{kEos, 5, 6, kEos, 7, kEos, 8}));
  EXPECT_EQ(llmc.count, 7);
  // A shard's start and each position after an end of text: where the split may cut.
  EXPECT_EQ(llmc.starts, (std::vector<int64_t>{0, 1, 4, 5, 6}));

  write(dir / "nanogpt.bin", bytes_of(std::vector<uint16_t>{1, 2, kEos, 3}));
  const auto [raw, raw_ids] = read_ids({dir / "nanogpt.bin"}, kVocab, kEos);
  EXPECT_EQ(raw_ids, (std::vector<int32_t>{1, 2, kEos, 3}));
  EXPECT_EQ(raw.starts, (std::vector<int64_t>{0, 3}));

  write_megatron(dir / "m_text_document", {{10, 11, kEos}, {12, kEos}, {}, {13}});
  // Both halves of the dataset matched by one glob are read once.
  const auto [megatron, megatron_ids] = read_ids(expand_files(dir / "m_text_document.*"), kVocab, kEos);
  EXPECT_EQ(megatron_ids, (std::vector<int32_t>{10, 11, kEos, 12, kEos, 13}));
  EXPECT_EQ(megatron.starts, (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(read_ids({dir / "m_text_document.idx"}, kVocab, kEos).second, megatron_ids);
  // The digest is of the ids and the starts, the same without a sink.
  EXPECT_EQ(read_token_files({dir / "m_text_document.idx"}, kVocab, kEos).sha256, megatron.sha256);
  EXPECT_NE(megatron.sha256, raw.sha256);
}

// Shards far larger than a read's chunk pass through in chunks, every id once and in order.
TEST(Sources, ReadsTokenFilesAChunkAtATime) {
  TempDir dir;
  constexpr int kVocab = 1000;
  std::vector<uint16_t> ids(1500000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint16_t>((i * 7919) % kVocab);
  write(dir / "big.bin", bytes_of(ids));
  size_t chunks = 0, largest = 0;
  std::vector<int32_t> seen;
  const TokenStream s = read_token_files({dir / "big.bin"}, kVocab, -1, [&](const int32_t* p, size_t n) {
    ++chunks;
    largest = std::max(largest, n);
    seen.insert(seen.end(), p, p + n);
  });
  EXPECT_EQ(s.count, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(seen, std::vector<int32_t>(ids.begin(), ids.end()));
  EXPECT_EQ(chunks, 3u);  // 1 MiB reads of 2-byte ids
  EXPECT_EQ(largest, size_t{1} << 19);
}

TEST(Sources, RefusesDamagedTokenFilesNamingTheFileAndOffset) {
  TempDir dir;
  const std::string shard = dir / "shard.bin";
  auto refusal = [&](const std::string& bytes) {
    write(shard, bytes);
    return error_of([&] { read_token_files({shard}, 300, 299); });
  };
  const std::string whole = llmc_shard<uint16_t>({1, 2, 3});
  EXPECT_EQ(refusal(whole.substr(0, whole.size() - 1)),
            "The token file " + shard +
                " is an llm.c shard whose header records 3 tokens of 2 bytes, but 5 bytes "
                "follow the header: it is cut short; write it again.");
  EXPECT_EQ(refusal(whole + "xx"), "The token file " + shard +
                                       " is an llm.c shard whose header records 3 tokens of 2 bytes, but 8 bytes "
                                       "follow the header: it is followed by other bytes; write it again.");
  EXPECT_EQ(refusal(llmc_shard<uint16_t>({1, 300, 3})),
            "The token file " + shard +
                " holds id 300 at byte offset 1026, outside the tokenizer's 300-piece "
                "vocabulary: it was written with another tokenizer, or is damaged; set "
                "data.tokenizer to the one that wrote it.");
  std::string other_version = whole;
  other_version[4] = 2;
  EXPECT_EQ(refusal(other_version), "The token file " + shard +
                                        " opens with llm.c's magic 20240520 but version 2; remat reads version 1 of "
                                        "that magic (uint16 ids).");
  EXPECT_EQ(refusal("abc"), "The token file " + shard +
                                " holds 3 bytes and no llm.c header, so it would be nanoGPT's uint16 ids, but that "
                                "takes a positive even number of bytes: it is not a token shard.");

  const std::string prefix = dir / "m";
  write_megatron(prefix, {{1, 2}, {3}});
  std::ifstream in(prefix + ".idx", std::ios::binary);
  const std::string idx((std::istreambuf_iterator<char>(in)), {});
  write(prefix + ".idx", idx.substr(0, idx.size() - 8));
  EXPECT_EQ(error_of([&] { read_token_files({prefix + ".bin"}, 300, 299); }),
            "The index file " + prefix +
                ".idx records 2 sequences and 3 document boundaries, which take 82 bytes, "
                "but it holds 74: it is damaged; write the dataset again.");
  write(prefix + ".idx", idx);
  write(prefix + ".bin", std::string(4, '\0'));  // the second sequence's 2 bytes are gone
  EXPECT_EQ(error_of([&] { read_token_files({prefix + ".bin"}, 300, 299); }),
            "The index file " + prefix + ".idx places sequence 1 at byte 4 of " + prefix +
                ".bin, 1 tokens of 2 bytes long, outside the 4 bytes that file holds: the two do not belong together, "
                "or one is damaged.");
  write(prefix + ".idx", "MMIDIDY" + idx.substr(7));
  EXPECT_EQ(error_of([&] { read_token_files({prefix + ".bin"}, 300, 299); }),
            "The index file " + prefix +
                ".idx does not open with Megatron's MMIDIDX header: it is not an indexed "
                "dataset's index.");
}

}  // namespace
