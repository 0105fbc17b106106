#include "remat/tokenizer.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "data/byte_level_bpe.h"
#include "data/encode_parts.h"
#include "data/sentencepiece_shim.h"
#include "util/atomic_file.h"
#include "util/utf8.h"

namespace remat::data {

namespace {

constexpr const char* kShimName = "libremat_sentencepiece.so";
// save()'s form of a byte-level BPE: its tokenizer.json and tokenizer_config.json texts in
// one JSON object, whose sorted keys put this marker first.
constexpr std::string_view kBpeMarker = R"({"format":"remat-byte-level-bpe",)";
// Far above any tokenizer published (Llama 3's tokenizer.json is 9 MB).
constexpr int64_t kMaxTokenizerBytes = int64_t{1} << 30;

// The shim's entry points, resolved once per process.
struct ShimApi {
  decltype(&remat_sp_abi_version) abi_version;
  decltype(&remat_sp_last_error) last_error;
  decltype(&remat_sp_train) train;
  decltype(&remat_sp_load) load;
  decltype(&remat_sp_free) free_model;
  decltype(&remat_sp_vocab_size) vocab_size;
  decltype(&remat_sp_special_id) special_id;
  decltype(&remat_sp_piece_to_id) piece_to_id;
  decltype(&remat_sp_id_to_piece) id_to_piece;
  decltype(&remat_sp_encode) encode;
  decltype(&remat_sp_decode) decode;
  decltype(&remat_sp_free_buffer) free_buffer;
};

std::string executable_dir() {
  char buffer[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) return ".";
  const std::string path(buffer, static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

template <typename F>
void resolve(void* library, const std::string& path, const char* name, F& out) {
  void* symbol = ::dlsym(library, name);
  if (symbol == nullptr) {
    throw std::runtime_error("The SentencePiece helper library " + path + " lacks " + name + "; rebuild remat.");
  }
  out = reinterpret_cast<F>(symbol);
}

ShimApi open_shim() {
  std::vector<std::string> candidates;
#ifdef REMAT_SENTENCEPIECE_LIB
  candidates.emplace_back(REMAT_SENTENCEPIECE_LIB);
#endif
  candidates.push_back(executable_dir() + "/" + kShimName);

  std::string tried;
  for (const std::string& path : candidates) {
    // RTLD_LOCAL keeps SentencePiece's bundled protobuf out of the global scope and
    // RTLD_DEEPBIND makes the shim and its dependencies prefer their own copies over
    // LibTorch's libprotobuf: the two never see each other. Never closed: unloading
    // libraries with static protobuf state is not safe.
    void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (library == nullptr) {
      const char* error = ::dlerror();
      tried += (tried.empty() ? "" : "; ") + (error ? std::string(error) : path);
      continue;
    }
    ShimApi api{};
    resolve(library, path, "remat_sp_abi_version", api.abi_version);
    if (api.abi_version() != REMAT_SP_ABI_VERSION) {
      throw std::runtime_error("The SentencePiece helper library " + path +
                               " is from another version of remat; rebuild remat.");
    }
    resolve(library, path, "remat_sp_last_error", api.last_error);
    resolve(library, path, "remat_sp_train", api.train);
    resolve(library, path, "remat_sp_load", api.load);
    resolve(library, path, "remat_sp_free", api.free_model);
    resolve(library, path, "remat_sp_vocab_size", api.vocab_size);
    resolve(library, path, "remat_sp_special_id", api.special_id);
    resolve(library, path, "remat_sp_piece_to_id", api.piece_to_id);
    resolve(library, path, "remat_sp_id_to_piece", api.id_to_piece);
    resolve(library, path, "remat_sp_encode", api.encode);
    resolve(library, path, "remat_sp_decode", api.decode);
    resolve(library, path, "remat_sp_free_buffer", api.free_buffer);
    return api;
  }
  throw std::runtime_error(std::string("Cannot load the SentencePiece helper library ") + kShimName + " (" + tried +
                           "); build the remat_sentencepiece target or keep the library next "
                           "to the remat executable.");
}

// A failed static initialisation is retried on the next call, so a library that
// appears later (e.g. built meanwhile) is still picked up.
const ShimApi& shim() {
  static const ShimApi api = open_shim();
  return api;
}

// Owns a buffer malloc'ed by the shim.
template <typename T>
struct ShimBuffer {
  T* data = nullptr;
  size_t size = 0;
  ~ShimBuffer() {
    if (data != nullptr) shim().free_buffer(data);
  }
};

[[noreturn]] void shim_failure(const std::string& what) {
  std::string reason = shim().last_error();
  while (!reason.empty() && (reason.back() == '.' || std::isspace(static_cast<unsigned char>(reason.back())))) {
    reason.pop_back();
  }
  throw std::runtime_error(what + ": " + reason + ".");
}

// Training sentences: the text's non-empty lines, long ones cut so SentencePiece does not
// skip them (it ignores sentences over max_sentence_length bytes).
constexpr size_t kMaxSentenceBytes = 2048;

std::vector<std::string_view> training_sentences(std::string_view text) {
  std::vector<std::string_view> sentences;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    while (line.size() > kMaxSentenceBytes) {
      size_t cut = line.rfind(' ', kMaxSentenceBytes);
      if (cut == std::string_view::npos || cut == 0) {
        // No space: cut where a character starts, never before a UTF-8 continuation byte.
        cut = kMaxSentenceBytes;
        while (cut > 0 && (static_cast<unsigned char>(line[cut]) & 0xC0) == 0x80) --cut;
        if (cut == 0) cut = kMaxSentenceBytes;
      }
      sentences.push_back(line.substr(0, cut));
      line.remove_prefix(cut);
    }
    if (!line.empty()) sentences.push_back(line);
  }
  return sentences;
}

// A SentencePiece model's encoding of `text` line by line (its cost grows faster than a
// line's length, and no piece spans a newline in models trained here), on `threads`
// threads over contiguous parts; `line_starts` receives where each line's tokens begin.
std::vector<int32_t> encode_lines(const Tokenizer& tok, std::string_view text, std::vector<int64_t>& line_starts,
                                  int threads) {
  std::vector<size_t> bounds = {0};
  for (int part = 1; part < threads; ++part) {
    size_t cut = text.size() * static_cast<size_t>(part) / static_cast<size_t>(threads);
    cut = text.find('\n', std::max(cut, bounds.back()));
    bounds.push_back(cut == std::string_view::npos ? text.size() : cut + 1);
  }
  bounds.push_back(text.size());

  const auto encode = [&](size_t part, std::vector<int32_t>& ids, std::vector<int64_t>& starts) {
    size_t pos = bounds[part];
    while (pos < bounds[part + 1]) {
      size_t end = text.find('\n', pos);
      end = end == std::string_view::npos ? text.size() : end + 1;
      starts.push_back(static_cast<int64_t>(ids.size()));
      const std::vector<int32_t> line = tok.encode(text.substr(pos, end - pos));
      ids.insert(ids.end(), line.begin(), line.end());
      pos = end;
    }
  };
  return encode_parts(bounds.size() - 1, encode, line_starts);
}

}  // namespace

struct Tokenizer::Handle {
  remat_sp_model* model = nullptr;
  ~Handle() {
    if (model != nullptr) shim().free_model(model);
  }
};

Tokenizer::Tokenizer(std::shared_ptr<Handle> handle, std::shared_ptr<const ByteLevelBpe> bpe, std::string model)
    : handle_(std::move(handle)), bpe_(std::move(bpe)), model_(std::move(model)) {}

Tokenizer Tokenizer::train(std::string_view text, const TokenizerTrainOptions& options) {
  if (options.vocab_size < 260) {
    throw std::runtime_error(
        "A tokenizer vocabulary needs at least 260 pieces (3 special and "
        "256 byte pieces plus one), got " +
        std::to_string(options.vocab_size) + ".");
  }
  if (options.num_threads < 1) {
    throw std::runtime_error("Tokenizer training needs at least one thread, got " +
                             std::to_string(options.num_threads) + ".");
  }
  const std::vector<std::string_view> sentences = training_sentences(text);
  if (sentences.empty()) throw std::runtime_error("Cannot train a tokenizer on empty text.");

  std::vector<const char*> pointers;
  std::vector<size_t> lengths;
  pointers.reserve(sentences.size());
  lengths.reserve(sentences.size());
  int64_t total_bytes = 0;
  for (std::string_view s : sentences) {
    pointers.push_back(s.data());
    lengths.push_back(s.size());
    total_bytes += static_cast<int64_t>(s.size());
  }
  // SentencePiece caps by sentence count (0: no cap; a cap must exceed 100); convert the
  // byte cap with the mean sentence length.
  int64_t max_sentences = 0;
  if (total_bytes > options.max_training_bytes && options.max_training_bytes > 0) {
    max_sentences = std::max<int64_t>(
        101, static_cast<int64_t>(static_cast<double>(sentences.size()) *
                                  static_cast<double>(options.max_training_bytes) / static_cast<double>(total_bytes)));
  }

  const std::vector<std::pair<std::string, std::string>> spec = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", std::to_string(options.character_coverage)},
      {"num_threads", std::to_string(options.num_threads)},
      {"input_sentence_size", std::to_string(max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", std::to_string(2 * kMaxSentenceBytes)},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"split_digits", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", "2"},  // errors come back as a Status; the progress log is noise
  };
  std::vector<const char*> keys, values;
  for (const auto& [key, value] : spec) {
    keys.push_back(key.c_str());
    values.push_back(value.c_str());
  }

  ShimBuffer<char> model;
  if (shim().train(keys.data(), values.data(), spec.size(), pointers.data(), lengths.data(), pointers.size(),
                   options.seed, &model.data, &model.size) != 0) {
    // Too little text for the vocabulary: SentencePiece says so only as an internal check
    // with the most pieces it could make; say it as the text's size and what to change.
    const std::string reason = shim().last_error();
    const std::string most = "Please set it to a value <= ";
    const size_t at = reason.find(most);
    if (reason.find("Vocabulary size too high") != std::string::npos && at != std::string::npos) {
      const long pieces = std::strtol(reason.c_str() + at + most.size(), nullptr, 10);
      throw std::runtime_error(
          "The text is too small for a " + std::to_string(options.vocab_size) + "-piece vocabulary: its " +
          std::to_string(total_bytes) + " bytes (" + std::to_string(sentences.size()) +
          (sentences.size() == 1 ? " line" : " lines") + ") make at most " + std::to_string(pieces) +
          " BPE pieces (the 256 bytes among them); set data.vocab_size to at most " + std::to_string(pieces) +
          ", or give more text (the default corpus, the King James Bible, is 4 MB).");
    }
    // Too many distinct characters for the vocabulary: each needs a piece of its own
    // beside the 256 byte pieces and the 3 special ones (found by fuzzing; SentencePiece
    // says it as an internal check with the count it needs, after "vs").
    const std::string chars = "Vocabulary size is smaller than required_chars.";
    const size_t vs = reason.find(" vs ", reason.find(chars));
    if (reason.find(chars) != std::string::npos && vs != std::string::npos) {
      const long needed = std::strtol(reason.c_str() + vs + 4, nullptr, 10);
      throw std::runtime_error(
          "The text has " + std::to_string(needed - 3 - 256) +
          " distinct characters, each of which needs a piece of "
          "its own beside the 256 byte pieces and the 3 special ones, so a " +
          std::to_string(options.vocab_size) + "-piece vocabulary cannot hold them; set data.vocab_size to at least " +
          std::to_string(needed) + " (more leaves room for the merges that make tokens longer than a character).");
    }
    shim_failure("SentencePiece could not train a " + std::to_string(options.vocab_size) +
                 "-piece BPE tokenizer on this text");
  }
  std::string serialized(model.data, model.size);
  auto handle = std::make_shared<Handle>();
  handle->model = shim().load(serialized.data(), serialized.size());
  if (handle->model == nullptr) shim_failure("SentencePiece could not load the model it trained");
  return Tokenizer(std::move(handle), nullptr, std::move(serialized));
}

Tokenizer Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) {
    file = fs::exists(fs::path(path) / "tokenizer.json", ec) ? (fs::path(path) / "tokenizer.json").string()
                                                             : (fs::path(path) / "tokenizer.model").string();
    if (!fs::exists(file, ec)) {
      throw std::runtime_error("The folder " + util::printable(path) +
                               " holds neither tokenizer.json nor tokenizer.model; give a tokenizer file, or the "
                               "folder of a model that has one.");
    }
  }
  std::string bytes = util::read_file(file, "the tokenizer", kMaxTokenizerBytes);
  const size_t first = bytes.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || bytes[first] != '{') {
    auto handle = std::make_shared<Handle>();
    handle->model = shim().load(bytes.data(), bytes.size());
    if (handle->model == nullptr) {
      shim_failure("The tokenizer " + util::printable(file) +
                   " is neither a SentencePiece model nor a Hugging Face tokenizer.json");
    }
    return Tokenizer(std::move(handle), nullptr, std::move(bytes));
  }
  std::string json_text = std::move(bytes), config_text;
  if (std::string_view(json_text).substr(0, kBpeMarker.size()) == kBpeMarker) {
    try {
      const nlohmann::json saved = nlohmann::json::parse(json_text);
      config_text = saved.at("tokenizer_config.json").get<std::string>();
      json_text = saved.at("tokenizer.json").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error("The tokenizer " + util::printable(file) + " that remat saved is damaged (" + e.what() +
                               "); prepare the corpus again.");
    }
  } else {
    const fs::path config = fs::path(file).parent_path() / "tokenizer_config.json";
    if (fs::exists(config, ec)) {
      config_text = util::read_file(config.string(), "the tokenizer's config", kMaxTokenizerBytes);
    }
  }
  auto bpe = ByteLevelBpe::parse(json_text, config_text, file);
  std::string saved = nlohmann::json{{"format", "remat-byte-level-bpe"},
                                     {"tokenizer.json", std::move(json_text)},
                                     {"tokenizer_config.json", std::move(config_text)}}
                          .dump();
  return Tokenizer(nullptr, std::move(bpe), std::move(saved));
}

void Tokenizer::save(const std::string& model_path) const { util::write_file_atomically(model_path, model_); }

std::vector<std::pair<std::string, std::string>> Tokenizer::hf_files() const {
  if (!bpe_) return {};
  const nlohmann::json saved = nlohmann::json::parse(model_);
  std::vector<std::pair<std::string, std::string>> files{{"tokenizer.json", saved.at("tokenizer.json")}};
  if (std::string config = saved.at("tokenizer_config.json"); !config.empty()) {
    files.emplace_back("tokenizer_config.json", std::move(config));
  }
  return files;
}

std::string Tokenizer::kind() const { return bpe_ ? "byte-level BPE (Hugging Face)" : "SentencePiece BPE"; }

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  if (bpe_) return bpe_->encode(text);
  ShimBuffer<int32_t> ids;
  if (shim().encode(handle_->model, text.data(), text.size(), &ids.data, &ids.size) != 0) {
    shim_failure("SentencePiece could not encode the text");
  }
  return std::vector<int32_t>(ids.data, ids.data + ids.size);
}

std::vector<int32_t> Tokenizer::encode_text(std::string_view text, std::vector<int64_t>& line_starts,
                                            int threads) const {
  if (!bpe_) return encode_lines(*this, text, line_starts, std::max(threads, 1));
  std::vector<int64_t> starts;
  std::vector<int32_t> ids = bpe_->encode(text, &starts);
  line_starts.clear();
  size_t token = 0;
  for (size_t line = 0; line < text.size();) {
    while (token < starts.size() && starts[token] < static_cast<int64_t>(line)) ++token;
    line_starts.push_back(static_cast<int64_t>(token));
    const size_t newline = text.find('\n', line);
    if (newline == std::string_view::npos) break;
    line = newline + 1;
  }
  return ids;
}

std::string Tokenizer::decode(const int32_t* ids, size_t count) const {
  const int vocab = vocab_size();
  for (size_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      throw std::runtime_error("Cannot decode token id " + std::to_string(ids[i]) + " at position " +
                               std::to_string(i) + ": the vocabulary has " + std::to_string(vocab) + " pieces.");
    }
  }
  if (bpe_) return bpe_->decode(ids, count);
  ShimBuffer<char> text;
  if (shim().decode(handle_->model, ids, count, &text.data, &text.size) != 0) {
    shim_failure("SentencePiece could not decode the ids");
  }
  return std::string(text.data, text.size);
}

int Tokenizer::vocab_size() const { return bpe_ ? bpe_->vocab_size() : shim().vocab_size(handle_->model); }
int Tokenizer::unk_id() const { return bpe_ ? -1 : shim().special_id(handle_->model, REMAT_SP_UNK); }
int Tokenizer::bos_id() const { return bpe_ ? bpe_->bos_id() : shim().special_id(handle_->model, REMAT_SP_BOS); }
int Tokenizer::eos_id() const { return bpe_ ? bpe_->eos_id() : shim().special_id(handle_->model, REMAT_SP_EOS); }
int Tokenizer::pad_id() const { return bpe_ ? -1 : shim().special_id(handle_->model, REMAT_SP_PAD); }

std::string Tokenizer::piece(int id) const {
  if (bpe_) {
    if (id < 0 || id >= bpe_->vocab_size()) throw std::runtime_error("No piece for id " + std::to_string(id) + ".");
    return bpe_->token(id);
  }
  ShimBuffer<char> piece;
  if (shim().id_to_piece(handle_->model, id, &piece.data, &piece.size) != 0) {
    shim_failure("No piece for id " + std::to_string(id));
  }
  return std::string(piece.data, piece.size);
}

int Tokenizer::piece_to_id(std::string_view piece) const {
  if (bpe_) return bpe_->token_to_id(piece);
  return shim().piece_to_id(handle_->model, piece.data(), piece.size());
}

}  // namespace remat::data
