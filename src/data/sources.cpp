#include "sources.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "remat/data.h"
#include "util/sha256.h"
#include "util/utf8.h"

namespace remat::data {

namespace fs = std::filesystem;

namespace {

// Limits on text: far above any corpus a model here trains on. A tokenizer's time grows
// faster than a line's length (a 50 MB line takes minutes and gigabytes); real text breaks
// far sooner.
constexpr size_t kMaxTextBytes = size_t{1} << 30;
constexpr size_t kMaxLineBytes = size_t{1} << 20;
constexpr size_t kChunk = size_t{1} << 20;

constexpr int32_t kLlmcMagic16 = 20240520, kLlmcMagic32 = 20240801;
constexpr int32_t kLlmcVersion16 = 1, kLlmcVersion32 = 7;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;
constexpr char kMegatronMagic[] = "MMIDIDX\0\0";
constexpr int64_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

// A regular file opened for reading; anything else is refused before a read can wait on it
// (O_NONBLOCK: a FIFO with no writer) or run for ever (a device).
class InputFile {
 public:
  InputFile(const std::string& path, const std::string& what) : path_(path), what_(what) {
    std::error_code ec;
    const auto status = fs::status(path, ec);
    if (!fs::exists(status)) fail("The " + what + " " + path + " does not exist.");
    if (fs::is_directory(status)) fail(path + " is a directory, not a " + what + ".");
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0) fail("Cannot open the " + what + " " + path + ": " + std::strerror(errno) + ".");
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      fail("The " + what + " " + path +
           " is not a regular file (a FIFO, device or socket); remat reads its inputs only from regular files, which "
           "cannot make it wait or read for ever: give a file.");
    }
    size_ = static_cast<int64_t>(st.st_size);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Up to `n` bytes from `offset`; fewer only at the file's end.
  size_t read_at(int64_t offset, void* out, size_t n) const {
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, static_cast<char*>(out) + done, n - done, offset + static_cast<int64_t>(done));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail("Cannot read the " + what_ + " " + path_ + ": " + std::strerror(errno) + ".");
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }
  // Exactly `n` bytes from `offset`, or an error saying where the file ends.
  void read_exactly(int64_t offset, void* out, size_t n, const std::string& part) const {
    if (read_at(offset, out, n) != n) {
      fail(fmt::format("The {} {} ends at byte {}, inside its {} (bytes {} to {}): it is cut short; write it again.",
                       what_, path_, size_, part, offset, offset + static_cast<int64_t>(n)));
    }
  }

 private:
  std::string path_, what_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// A read buffer for `bytes`: a chunk at most, so that memory stays bounded, and no more
// than a small file needs (a fresh megabyte per file costs its page faults).
size_t chunk_for(int64_t bytes) { return static_cast<size_t>(std::clamp<int64_t>(bytes, 8, kChunk)); }

bool is_glob(const std::string& pattern) { return pattern.find_first_of("*?[") != std::string::npos; }

std::string capitalized(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

// The checks a text must pass to be tokenized, for `where` ("the text file F", "the field
// "text" of line 3 of the JSONL file F").
void check_text(std::string_view text, const std::string& where) {
  const size_t nul = text.find('\0');
  if (nul != std::string_view::npos) {
    fail(fmt::format("{} holds a NUL byte at offset {}: it is binary data, not text; give UTF-8 text.",
                     capitalized(where), nul));
  }
  size_t line_start = 0, line = 1;
  while (line_start < text.size()) {
    const size_t end = std::min(text.find('\n', line_start), text.size());
    if (end - line_start > kMaxLineBytes) {
      fail(
          fmt::format("Line {} of {} is {} bytes long, more than the {} MiB remat tokenizes at once; break the text "
                      "into lines (paragraphs).",
                      line, where, end - line_start, kMaxLineBytes >> 20));
    }
    line_start = end + 1;
    ++line;
  }
  const size_t bad = util::find_invalid_utf8(text);
  if (bad != std::string_view::npos) {
    fail(fmt::format("{} is not valid UTF-8: the sequence at byte offset {} (starting 0x{:02X}) is invalid.",
                     capitalized(where), bad, static_cast<unsigned char>(text[bad])));
  }
}

// Appends `file`'s bytes to `out`, refusing the file at its first NUL byte or where `out`
// would pass the size limit (so an endless or binary file costs no more than that).
void append_file(const InputFile& file, std::string& out) {
  const size_t start = out.size();
  std::vector<char> chunk(chunk_for(file.size()));
  int64_t offset = 0;
  for (size_t n; (n = file.read_at(offset, chunk.data(), chunk.size())) > 0; offset += static_cast<int64_t>(n)) {
    const void* nul = std::memchr(chunk.data(), '\0', n);
    if (nul != nullptr) {
      fail(
          fmt::format("The text file {} holds a NUL byte at offset {}: it is binary data, not text; give a UTF-8 "
                      "text file.",
                      file.path(), offset + (static_cast<const char*>(nul) - chunk.data())));
    }
    if (out.size() + n > kMaxTextBytes) {
      fail(fmt::format("The text file{} {} {} larger than the {} GiB remat prepares; give a part of {}.",
                       start == 0 ? "" : "s up to", file.path(), start == 0 ? "is" : "are", kMaxTextBytes >> 30,
                       start == 0 ? "it" : "them"));
    }
    out.append(chunk.data(), n);
  }
  if (out.size() == start) fail("The text file " + file.path() + " is empty.");
}

// Called with the documents read so far after each one is added.
using DocumentHook = std::function<void(Documents&)>;

// The documents read up to `where` pass what remat holds at once: only where it trains a
// tokenizer on them, since with a given one they are encoded a batch at a time.
[[noreturn]] void too_large(const std::string& where) {
  fail(fmt::format(
      "The documents read up to {} are larger than the {} GiB remat holds at once to train a tokenizer on them; give "
      "data.tokenizer (with a tokenizer given, documents of any size are encoded a batch at a time), or a part of "
      "them.",
      where, kMaxTextBytes >> 30));
}

// Calls `record(line, number)` for each line of a JSONL file, read a chunk at a time; a
// line longer than the text limit is refused before it is held whole.
template <class F>
void for_each_line(const InputFile& file, F&& record) {
  std::string line;
  std::vector<char> chunk(chunk_for(file.size()));
  int64_t offset = 0, number = 1;
  for (size_t n; (n = file.read_at(offset, chunk.data(), chunk.size())) > 0; offset += static_cast<int64_t>(n)) {
    for (size_t pos = 0; pos < n;) {
      const char* newline = static_cast<const char*>(std::memchr(chunk.data() + pos, '\n', n - pos));
      const size_t end = newline ? static_cast<size_t>(newline - chunk.data()) : n;
      if (line.size() + (end - pos) > kMaxTextBytes) {
        fail(
            fmt::format("Line {} of the JSONL file {} is longer than the {} GiB remat prepares; give documents "
                        "of a sane size.",
                        number, file.path(), kMaxTextBytes >> 30));
      }
      line.append(chunk.data() + pos, end - pos);
      pos = end;
      if (newline) {
        record(line, number++);
        line.clear();
        ++pos;
      }
    }
  }
  if (!line.empty()) record(line, number);
}

void read_jsonl(const InputFile& file, const std::string& field, Documents& docs, const DocumentHook& added) {
  using nlohmann::json;
  for_each_line(file, [&](const std::string& line, int64_t number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) return;
    const std::string where = fmt::format("line {} of the JSONL file {}", number, file.path());
    json record;
    try {
      record = json::parse(line);
    } catch (const json::exception& e) {  // a syntax error, or a number beyond a double's range
      fail(fmt::format("{} is not JSON remat reads ({}); each line must hold one JSON object.", capitalized(where),
                       util::printable(e.what())));
    }
    if (!record.is_object())
      fail(fmt::format("{} is a JSON {}, not an object.", capitalized(where), record.type_name()));
    const auto it = record.find(field);
    if (it == record.end()) {
      std::vector<std::string> fields;
      for (const auto& [name, value] : record.items()) fields.push_back(util::printable(name, 40));
      fail(fmt::format("{} has no field \"{}\" (its fields: {}); set data.field to the one holding the text.",
                       capitalized(where), util::printable(field), fmt::join(fields, ", ")));
    }
    if (!it->is_string()) {
      fail(fmt::format("The field \"{}\" of {} is a JSON {}, not a string of text.", util::printable(field), where,
                       it->type_name()));
    }
    const auto& text = it->get_ref<const std::string&>();
    if (text.empty()) {
      ++docs.empty_records;
      return;
    }
    check_text(text, fmt::format("the field \"{}\" of {}", util::printable(field), where));
    if (docs.text.size() + text.size() + 1 > kMaxTextBytes) too_large(where);
    docs.spans.push_back({docs.text.size(), text.size()});
    docs.text += text;
    docs.text += '\n';
    if (added) added(docs);
  });
}

// The token files' ids as they are read: counted, hashed and passed on a chunk at a time.
struct TokenReader {
  TokenReader(int vocab, const TokenSink& to) : vocab_size(vocab), sink(to) {}
  int vocab_size;
  const TokenSink& sink;
  TokenStream out;
  util::Sha256 hash;
  std::vector<char> bytes;
  std::vector<int32_t> ids;

  // Reads the ids of `count` tokens of `width` bytes at `offset` of `file`, each checked
  // against the vocabulary; `eos_id` marks document starts.
  void read(const InputFile& file, int64_t offset, int64_t count, int width, int eos_id) {
    bytes.resize(chunk_for(count * width));
    const int64_t per_chunk = static_cast<int64_t>(bytes.size()) / width;
    for (int64_t done = 0; done < count;) {
      const int64_t n = std::min(per_chunk, count - done);
      const int64_t at = offset + done * width;
      file.read_exactly(at, bytes.data(), static_cast<size_t>(n * width), "token ids");
      ids.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        uint32_t id = 0;
        std::memcpy(&id, bytes.data() + i * width, static_cast<size_t>(width));  // little-endian, as in corpus.cpp
        if (id >= static_cast<uint32_t>(vocab_size)) {
          fail(
              fmt::format("The token file {} holds id {} at byte offset {}, outside the tokenizer's {}-piece "
                          "vocabulary: it was written with another tokenizer, or is damaged; set data.tokenizer to "
                          "the one that wrote it.",
                          file.path(), id, at + i * width, vocab_size));
        }
        ids[static_cast<size_t>(i)] = static_cast<int32_t>(id);
        if (static_cast<int>(id) == eos_id) out.starts.push_back(out.count + i + 1);
      }
      hash.update(ids.data(), ids.size() * sizeof(int32_t));
      if (sink) sink(ids.data(), ids.size());
      out.count += n;
      done += n;
    }
  }
};

// llm.c's shard: 256 int32 (magic, version, token count, zeros), then the ids.
bool read_llmc(const InputFile& file, int eos_id, TokenReader& reader) {
  int32_t header[256] = {};
  if (file.size() < kLlmcHeaderBytes) return false;
  file.read_exactly(0, header, sizeof(header), "header");
  if (header[0] != kLlmcMagic16 && header[0] != kLlmcMagic32) return false;
  const int width = header[0] == kLlmcMagic16 ? 2 : 4;
  const int32_t version = width == 2 ? kLlmcVersion16 : kLlmcVersion32;
  if (header[1] != version) {
    fail(
        fmt::format("The token file {} opens with llm.c's magic {} but version {}; remat reads version {} of that "
                    "magic ({} ids).",
                    file.path(), header[0], header[1], version, width == 2 ? "uint16" : "uint32"));
  }
  const int64_t count = header[2], held = file.size() - kLlmcHeaderBytes;
  if (count < 0 || held != count * width) {
    fail(
        fmt::format("The token file {} is an llm.c shard whose header records {} tokens of {} bytes, but {} bytes "
                    "follow the header: it is {}; write it again.",
                    file.path(), count, width, held, held < count * width ? "cut short" : "followed by other bytes"));
  }
  reader.read(file, kLlmcHeaderBytes, count, width, eos_id);
  return true;
}

// Megatron's indexed dataset: the .idx's header, sequence lengths (int32), sequence byte
// offsets into the .bin (int64) and document boundaries (int64 sequence indices).
void read_megatron(const std::string& prefix, TokenReader& reader) {
  const InputFile idx(prefix + ".idx", "index file");
  const InputFile bin(prefix + ".bin", "token file");
  char magic[9];
  idx.read_exactly(0, magic, sizeof(magic), "header");
  if (std::memcmp(magic, kMegatronMagic, sizeof(magic)) != 0) {
    fail(
        fmt::format("The index file {} does not open with Megatron's MMIDIDX header: it is not an indexed "
                    "dataset's index.",
                    idx.path()));
  }
  uint64_t version = 0, sequences = 0, documents = 0;
  uint8_t code = 0;
  idx.read_exactly(9, &version, 8, "header");
  idx.read_exactly(17, &code, 1, "header");
  idx.read_exactly(18, &sequences, 8, "header");
  idx.read_exactly(26, &documents, 8, "header");
  if (version != 1) fail(fmt::format("The index file {} is version {}; remat reads version 1.", idx.path(), version));
  // Megatron's dtype codes: 1 uint8, 3 int16, 4 int32, 5 int64, 8 uint16 (6, 7 are floats).
  const int width = code == 1 ? 1 : code == 3 || code == 8 ? 2 : code == 4 ? 4 : code == 5 ? 8 : 0;
  if (width == 0 || code == 2) {
    fail(
        fmt::format("The index file {} records dtype code {}, which holds no token ids (remat reads 1 uint8, 3 "
                    "int16, 4 int32, 5 int64 and 8 uint16).",
                    idx.path(), code));
  }
  const uint64_t limit = static_cast<uint64_t>(idx.size());
  const uint64_t expected = kMegatronHeaderBytes + (4 + 8) * sequences + 8 * documents;
  if (sequences > limit || documents > limit || documents == 0 || expected != limit) {
    fail(fmt::format(
        "The index file {} records {} sequences and {} document boundaries, which take {} bytes, but "
        "it holds {}: it is damaged{}; write the dataset again.",
        idx.path(), sequences, documents, expected, limit,
        sequences <= limit && expected + sequences == limit ? " (or multimodal, which remat does not read)" : ""));
  }
  std::vector<int32_t> lengths(sequences);
  std::vector<int64_t> pointers(sequences), doc_index(documents);
  idx.read_exactly(kMegatronHeaderBytes, lengths.data(), 4 * sequences, "sequence lengths");
  idx.read_exactly(kMegatronHeaderBytes + 4 * static_cast<int64_t>(sequences), pointers.data(), 8 * sequences,
                   "sequence offsets");
  idx.read_exactly(kMegatronHeaderBytes + 12 * static_cast<int64_t>(sequences), doc_index.data(), 8 * documents,
                   "document boundaries");
  for (size_t d = 0; d < documents; ++d) {
    const bool ordered = doc_index[d] >= (d == 0 ? 0 : doc_index[d - 1]) && doc_index[d] <= int64_t(sequences);
    if (!ordered || (d == 0 && doc_index[0] != 0) || (d + 1 == documents && doc_index[d] != int64_t(sequences))) {
      fail(fmt::format(
          "The index file {} has document boundary {} = {} (byte offset {}), out of order or outside "
          "its {} sequences: it is damaged; write the dataset again.",
          idx.path(), d, doc_index[d], kMegatronHeaderBytes + 12 * int64_t(sequences) + 8 * int64_t(d), sequences));
    }
  }
  size_t next_doc = 0;
  for (size_t s = 0; s < sequences; ++s) {
    while (next_doc < documents && doc_index[next_doc] == int64_t(s)) {
      reader.out.starts.push_back(reader.out.count);
      ++next_doc;
    }
    const int64_t length = lengths[s], at = pointers[s];
    if (length < 0 || at < 0 || at % width != 0 || at > bin.size() || length > (bin.size() - at) / width) {
      fail(
          fmt::format("The index file {} places sequence {} at byte {} of {}, {} tokens of {} bytes long, outside "
                      "the {} bytes that file holds: the two do not belong together, or one is damaged.",
                      idx.path(), s, at, bin.path(), length, width, bin.size()));
    }
    // Megatron's documents end with the end-of-text token where it was asked to append one;
    // remat takes the ids as written.
    reader.read(bin, at, length, width, -1);
  }
}

std::string strip(const std::string& path, const char* suffix) {
  return path.substr(0, path.size() - std::strlen(suffix));
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

std::vector<std::string> expand_files(const std::string& pattern) {
  if (!is_glob(pattern)) return {pattern};
  glob_t matches{};
  const int status = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &matches);
  std::vector<std::string> files;
  for (size_t i = 0; status == 0 && i < matches.gl_pathc; ++i) files.emplace_back(matches.gl_pathv[i]);
  ::globfree(&matches);
  if (status == GLOB_NOMATCH || (status == 0 && files.empty())) {
    fail("No file matches data.text = '" + util::printable(pattern) +
         "'; give a path, or a glob such as "
         "data/shards/*.jsonl.");
  }
  if (status != 0) fail("Cannot list the files data.text = '" + util::printable(pattern) + "' names.");
  std::sort(files.begin(), files.end());  // the locale's collation may differ between machines
  return files;
}

int64_t Documents::bytes() const {
  int64_t total = 0;
  for (const Span& s : spans) total += static_cast<int64_t>(s.size);
  return total;
}

void Documents::hash_into(util::Sha256& h) const {
  for (size_t i = 0; i < spans.size(); ++i) {
    const uint64_t size = spans[i].size;
    h.update(&size, sizeof(size));
    h.update(document(i));
  }
}

std::string Documents::sha256() const {
  util::Sha256 h;
  hash_into(h);
  return h.hex_digest();
}

std::string read_utf8_file(const std::string& path) {
  const InputFile file(path, "text file");
  std::string text;
  append_file(file, text);
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    fail("The text file " + path + " holds only whitespace; there is no text to train on.");
  }
  check_text(text, "the text file " + path);
  return text;
}

namespace {

// Reads the documents of `files` into `docs`, calling `added` (if any) after each one.
void read_documents_into(const std::vector<std::string>& files, DataFormat format, const std::string& field,
                         Documents& docs, const DocumentHook& added) {
  for (const std::string& path : files) {
    if (format == DataFormat::jsonl) {
      read_jsonl(InputFile(path, "JSONL file"), field, docs, added);
      continue;
    }
    const InputFile file(path, "text file");
    if (static_cast<size_t>(file.size()) > kMaxTextBytes) {
      fail(fmt::format("The text file {} is larger than the {} GiB a document may hold; give it in parts.", path,
                       kMaxTextBytes >> 30));
    }
    if (docs.text.size() + static_cast<size_t>(file.size()) > kMaxTextBytes) too_large("the text file " + path);
    const size_t begin = docs.text.size();
    append_file(file, docs.text);
    check_text(std::string_view(docs.text).substr(begin), "the text file " + path);
    docs.spans.push_back({begin, docs.text.size() - begin});
    docs.text += '\n';
    if (added) added(docs);
  }
}

[[noreturn]] void no_documents(const std::vector<std::string>& files, const std::string& field) {
  fail(
      fmt::format("The JSONL {} {} no document: every line is blank or its field \"{}\" is empty; give records "
                  "with text.",
                  files.size() == 1 ? "file " + files[0] : "files data.text names",
                  files.size() == 1 ? "holds" : "hold", util::printable(field)));
}

}  // namespace

Documents read_documents(const std::vector<std::string>& files, DataFormat format, const std::string& field) {
  Documents docs;
  read_documents_into(files, format, field, docs, {});
  if (docs.spans.empty()) no_documents(files, field);
  return docs;
}

DocumentsRead for_each_document_batch(const std::vector<std::string>& files, DataFormat format,
                                      const std::string& field, size_t batch_bytes,
                                      const std::function<void(const Documents&)>& batch) {
  DocumentsRead read;
  util::Sha256 hash;
  Documents docs;
  const auto pass_on = [&](Documents& d) {
    d.hash_into(hash);
    read.documents += static_cast<int64_t>(d.spans.size());
    read.bytes += d.bytes();
    batch(d);
    d.text.clear();
    d.spans.clear();
  };
  read_documents_into(files, format, field, docs, [&](Documents& d) {
    if (d.text.size() >= batch_bytes) pass_on(d);
  });
  if (!docs.spans.empty()) pass_on(docs);
  if (read.documents == 0) no_documents(files, field);
  read.empty_records = docs.empty_records;
  read.sha256 = hash.hex_digest();
  return read;
}

TokenStream read_token_files(const std::vector<std::string>& files, int vocab_size, int eos_id, const TokenSink& sink) {
  TokenReader reader(vocab_size, sink);
  TokenStream& out = reader.out;
  std::vector<std::string> megatron_read;
  for (const std::string& path : files) {
    const bool idx = ends_with(path, ".idx");
    const std::string prefix = idx ? strip(path, ".idx") : ends_with(path, ".bin") ? strip(path, ".bin") : "";
    if (idx || (!prefix.empty() && fs::exists(prefix + ".idx"))) {
      // A glob may name both halves of one dataset.
      if (std::find(megatron_read.begin(), megatron_read.end(), prefix) != megatron_read.end()) continue;
      megatron_read.push_back(prefix);
      read_megatron(prefix, reader);
      continue;
    }
    const InputFile file(path, "token file");
    out.starts.push_back(out.count);
    if (read_llmc(file, eos_id, reader)) continue;
    if (file.size() == 0 || file.size() % 2 != 0) {
      fail(
          fmt::format("The token file {} holds {} bytes and no llm.c header, so it would be nanoGPT's uint16 ids, "
                      "but that takes a positive even number of bytes: it is not a token shard.",
                      path, file.size()));
    }
    reader.read(file, 0, file.size() / 2, 2, eos_id);
  }
  // Starts are positions: an end of text at a shard's end repeats the next shard's start.
  out.starts.erase(std::unique(out.starts.begin(), out.starts.end()), out.starts.end());
  if (!out.starts.empty() && out.starts.back() == out.count) out.starts.pop_back();
  if (out.count == 0) fail("The token files data.text names hold no tokens.");
  reader.hash.update(out.starts.data(), out.starts.size() * sizeof(int64_t));
  out.sha256 = reader.hash.hex_digest();
  return out;
}

}  // namespace remat::data
