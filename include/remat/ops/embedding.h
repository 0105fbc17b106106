// Token embedding (a row gather) and learned position embedding.
#pragma once

#include "remat/ops/common.h"
#include "remat/ops/vocab_shard.h"

#include <optional>

namespace remat::ops {

struct EmbeddingSaved {
  at::Tensor ids;                   ///< token ids, [...] int64
  std::optional<VocabShard> shard;  ///< the rows w holds, when it holds a share of the vocabulary
  std::vector<at::Tensor> tensors() const { return {ids}; }
};

/// y[..., C] = w[ids[...], :] for w [V, C]. Ids outside [0, V) are refused (this reads the
/// ids' range back to the host).
/// With `shard`, w [V/t, C] holds the vocabulary rows [offset, offset + V/t) of V =
/// shard->vocab (the ids stay global): an id in them takes w[id - offset], any other id a
/// zero row, so the ranks' outputs sum to the whole table's rows (the tensor-parallel
/// all-reduce after the op does that sum).
Fwd<EmbeddingSaved> embedding_forward(const at::Tensor& ids, const at::Tensor& w,
                                      std::optional<VocabShard> shard = std::nullopt);
/// Accumulates dw[V, C] (scatter-add of dy rows, no [V, C] temporary); ids get no gradient.
/// With saved.shard, only the rows of ids in the share, into dw [V/t, C].
void embedding_backward(const at::Tensor& dy, const EmbeddingSaved& saved, at::Tensor& dw);
/// Bytes EmbeddingSaved holds for `tokens` ids (int64 each).
int64_t embedding_saved_bytes(int64_t tokens);

struct PositionEmbeddingSaved {
  int64_t seq_len = 0;  ///< positions first..first+seq_len-1 were used; no tensor is needed
  int64_t first = 0;
  std::vector<at::Tensor> tensors() const { return {}; }
};

/// y[T, C] = w[first:first+T, :] for w [max_positions, C]; broadcast-added to [B, T, C] by
/// the caller (`first` > 0: a sequence-parallel rank's positions). y is a view of w's rows
/// (no copy). Refuses first + T > max_positions (and T < 1) with the model's context length
/// in the message.
Fwd<PositionEmbeddingSaved> position_embedding_forward(int64_t seq_len, const at::Tensor& w, int64_t first = 0);
/// dy is [..., T, C]; accumulates its sum over leading dims into dw[first:first+T, :].
void position_embedding_backward(const at::Tensor& dy, const PositionEmbeddingSaved& saved, at::Tensor& dw);

}  // namespace remat::ops
