#include <fmt/format.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "remat/data.h"
#include "remat/tokenizer.h"
#include "data/encode_parts.h"
#include "sources.h"
#include "util/atomic_file.h"
#include "util/sha256.h"
#include "util/temp_files.h"
#include "util/utf8.h"

namespace remat::data {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kBibleCommand = "bible -l 100000 gen1:1-rev22:21";
constexpr const char* kBibleSource =
    "King James Bible (Debian bible-kjv: `bible -l 100000 gen1:1-rev22:21`, verse numbers "
    "removed, chapter headings kept)";
// Bumped when anything that shapes the output other than the text and PrepareOptions
// changes (cleaning aside, which the text hash covers): tokenizer settings, split rule,
// file layout. A cached corpus from another recipe is rebuilt.
constexpr int kRecipe = 1;
constexpr int kEncodeThreads = 2;
constexpr int kTrainThreads = 2;
// What meta.json's tokenizer.source says of a tokenizer trained here.
constexpr const char* kTrained = "trained";

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian and written from memory as is");

using Log = std::function<void(const std::string&)>;

void say(const Log& log, const std::string& line) {
  if (log) log(line);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool program_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t pos = 0;
  while (pos <= dirs.size()) {
    size_t end = dirs.find(':', pos);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = end > pos ? dirs.substr(pos, end - pos) : ".";
    if (::access((dir + "/" + name).c_str(), X_OK) == 0) return true;
    pos = end + 1;
  }
  return false;
}

// `bible` prints "Genesis 1" headings, blank lines, and verses as "  N text".
std::string clean_kjv(std::string_view raw) {
  std::string text;
  text.reserve(raw.size());
  size_t pos = 0;
  bool first_heading = true;
  while (pos < raw.size()) {
    size_t end = raw.find('\n', pos);
    if (end == std::string_view::npos) end = raw.size();
    std::string_view line = raw.substr(pos, end - pos);
    pos = end + 1;
    size_t i = 0;
    while (i < line.size() && line[i] == ' ') ++i;
    if (i == line.size()) continue;  // blank
    const size_t digits_start = i;
    while (i < line.size() && line[i] >= '0' && line[i] <= '9') ++i;
    const bool verse = digits_start > 0 && i > digits_start && i < line.size() && line[i] == ' ';
    if (verse) {
      text.append(line.substr(i + 1));
    } else {
      if (!first_heading) text += '\n';
      first_heading = false;
      text.append(line.substr(digits_start));
    }
    text += '\n';
  }
  return text;
}

// Moves `x` to the nearest line start within `tolerance` tokens, if there is one.
int64_t snap_to_line(int64_t x, int64_t tolerance, const std::vector<int64_t>& line_starts) {
  auto it = std::lower_bound(line_starts.begin(), line_starts.end(), x);
  int64_t best = x, best_distance = tolerance + 1;
  if (it != line_starts.end() && *it - x < best_distance) {
    best = *it;
    best_distance = *it - x;
  }
  if (it != line_starts.begin() && x - *(it - 1) < best_distance) best = *(it - 1);
  return best;
}

// One block of the validation split: train takes [begin, val_begin), val [val_begin, end).
struct Cut {
  int64_t begin = 0, val_begin = 0, end = 0;
};

// The blocks of `n` ids, as the split rule in remat/data.h cuts them.
std::vector<Cut> split_cuts(int64_t n, const std::vector<int64_t>& line_starts, double val_fraction, int val_blocks) {
  if (val_fraction <= 0) return {{0, n, n}};
  const int64_t stretch = std::llround(val_fraction * static_cast<double>(n) / val_blocks);
  const int64_t tolerance = stretch / 2;
  auto block_end = [&](int b) {
    if (b == val_blocks) return n;
    return snap_to_line(n * b / val_blocks, tolerance, line_starts);
  };
  std::vector<Cut> cuts;
  int64_t begin = 0;
  for (int b = 1; b <= val_blocks; ++b) {
    const int64_t end = std::max(begin, block_end(b));
    const int64_t val_length = std::llround(val_fraction * static_cast<double>(end - begin));
    const int64_t val_begin = std::clamp(snap_to_line(end - val_length, tolerance, line_starts), begin, end);
    cuts.push_back({begin, val_begin, end});
    begin = end;
  }
  return cuts;
}

// train.bin and val.bin, written as the ids arrive in order, each id to the split its cut
// gives it, counted and hashed on the way; nothing lands under the final names before
// commit().
class SplitWriter {
 public:
  SplitWriter(const CorpusInfo& info, std::vector<Cut> cuts)
      : token_bytes_(info.token_bytes),
        cuts_(std::move(cuts)),
        train_(info.train_path()),
        val_(info.val_path()),
        counts_(static_cast<size_t>(info.vocab_size), 0) {}

  void add(const int32_t* ids, size_t n) {
    while (n > 0) {
      while (cut_ < cuts_.size() && cuts_[cut_].end == position_) ++cut_;
      if (cut_ == cuts_.size()) {
        throw std::runtime_error("The input changed while remat read it: it holds more than the " +
                                 std::to_string(position_) + " ids first counted; prepare again once it is written.");
      }
      const Cut& c = cuts_[cut_];
      const bool val = position_ >= c.val_begin;
      const auto take =
          static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(n), (val ? c.end : c.val_begin) - position_));
      if (!val) {
        for (size_t i = 0; i < take; ++i) ++counts_.at(static_cast<size_t>(ids[i]));
      }
      write(val ? val_ : train_, ids, take);
      ids += take;
      n -= take;
      position_ += static_cast<int64_t>(take);
    }
  }

  // The counts, checksums and entropy into `info`, once every id is added.
  void finish(CorpusInfo& info) {
    info.train_tokens = train_.count;
    info.val_tokens = val_.count;
    info.train_sha256 = train_.hash.hex_digest();
    info.val_sha256 = val_.hash.hex_digest();
    info.train_unigram_entropy = unigram_entropy(counts_);
  }
  void commit() {
    train_.file.commit();
    val_.file.commit();
  }

 private:
  struct Side {
    explicit Side(const std::string& path) : file(path) {}
    util::AtomicFile file;
    util::Sha256 hash;
    int64_t count = 0;
  };
  // Ids as little-endian uint16 or uint32 bytes.
  void write(Side& side, const int32_t* ids, size_t n) {
    bytes_.resize(n * static_cast<size_t>(token_bytes_));
    if (token_bytes_ == 2) {
      auto* out = reinterpret_cast<uint16_t*>(bytes_.data());
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(ids[i]);
    } else if (n > 0) {  // memcpy from an empty range's null pointer is undefined
      std::memcpy(bytes_.data(), ids, bytes_.size());
    }
    side.file.write(bytes_.data(), bytes_.size());
    side.hash.update(bytes_.data(), bytes_.size());
    side.count += static_cast<int64_t>(n);
  }

  int token_bytes_;
  std::vector<Cut> cuts_;
  size_t cut_ = 0;
  int64_t position_ = 0;
  Side train_, val_;
  std::vector<int64_t> counts_;
  std::vector<char> bytes_;
};

const char* dtype_name(int token_bytes) { return token_bytes == 2 ? "uint16" : "uint32"; }

json to_json(const CorpusInfo& info) {
  json tokenizer = {{"file", "tokenizer.model"},
                    {"source", info.tokenizer_source},
                    {"sha256", info.tokenizer_sha256},
                    {"vocab_size", info.vocab_size},
                    {"max_training_bytes", info.max_training_bytes},
                    {"seed", info.seed}};
  // How a tokenizer trained here was trained (a given one's file says what it is).
  if (info.tokenizer_source == kTrained) {
    tokenizer.update({{"model_type", "bpe"}, {"byte_fallback", true}, {"num_threads", kTrainThreads}});
  }
  return json{
      {"format", "remat-corpus"},
      {"recipe", kRecipe},
      {"source", info.source},
      {"text", {{"sha256", info.text_sha256}, {"bytes", info.text_bytes}}},
      {"tokenizer", tokenizer},
      {"split", {{"val_fraction", info.val_fraction}, {"val_blocks", info.val_blocks}}},
      {"tokens",
       {{"dtype", dtype_name(info.token_bytes)},
        {"train", {{"file", "train.bin"}, {"count", info.train_tokens}, {"sha256", info.train_sha256}}},
        {"val", {{"file", "val.bin"}, {"count", info.val_tokens}, {"sha256", info.val_sha256}}}}},
      {"train_unigram_entropy_nats", info.train_unigram_entropy},
      {"bytes_per_token", info.bytes_per_token()},
      {"prepare_seconds", info.prepare_seconds},
  };
}

[[noreturn]] void bad_meta(const std::string& dir, const std::string& reason) {
  throw std::runtime_error(dir + "/meta.json is not valid corpus metadata (" + reason + ")");
}

// The whole number `v` (called `name`) in [lo, hi]. json's get<int>() converts a fraction,
// or a number out of the type's range (1e300), with undefined behaviour, and a count near
// 2^63 overflowed the size checks; prepare writes nothing near these bounds.
int64_t whole(const json& v, const char* name, int64_t lo, int64_t hi, const std::string& dir) {
  const bool fits = v.is_number_unsigned()  ? v.get<uint64_t>() <= static_cast<uint64_t>(hi)
                    : v.is_number_integer() ? v.get<int64_t>() >= lo && v.get<int64_t>() <= hi
                                            : false;
  if (!fits) bad_meta(dir, fmt::format("{} is {}, not a whole number from {} to {}", name, v.dump(), lo, hi));
  return v.get<int64_t>();
}

CorpusInfo from_json(const json& j, const std::string& dir) {
  if (j.at("format").get<std::string>() != "remat-corpus") bad_meta(dir, "format is not remat-corpus");
  constexpr int64_t kMaxCount = int64_t{1} << 40;  // bytes or tokens: far beyond any text prepared
  constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min(), kInt64Max = std::numeric_limits<int64_t>::max();
  CorpusInfo info;
  info.dir = dir;
  info.source = j.at("source").get<std::string>();
  info.text_sha256 = j.at("text").at("sha256").get<std::string>();
  info.text_bytes = whole(j.at("text").at("bytes"), "text.bytes", 0, kMaxCount, dir);
  const json& tok = j.at("tokenizer");
  info.tokenizer_sha256 = tok.at("sha256").get<std::string>();
  info.tokenizer_source = tok.value("source", std::string(kTrained));
  info.vocab_size = static_cast<int>(whole(tok.at("vocab_size"), "tokenizer.vocab_size", 1, 1 << 24, dir));
  info.max_training_bytes =
      whole(tok.at("max_training_bytes"), "tokenizer.max_training_bytes", kInt64Min, kInt64Max, dir);
  info.seed = static_cast<uint32_t>(whole(tok.at("seed"), "tokenizer.seed", 0, UINT32_MAX, dir));
  info.val_fraction = j.at("split").at("val_fraction").get<double>();
  info.val_blocks = static_cast<int>(whole(j.at("split").at("val_blocks"), "split.val_blocks", 1, INT_MAX, dir));
  const json& tokens = j.at("tokens");
  const auto dtype = tokens.at("dtype").get<std::string>();
  if (dtype != "uint16" && dtype != "uint32") bad_meta(dir, "unknown dtype " + dtype);
  info.token_bytes = dtype == "uint16" ? 2 : 4;
  info.train_tokens = whole(tokens.at("train").at("count"), "tokens.train.count", 0, kMaxCount, dir);
  info.train_sha256 = tokens.at("train").at("sha256").get<std::string>();
  info.val_tokens = whole(tokens.at("val").at("count"), "tokens.val.count", 0, kMaxCount, dir);
  info.val_sha256 = tokens.at("val").at("sha256").get<std::string>();
  info.train_unigram_entropy = j.at("train_unigram_entropy_nats").get<double>();
  info.prepare_seconds = j.value("prepare_seconds", 0.0);
  return info;
}

// Reads meta.json; throws with the reason (not yet a full sentence) on any problem.
CorpusInfo read_meta(const std::string& dir) {
  const std::string path = dir + "/meta.json";
  const std::string text = util::read_file(path, "the corpus metadata");
  json j;
  try {
    j = json::parse(text);
    if (whole(j.at("recipe"), "recipe", INT_MIN, INT_MAX, dir) != kRecipe) {
      throw std::runtime_error(path + " was written by another version of remat (recipe " + j.at("recipe").dump() +
                               ", this one makes " + std::to_string(kRecipe) + ")");
    }
    return from_json(j, dir);
  } catch (const json::exception& e) {
    bad_meta(dir, e.what());
  }
}

int64_t file_size_or(const std::string& path, int64_t missing) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return missing;
  return static_cast<int64_t>(st.st_size);
}

// Empty when the files match the sizes meta.json records; else what is wrong.
std::string check_sizes(const CorpusInfo& info) {
  if (file_size_or(info.tokenizer_path(), -1) <= 0) return info.tokenizer_path() + " is missing";
  const std::pair<std::string, int64_t> bins[] = {{info.train_path(), info.train_tokens},
                                                  {info.val_path(), info.val_tokens}};
  for (const auto& [path, count] : bins) {
    const int64_t size = file_size_or(path, -1);
    if (size < 0) return path + " is missing";
    if (size != count * info.token_bytes) {
      return path + " has " + std::to_string(size) + " bytes but meta.json records " + std::to_string(count) +
             " tokens of " + std::to_string(info.token_bytes) + " bytes";
    }
  }
  return "";
}

// SHA-256 of the file at `path` (a regular file: check_sizes saw it), read a chunk at a
// time, since a corpus's token files may be far larger than memory.
std::string file_sha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  util::Sha256 h;
  std::vector<char> chunk(size_t{1} << 20);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    h.update(chunk.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) throw std::runtime_error("Cannot read " + path + ".");
  return h.hex_digest();
}

// Empty when every file's SHA-256 matches meta.json; else what is wrong.
std::string check_hashes(const CorpusInfo& info) {
  const std::pair<std::string, std::string> files[] = {{info.tokenizer_path(), info.tokenizer_sha256},
                                                       {info.train_path(), info.train_sha256},
                                                       {info.val_path(), info.val_sha256}};
  for (const auto& [path, expected] : files) {
    if (file_sha256(path) != expected) return path + " does not match the checksum in meta.json";
  }
  return "";
}

// Empty when a corpus built with `options` from text hashing to `text_sha256` would
// equal `info`; else the first difference.
std::string cache_mismatch(const CorpusInfo& info, const PrepareOptions& options, const std::string& text_sha256,
                           const std::optional<Tokenizer>& given) {
  if (info.text_sha256 != text_sha256) return info.text_bytes > 0 ? "the text changed" : "the token files changed";
  if (given) {
    return info.tokenizer_source == kTrained || info.tokenizer_sha256 != util::sha256_hex(given->serialized())
               ? "the tokenizer changed"
               : "";
  }
  if (info.tokenizer_source != kTrained) return "the tokenizer was given, now it is trained";
  if (info.vocab_size != options.vocab_size) {
    return "vocab_size was " + std::to_string(info.vocab_size) + ", now " + std::to_string(options.vocab_size);
  }
  if (info.val_fraction != options.val_fraction || info.val_blocks != options.val_blocks) {
    return "the validation split changed";
  }
  if (info.max_training_bytes != options.max_training_bytes || info.seed != options.seed) {
    return "the tokenizer training options changed";
  }
  return "";
}

void check_options(const PrepareOptions& o) {
  if (o.out_dir.empty()) throw std::runtime_error("The corpus needs an output directory.");
  if (o.format == DataFormat::tokens && !o.tokenizer) {
    throw std::runtime_error("Token ids can be prepared only with the tokenizer that wrote them; give it.");
  }
  if (!o.tokenizer && (o.vocab_size < 260 || o.vocab_size > (1 << 24))) {
    throw std::runtime_error("The vocabulary size must be between 260 and 16777216, got " +
                             std::to_string(o.vocab_size) + ".");
  }
  if (!(o.val_fraction >= 0 && o.val_fraction <= 0.5)) {
    throw std::runtime_error("The validation fraction must be in [0, 0.5], got " + std::to_string(o.val_fraction) +
                             ".");
  }
  if (o.val_blocks < 1) {
    throw std::runtime_error("The validation split needs at least one block, got " + std::to_string(o.val_blocks) +
                             ".");
  }
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') out += ',';
    out += digits[i];
  }
  return out;
}

// Lines saying how far a long pass has come (`what`: "read", "split"), one every 10 s at
// most, so that a corpus of billions of tokens shows progress.
class PassProgress {
 public:
  PassProgress(const Log& log, std::string what, std::string unit, int64_t total = 0)
      : log_(log), what_(std::move(what)), unit_(std::move(unit)), total_(total) {}
  void add(int64_t n) {
    done_ += n;
    if (seconds_since(last_) < 10) return;
    last_ = std::chrono::steady_clock::now();
    say(log_, fmt::format("{} {}{} {} in {:.0f} s", what_, with_commas(done_),
                          total_ > 0 ? " of " + with_commas(total_) : "", unit_, seconds_since(start_)));
  }

 private:
  const Log& log_;
  std::string what_, unit_;
  int64_t total_ = 0, done_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_ = start_;
};

}  // namespace

std::string read_kjv_text() {
  if (!program_on_path("bible")) {
    throw std::runtime_error(
        "The default corpus needs the `bible` program from Debian's bible-kjv package "
        "(apt-get install bible-kjv), or give a UTF-8 text file instead.");
  }
  const std::string command = std::string(kBibleCommand) + " 2>&1";
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error(std::string("Cannot run `") + kBibleCommand + "`.");
  std::string raw;
  char buffer[1 << 16];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) raw.append(buffer, n);
  const int status = ::pclose(pipe);
  std::string text = clean_kjv(raw);
  const bool ok = status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  // A complete text has 1189 chapters and about 4.3 MB; anything far smaller is an error
  // message from `bible` (e.g. bible-kjv-text missing), not the Bible.
  if (!ok || text.size() < 1000000) {
    std::string first_line = raw.substr(0, raw.find('\n'));
    if (first_line.size() > 200) first_line.resize(200);
    throw std::runtime_error(
        std::string("`") + kBibleCommand + "` did not print the Bible (" +
        (ok ? "only " + std::to_string(raw.size()) + " bytes" : "exit status " + std::to_string(WEXITSTATUS(status))) +
        (first_line.empty() ? "" : ": " + first_line) + "); reinstall Debian's bible-kjv and bible-kjv-text.");
  }
  return text;
}

double unigram_entropy(const std::vector<int64_t>& counts) {
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  double h = 0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(n);
    h -= p * std::log(p);
  }
  return h;
}

CorpusInfo load_corpus_info(const std::string& dir) {
  if (!fs::is_directory(dir)) {
    throw std::runtime_error("The corpus directory " + dir + " does not exist; run `remat prepare` to create it.");
  }
  if (!fs::exists(dir + "/meta.json")) {
    throw std::runtime_error("The corpus directory " + dir + " has no meta.json; run `remat prepare` to (re)build it.");
  }
  CorpusInfo info;
  try {
    info = read_meta(dir);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string(e.what()) + "; run `remat prepare` to rebuild it.");
  }
  const std::string problem = check_sizes(info);
  if (!problem.empty()) {
    throw std::runtime_error("The corpus in " + dir + " is damaged: " + problem +
                             "; run `remat prepare` to rebuild it.");
  }
  return info;
}

namespace {

// A tokenizer trained on `text` as `options` say.
Tokenizer train_tokenizer(const PrepareOptions& options, std::string_view text, const Log& log) {
  say(log, "training a " + std::to_string(options.vocab_size) + "-piece BPE tokenizer on " +
               with_commas(static_cast<int64_t>(text.size())) + " bytes");
  const auto t = std::chrono::steady_clock::now();
  TokenizerTrainOptions tok_options;
  tok_options.vocab_size = options.vocab_size;
  tok_options.num_threads = kTrainThreads;
  tok_options.max_training_bytes = options.max_training_bytes;
  tok_options.seed = options.seed;
  Tokenizer tok = Tokenizer::train(text, tok_options);
  say(log, fmt::format("tokenizer trained in {:.2f} s", seconds_since(t)));
  return tok;
}

// The corpus directory, made ready for new files: created if missing, and cleared of what
// a killed prepare was writing (a signal removes its own on the way out). An existing
// corpus there stays intact until write_corpus.
void open_corpus_dir(const CorpusInfo& info) {
  std::error_code ec;
  fs::create_directories(info.dir, ec);
  if (!fs::is_directory(info.dir)) {
    throw std::runtime_error("Cannot create the corpus directory " + info.dir + ": " + ec.message() + ".");
  }
  std::vector<std::string> names;
  for (const std::string& path : {info.tokenizer_path(), info.train_path(), info.val_path(), info.meta_path()}) {
    names.push_back(fs::path(path).filename().string());
  }
  names.push_back("ids");  // encode_batches' scratch file
  util::remove_stale_temp_files(info.dir, names);
}

// Puts the new corpus in place, meta.json last: until the new one lands, the directory does
// not look complete.
void write_corpus(CorpusInfo& info, const Tokenizer& tok, SplitWriter& splits,
                  std::chrono::steady_clock::time_point start) {
  std::error_code ec;
  fs::remove(info.meta_path(), ec);
  tok.save(info.tokenizer_path());
  splits.commit();
  info.prepare_seconds = seconds_since(start);
  util::write_file_atomically(info.meta_path(), to_json(info).dump(2) + "\n");
}

// The cached corpus in `dir` when it matches, else nothing (saying why it is rebuilt).
std::optional<CorpusInfo> cached_corpus(const PrepareOptions& options, const std::string& text_sha256,
                                        const std::optional<Tokenizer>& given, const Log& log) {
  const std::string& dir = options.out_dir;
  if (options.force || !fs::exists(dir + "/meta.json")) return std::nullopt;
  std::string why;
  try {
    CorpusInfo cached = read_meta(dir);
    why = cache_mismatch(cached, options, text_sha256, given);
    if (why.empty()) why = check_sizes(cached);
    if (why.empty()) why = check_hashes(cached);
    if (why.empty()) {
      say(log, dir + " is up to date (" + with_commas(cached.train_tokens) + " train, " +
                   with_commas(cached.val_tokens) + " val tokens); nothing to do");
      cached.cached = true;
      return cached;
    }
  } catch (const std::exception& e) {
    why = e.what();
  }
  say(log, "rebuilding " + dir + ": " + why);
  return std::nullopt;
}

// What a corpus is made from, as data.text and data.format say: one text (a single text
// file, or the default corpus), documents, or token ids.
struct Input {
  std::string source;  // meta.json's
  std::string sha256;  // of what is encoded (text or documents) or read (ids): the cache's key
  int64_t text_bytes = 0;
  std::string text;
  std::optional<Documents> documents;
  bool streamed = false;              // documents hashed, to be encoded a batch at a time
  std::optional<TokenStream> tokens;  // counted and hashed, their ids read again to write
  std::vector<std::string> files;     // the documents' or token ids' files
  std::string_view training_text() const { return documents ? std::string_view(documents->text) : text; }
};

Input read_input(const PrepareOptions& options, const std::optional<Tokenizer>& given, const Log& log) {
  Input in;
  if (!options.text_file) {
    say(log, std::string("reading the King James Bible (`") + kBibleCommand + "`)");
    in.text = read_kjv_text();
    in.source = kBibleSource;
  } else if (const auto files = expand_files(*options.text_file);
             files.size() == 1 && options.format == DataFormat::text) {
    say(log, "reading " + files[0]);
    in.text = read_utf8_file(files[0]);
    in.source = "file " + fs::absolute(files[0]).lexically_normal().string();
  } else {
    const char* kind = options.format == DataFormat::text    ? "text"
                       : options.format == DataFormat::jsonl ? "JSONL"
                                                             : "token";
    const std::string named =
        files.size() == 1 ? fmt::format("the {} file {}", kind, fs::absolute(files[0]).lexically_normal().string())
                          : fmt::format("{} {} files matching {}", files.size(), kind,
                                        fs::absolute(*options.text_file).lexically_normal().string());
    say(log, "reading " + named);
    if (options.format == DataFormat::tokens) {
      PassProgress progress(log, "read", "tokens");
      in.tokens = read_token_files(files, given->vocab_size(), given->eos_id(),
                                   [&](const int32_t*, size_t n) { progress.add(static_cast<int64_t>(n)); });
      in.files = files;
      in.sha256 = in.tokens->sha256;
      in.source = "the ids of " + named;
      say(log, fmt::format("read {} tokens", with_commas(in.tokens->count)));
      return in;
    }
    in.files = files;
    in.source =
        options.format == DataFormat::jsonl ? fmt::format("the field \"{}\" of {}", options.field, named) : named;
    DocumentsRead read;
    if (given) {
      // A given tokenizer encodes them a batch at a time: this reading only hashes them.
      PassProgress progress(log, "read", "bytes of documents");
      read = for_each_document_batch(files, options.format, options.field, options.batch_bytes,
                                     [&](const Documents& docs) { progress.add(docs.bytes()); });
      in.streamed = true;
    } else {
      in.documents = read_documents(files, options.format, options.field);
      read = {in.documents->sha256(), static_cast<int64_t>(in.documents->spans.size()), in.documents->bytes(),
              in.documents->empty_records};
    }
    in.sha256 = read.sha256;
    in.text_bytes = read.bytes;
    say(log, fmt::format("read {} documents, {} bytes{}", with_commas(read.documents), with_commas(read.bytes),
                         read.empty_records == 0
                             ? ""
                             : fmt::format(" ({} records with an empty field left out)", read.empty_records)));
    return in;
  }
  in.sha256 = util::sha256_hex(in.text);
  in.text_bytes = static_cast<int64_t>(in.text.size());
  return in;
}

// Each document's ids, encoded on `threads` threads over contiguous runs of documents of
// about equal bytes, joined by the end of text; `starts` receives each document's first.
std::vector<int32_t> encode_documents(const Documents& docs, const Tokenizer& tok, int threads,
                                      std::vector<int64_t>& starts) {
  const int eos = tok.eos_id();
  if (eos < 0) {
    throw std::runtime_error("The tokenizer (" + tok.kind() +
                             ") has no end-of-text token to separate the documents with; give one that has (its "
                             "tokenizer_config.json names it as eos_token).");
  }
  const size_t n = docs.spans.size(), parts = std::min<size_t>(std::max(threads, 1), n);
  std::vector<size_t> bounds = {0};
  const auto total = static_cast<double>(docs.text.size());
  for (size_t i = 0, part = 1; i < n && part < parts; ++i) {
    if (static_cast<double>(docs.spans[i].begin) >= total * static_cast<double>(part) / static_cast<double>(parts)) {
      bounds.push_back(i);
      ++part;
    }
  }
  bounds.push_back(n);
  const auto encode = [&](size_t part, std::vector<int32_t>& ids, std::vector<int64_t>& doc_starts) {
    std::vector<int64_t> lines;
    for (size_t d = bounds[part]; d < bounds[part + 1]; ++d) {
      if (d > bounds[0]) ids.push_back(eos);
      doc_starts.push_back(static_cast<int64_t>(ids.size()));
      const std::vector<int32_t> doc = tok.encode_text(docs.document(d), lines, 1);
      ids.insert(ids.end(), doc.begin(), doc.end());
    }
  };
  return encode_parts(bounds.size() - 1, encode, starts);
}

// The input's ids, counted, with where the split may cut them (lines, documents).
struct Ids {
  int64_t count = 0;
  std::vector<int64_t> starts;
  std::vector<int32_t> held;                  // a text's, or documents' read whole
  std::unique_ptr<util::AtomicFile> scratch;  // documents' encoded a batch at a time (int32), never committed
};

void say_encoded(const Log& log, int64_t tokens, int64_t bytes, std::chrono::steady_clock::time_point t,
                 const std::string& of = "") {
  say(log,
      fmt::format("encoded {} tokens{} in {:.2f} s ({:.2f} bytes/token)", with_commas(tokens), of, seconds_since(t),
                  static_cast<double>(bytes) / static_cast<double>(std::max<int64_t>(tokens, 1))));
}

// Documents encoded a batch at a time into a scratch file in the corpus directory, the
// batches joined by the end of text as encode_documents joins documents; the reading held
// to the first one's digest.
void encode_batches(const Input& in, const PrepareOptions& options, const Tokenizer& tok, const CorpusInfo& info,
                    Ids& ids, const Log& log) {
  const auto t = std::chrono::steady_clock::now();
  ids.scratch = std::make_unique<util::AtomicFile>(info.dir + "/ids");
  int64_t bytes = 0;
  const int32_t eos = tok.eos_id();
  const DocumentsRead again =
      for_each_document_batch(in.files, options.format, options.field, options.batch_bytes, [&](const Documents& docs) {
        std::vector<int64_t> starts;
        const std::vector<int32_t> batch = encode_documents(docs, tok, kEncodeThreads, starts);
        if (bytes > 0) {
          ids.scratch->write(&eos, sizeof(eos));
          ++ids.count;
        }
        for (int64_t s : starts) ids.starts.push_back(ids.count + s);
        ids.scratch->write(batch.data(), batch.size() * sizeof(int32_t));
        ids.count += static_cast<int64_t>(batch.size());
        bytes += docs.bytes();
        say_encoded(log, ids.count, bytes, t,
                    fmt::format(" from {} of {} bytes", with_commas(bytes), with_commas(in.text_bytes)));
      });
  if (again.sha256 != in.sha256) {
    throw std::runtime_error("The documents (" + util::printable(in.source) +
                             ") changed while remat read them; prepare again once they are written.");
  }
}

Ids gather_ids(Input& in, const PrepareOptions& options, const Tokenizer& tok, const CorpusInfo& info, const Log& log) {
  Ids ids;
  if (in.tokens) {
    ids.count = in.tokens->count;
    ids.starts = std::move(in.tokens->starts);
  } else if (in.streamed) {
    encode_batches(in, options, tok, info, ids, log);
  } else {
    const auto t = std::chrono::steady_clock::now();
    ids.held = in.documents ? encode_documents(*in.documents, tok, kEncodeThreads, ids.starts)
                            : tok.encode_text(in.text, ids.starts, kEncodeThreads);
    ids.count = static_cast<int64_t>(ids.held.size());
    say_encoded(log, ids.count, in.text_bytes, t);
  }
  return ids;
}

// Passes the input's ids to `splits`: those held, those in the scratch file a chunk at a
// time, or the token files read a second time, a chunk at a time, held to the first
// reading's digest so that files written in between are refused rather than split by a
// count they no longer have.
void feed_splits(const Input& in, const Tokenizer& tok, const Ids& ids, SplitWriter& splits, const Log& log) {
  if (ids.scratch) {
    std::vector<int32_t> chunk(size_t{1} << 18);
    for (int64_t done = 0; done < ids.count;) {
      const auto n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(chunk.size()), ids.count - done));
      ids.scratch->read_back(done * static_cast<int64_t>(sizeof(int32_t)), chunk.data(), n * sizeof(int32_t));
      splits.add(chunk.data(), n);
      done += static_cast<int64_t>(n);
    }
    return;
  }
  if (!in.tokens) {
    splits.add(ids.held.data(), ids.held.size());
    return;
  }
  say(log, "splitting them into train.bin and val.bin");
  PassProgress progress(log, "split", "tokens", ids.count);
  const TokenStream again =
      read_token_files(in.files, tok.vocab_size(), tok.eos_id(), [&](const int32_t* chunk, size_t n) {
        splits.add(chunk, n);
        progress.add(static_cast<int64_t>(n));
      });
  if (again.sha256 != in.tokens->sha256) {
    throw std::runtime_error("The token files (" + util::printable(in.source) +
                             ") changed while remat read them; prepare again once they are written.");
  }
}

}  // namespace

CorpusInfo prepare_corpus(const PrepareOptions& options, const Log& log) {
  check_options(options);
  const auto start = std::chrono::steady_clock::now();

  std::optional<Tokenizer> given;
  if (options.tokenizer) {
    say(log, "reading the tokenizer " + util::printable(*options.tokenizer));
    given = Tokenizer::load(*options.tokenizer);
  }
  Input in = read_input(options, given, log);
  if (auto cached = cached_corpus(options, in.sha256, given, log)) return *cached;

  const Tokenizer tok = given ? *given : train_tokenizer(options, in.training_text(), log);
  CorpusInfo info;
  info.dir = options.out_dir;
  info.source = in.source;
  info.text_sha256 = in.sha256;
  info.text_bytes = in.text_bytes;
  info.vocab_size = tok.vocab_size();
  info.val_fraction = options.val_fraction;
  info.val_blocks = options.val_blocks;
  info.max_training_bytes = options.max_training_bytes;
  info.seed = options.seed;
  info.token_bytes = info.vocab_size <= 65536 ? 2 : 4;
  info.tokenizer_source = given ? fs::absolute(*options.tokenizer).lexically_normal().string() : kTrained;

  // Streamed documents' scratch file is written into the directory.
  if (in.streamed) open_corpus_dir(info);
  const Ids ids = gather_ids(in, options, tok, info, log);
  const std::vector<Cut> cuts = split_cuts(ids.count, ids.starts, options.val_fraction, options.val_blocks);
  int64_t val_tokens = 0;
  for (const Cut& c : cuts) val_tokens += c.end - c.val_begin;
  // An empty split would be found only by a run's first validation, after the corpus is written.
  if (options.val_fraction > 0 && val_tokens == 0) {
    throw std::runtime_error(fmt::format(
        "The text {} encodes to {} tokens, too few for a validation split of data.val_fraction = {}: it would be "
        "empty; train on a longer text, or raise data.val_fraction.",
        util::printable(in.source), ids.count, options.val_fraction));
  }
  if (!in.streamed) open_corpus_dir(info);
  SplitWriter splits(info, cuts);
  feed_splits(in, tok, ids, splits, log);
  splits.finish(info);
  info.tokenizer_sha256 = util::sha256_hex(tok.serialized());
  write_corpus(info, tok, splits, start);

  say(log, fmt::format("wrote {}: {} train + {} val tokens ({}), unigram entropy {:.3f} "
                       "nats/token, in {:.2f} s",
                       info.dir, with_commas(info.train_tokens), with_commas(info.val_tokens),
                       dtype_name(info.token_bytes), info.train_unigram_entropy, info.prepare_seconds));
  return info;
}

}  // namespace remat::data
