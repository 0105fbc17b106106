// All explicit ops. See remat/ops/common.h for the contract they share.
#pragma once

#include "remat/ops/attention.h"
#include "remat/ops/common.h"
#include "remat/ops/cross_entropy.h"
#include "remat/ops/dropout.h"
#include "remat/ops/embedding.h"
#include "remat/ops/gelu.h"
#include "remat/ops/layernorm.h"
#include "remat/ops/linear.h"
#include "remat/ops/residual.h"
#include "remat/ops/rmsnorm.h"
#include "remat/ops/rope.h"
#include "remat/ops/sdpa_attention.h"
#include "remat/ops/swiglu.h"
#include "remat/ops/tiled_attention.h"
