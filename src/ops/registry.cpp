// The op registry: every op definition, so that the tests that cover each op (its memory
// events, tests/graph/op_memory_test.cpp) cannot miss a new one.
#include "remat/ops/op.h"

namespace remat::graph {

std::vector<const OpDef*> op::all() {
  return {&layernorm(),
          &rmsnorm(),
          &linear(),
          &linears(),
          &attention(),
          &tiled_attention(),
          &sdpa_attention(),
          &dropout_mask(),
          &dropout(),
          &residual(),
          &gelu(),
          &swiglu(),
          &rope(),
          &view(),
          &split(),
          &embedding(),
          &position_embedding(),
          &cross_entropy(),
          &fused_cross_entropy(),
          &tp_copy(),
          &tp_reduce(),
          &sp_gather(),
          &sp_scatter()};
}

}  // namespace remat::graph
