// The C interface of libremat_sentencepiece.so, the one place SentencePiece is linked.
//
// Why a separate library: Debian's libsentencepiece bundles its own copy of protobuf and
// exports those symbols. Linked into a process that also loads libprotobuf.so.32 (as
// LibTorch does), libprotobuf's static initialisers bind to SentencePiece's copies and the
// process crashes at load time. remat_core therefore opens this library with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND) and talks to it only through the plain C functions
// below: no C++ type and no SentencePiece symbol ever crosses the boundary.
//
// Conventions: functions returning int return 0 on success and -1 on failure, with the
// reason in remat_sp_last_error() (per thread). Buffers handed out (*_out) are allocated
// with malloc inside the library and must be released with remat_sp_free_buffer.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/// Bumped whenever a signature below changes, so a stale library found next to the
/// executable is refused instead of called with the wrong arguments.
#define REMAT_SP_ABI_VERSION 1

typedef struct remat_sp_model remat_sp_model;  // opaque SentencePieceProcessor

/// Which special id remat_sp_special_id returns.
enum remat_sp_special { REMAT_SP_UNK = 0, REMAT_SP_BOS = 1, REMAT_SP_EOS = 2, REMAT_SP_PAD = 3 };

int remat_sp_abi_version(void);

/// The message of the last failure on this thread ("" if none). Owned by the library,
/// valid until the next call on this thread.
const char* remat_sp_last_error(void);

/// Trains a model from `num_sentences` in-memory sentences (sentences[i] has lengths[i]
/// bytes, no terminator needed). `keys`/`values` are SentencePiece trainer options
/// (e.g. "model_type" -> "bpe"); `seed` seeds SentencePiece's sampling of sentences.
/// On success *model_out holds the serialized model proto (*model_size bytes); nothing
/// is written to disk.
int remat_sp_train(const char* const* keys, const char* const* values, size_t num_options, const char* const* sentences,
                   const size_t* lengths, size_t num_sentences, uint32_t seed, char** model_out, size_t* model_size);

/// Loads a serialized model proto; returns NULL on failure. Free with remat_sp_free.
remat_sp_model* remat_sp_load(const char* model, size_t size);
void remat_sp_free(remat_sp_model* model);

int remat_sp_vocab_size(const remat_sp_model* model);
/// The id of a special token (enum remat_sp_special); -1 if the model has none.
int remat_sp_special_id(const remat_sp_model* model, int which);
/// The id of `piece`, or the unknown id if the vocabulary does not contain it.
int remat_sp_piece_to_id(const remat_sp_model* model, const char* piece, size_t length);
int remat_sp_id_to_piece(const remat_sp_model* model, int id, char** piece_out, size_t* length);

int remat_sp_encode(const remat_sp_model* model, const char* text, size_t length, int32_t** ids_out, size_t* num_ids);
int remat_sp_decode(const remat_sp_model* model, const int32_t* ids, size_t num_ids, char** text_out, size_t* length);

void remat_sp_free_buffer(void* buffer);

#ifdef __cplusplus
}  // extern "C"
#endif
