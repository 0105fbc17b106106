// A vocabulary split over the ranks of a tensor-parallel group, as Megatron's
// vocabulary-parallel embedding and loss split it: rank r of t holds the rows
// [r V/t, (r+1) V/t) of the [V, C] table as a [V/t, C] weight. The token embedding and the
// loss head take the share their weight holds; ids and targets stay global.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace remat::ops {

/// Which vocabulary rows a weight of `rows` rows holds: [offset, offset + rows) of `vocab`.
struct VocabShard {
  int64_t offset = 0;  ///< the vocabulary row of the weight's first row
  int64_t vocab = 0;   ///< the whole vocabulary's size, which ids are range-checked against

  /// Rank `rank`'s share of `ranks` equal ones of `rows` rows each.
  static VocabShard of_rank(int rank, int ranks, int64_t rows) { return {rank * rows, ranks * rows}; }

  /// Refuses a share that does not lie in the vocabulary, naming `op` ("embedding").
  void check(const char* op, int64_t rows) const {
    TORCH_CHECK(rows >= 1 && offset >= 0 && offset + rows <= vocab, "[", op, "] a weight of ", rows,
                " vocabulary rows from row ", offset, " must lie in the vocabulary of ", vocab, " rows");
  }
};

/// Global ids seen from one share of `rows` rows.
struct ShardIds {
  at::Tensor rows;     ///< the ids' shape, int64: id - offset clamped into [0, rows), safe to gather
  at::Tensor foreign;  ///< the ids' shape, bool: ids outside the share (their gathered row is not theirs)
};

/// `ids` (int64, any shape) seen from `shard`, whose weight has `rows` rows.
inline ShardIds shard_ids(const at::Tensor& ids, const VocabShard& shard, int64_t rows) {
  return {(ids - shard.offset).clamp_(0, rows - 1), ids.lt(shard.offset).logical_or_(ids.ge(shard.offset + rows))};
}

}  // namespace remat::ops
