// libremat_sentencepiece.so: SentencePiece behind a C interface (see sentencepiece_shim.h
// for why it is a separate, dlopen'ed library). Built without LibTorch or the project's
// precompiled header; nothing here may throw across the C boundary.
#include "data/sentencepiece_shim.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#define REMAT_SP_EXPORT extern "C" __attribute__((visibility("default")))

struct remat_sp_model {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

// The status SentencePiece's API returns: sentencepiece::util::Status up to 0.1.x,
// absl::Status from 0.2 on. Both have the same codes and a (code, message) constructor.
using Status = decltype(std::declval<sentencepiece::SentencePieceProcessor&>().status());
using StatusCode = decltype(std::declval<const Status&>().code());

thread_local std::string last_error;

int fail(const std::string& message) {
  last_error = message;
  return -1;
}

// Runs `body`, turning a failed Status or any exception into -1 and a message.
template <typename F>
int guarded(F&& body) {
  try {
    const Status status = body();
    if (!status.ok()) return fail(status.ToString());
    last_error.clear();
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown exception inside SentencePiece");
  }
}

// Copies bytes into a malloc'ed buffer the caller frees with remat_sp_free_buffer.
template <typename T>
Status copy_out(const T* data, size_t count, T** out) {
  *out = static_cast<T*>(std::malloc(count == 0 ? 1 : count * sizeof(T)));
  if (*out == nullptr) {
    return Status(StatusCode::kResourceExhausted, "out of memory");
  }
  if (count != 0) std::memcpy(*out, data, count * sizeof(T));
  return Status();
}

// Feeds the caller's in-memory sentences to the trainer without a temporary file.
class ArrayIterator : public sentencepiece::SentenceIterator {
 public:
  ArrayIterator(const char* const* sentences, const size_t* lengths, size_t count)
      : sentences_(sentences), lengths_(lengths), count_(count) {
    load();
  }
  bool done() const override { return index_ >= count_; }
  void Next() override {
    ++index_;
    load();
  }
  const std::string& value() const override { return value_; }
  Status status() const override { return Status(); }

 private:
  void load() {
    if (index_ < count_) value_.assign(sentences_[index_], lengths_[index_]);
  }
  const char* const* sentences_;
  const size_t* lengths_;
  size_t count_;
  size_t index_ = 0;
  std::string value_;
};

}  // namespace

REMAT_SP_EXPORT int remat_sp_abi_version(void) { return REMAT_SP_ABI_VERSION; }

REMAT_SP_EXPORT const char* remat_sp_last_error(void) { return last_error.c_str(); }

REMAT_SP_EXPORT int remat_sp_train(const char* const* keys, const char* const* values, size_t num_options,
                                   const char* const* sentences, const size_t* lengths, size_t num_sentences,
                                   uint32_t seed, char** model_out, size_t* model_size) {
  return guarded([&] {
    std::unordered_map<std::string, std::string> options;
    for (size_t i = 0; i < num_options; ++i) options[keys[i]] = values[i];
    // SentencePiece reseeds its sampler from this global before each training run.
    sentencepiece::SetRandomGeneratorSeed(seed);
    ArrayIterator iterator(sentences, lengths, num_sentences);
    std::string model;
    auto status = sentencepiece::SentencePieceTrainer::Train(options, &iterator, &model);
    if (!status.ok()) return status;
    *model_size = model.size();
    return copy_out(model.data(), model.size(), model_out);
  });
}

REMAT_SP_EXPORT remat_sp_model* remat_sp_load(const char* model, size_t size) {
  remat_sp_model* handle = nullptr;
  const int rc = guarded([&] {
    auto owned = std::make_unique<remat_sp_model>();
    auto status = owned->processor.LoadFromSerializedProto(std::string(model, size));
    if (status.ok()) handle = owned.release();
    return status;
  });
  return rc == 0 ? handle : nullptr;
}

REMAT_SP_EXPORT void remat_sp_free(remat_sp_model* model) { delete model; }

REMAT_SP_EXPORT int remat_sp_vocab_size(const remat_sp_model* model) { return model->processor.GetPieceSize(); }

REMAT_SP_EXPORT int remat_sp_special_id(const remat_sp_model* model, int which) {
  const auto& p = model->processor;
  switch (which) {
    case REMAT_SP_UNK:
      return p.unk_id();
    case REMAT_SP_BOS:
      return p.bos_id();
    case REMAT_SP_EOS:
      return p.eos_id();
    case REMAT_SP_PAD:
      return p.pad_id();
    default:
      return -1;
  }
}

REMAT_SP_EXPORT int remat_sp_piece_to_id(const remat_sp_model* model, const char* piece, size_t length) {
  return model->processor.PieceToId(std::string_view(piece, length));
}

REMAT_SP_EXPORT int remat_sp_id_to_piece(const remat_sp_model* model, int id, char** piece_out, size_t* length) {
  return guarded([&] {
    if (id < 0 || id >= model->processor.GetPieceSize()) {
      return Status(StatusCode::kOutOfRange, "token id " + std::to_string(id) + " is outside the vocabulary");
    }
    const std::string& piece = model->processor.IdToPiece(id);
    *length = piece.size();
    return copy_out(piece.data(), piece.size(), piece_out);
  });
}

REMAT_SP_EXPORT int remat_sp_encode(const remat_sp_model* model, const char* text, size_t length, int32_t** ids_out,
                                    size_t* num_ids) {
  return guarded([&] {
    std::vector<int> ids;
    auto status = model->processor.Encode(std::string_view(text, length), &ids);
    if (!status.ok()) return status;
    static_assert(sizeof(int) == sizeof(int32_t), "SentencePiece ids are int");
    *num_ids = ids.size();
    return copy_out(reinterpret_cast<const int32_t*>(ids.data()), ids.size(), ids_out);
  });
}

REMAT_SP_EXPORT int remat_sp_decode(const remat_sp_model* model, const int32_t* ids, size_t num_ids, char** text_out,
                                    size_t* length) {
  return guarded([&] {
    std::string text;
#ifdef ABSL_TYPES_SPAN_H_
    // SentencePiece 0.2 (built on absl) reads the ids in place and deprecates its
    // std::vector overload, the only one 0.1 has.
    auto status = model->processor.Decode(absl::Span<const int>(ids, num_ids), &text);
#else
    auto status = model->processor.Decode(std::vector<int>(ids, ids + num_ids), &text);
#endif
    if (!status.ok()) return status;
    *length = text.size();
    return copy_out(text.data(), text.size(), text_out);
  });
}

REMAT_SP_EXPORT void remat_sp_free_buffer(void* buffer) { std::free(buffer); }
