#include "remat/tokenizer.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <stdexcept>

#include "data/sentencepiece_shim.h"
#include "util/atomic_file.h"

namespace remat::data {

namespace {

constexpr const char* kShimName = "libremat_sentencepiece.so";

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

}  // namespace

struct Tokenizer::Handle {
  remat_sp_model* model = nullptr;
  ~Handle() {
    if (model != nullptr) shim().free_model(model);
  }
};

Tokenizer::Tokenizer(std::shared_ptr<Handle> handle, std::string model)
    : handle_(std::move(handle)), model_(std::move(model)) {}

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
  return Tokenizer(std::move(handle), std::move(serialized));
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  std::string serialized = util::read_file(model_path, "the tokenizer model");
  auto handle = std::make_shared<Handle>();
  handle->model = shim().load(serialized.data(), serialized.size());
  if (handle->model == nullptr) {
    shim_failure("The tokenizer model " + model_path + " is not a valid SentencePiece model");
  }
  return Tokenizer(std::move(handle), std::move(serialized));
}

void Tokenizer::save(const std::string& model_path) const { util::write_file_atomically(model_path, model_); }

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  ShimBuffer<int32_t> ids;
  if (shim().encode(handle_->model, text.data(), text.size(), &ids.data, &ids.size) != 0) {
    shim_failure("SentencePiece could not encode the text");
  }
  return std::vector<int32_t>(ids.data, ids.data + ids.size);
}

std::string Tokenizer::decode(const int32_t* ids, size_t count) const {
  const int vocab = vocab_size();
  for (size_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      throw std::runtime_error("Cannot decode token id " + std::to_string(ids[i]) + " at position " +
                               std::to_string(i) + ": the vocabulary has " + std::to_string(vocab) + " pieces.");
    }
  }
  ShimBuffer<char> text;
  if (shim().decode(handle_->model, ids, count, &text.data, &text.size) != 0) {
    shim_failure("SentencePiece could not decode the ids");
  }
  return std::string(text.data, text.size);
}

int Tokenizer::vocab_size() const { return shim().vocab_size(handle_->model); }
int Tokenizer::unk_id() const { return shim().special_id(handle_->model, REMAT_SP_UNK); }
int Tokenizer::bos_id() const { return shim().special_id(handle_->model, REMAT_SP_BOS); }
int Tokenizer::eos_id() const { return shim().special_id(handle_->model, REMAT_SP_EOS); }
int Tokenizer::pad_id() const { return shim().special_id(handle_->model, REMAT_SP_PAD); }

std::string Tokenizer::piece(int id) const {
  ShimBuffer<char> piece;
  if (shim().id_to_piece(handle_->model, id, &piece.data, &piece.size) != 0) {
    shim_failure("No piece for id " + std::to_string(id));
  }
  return std::string(piece.data, piece.size);
}

int Tokenizer::piece_to_id(std::string_view piece) const {
  return shim().piece_to_id(handle_->model, piece.data(), piece.size());
}

}  // namespace remat::data
