// Tests of model.attention = sdpa where this build's LibTorch lacks ATen's fused attention.
#pragma once

#include "remat/attention.h"
#include "remat/ops/attention.h"

#include <gtest/gtest.h>

/// Skips the test, saying why, where this build has no sdpa op (LibTorch before 2.9).
#define REMAT_SKIP_WITHOUT_SDPA()                                                                         \
  do {                                                                                                    \
    if (!::remat::kSdpaBuilt)                                                                             \
      GTEST_SKIP() << ::remat::ops::attention_refusal(::remat::Attention::sdpa, 0, false, at::kFloat, 8); \
  } while (false)
