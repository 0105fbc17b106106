// Models and helpers shared by the checkpoint tests.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/utils.h>

#include "util/seeded.h"

#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace remat::testing {

// LayerNorm -> Linear -> GELU -> Dropout -> Linear, plus the residual.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t d, int64_t hidden, double p)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, hidden))),
        drop(register_module("drop", torch::nn::Dropout(p))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, d))) {}

  at::Tensor forward(const at::Tensor& x) { return x + fc2(drop(at::gelu(fc1(norm(x))))); }

  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;
};
TORCH_MODULE(MlpBlock);

// Pre-norm self-attention (with attention dropout) and an MLP block; x is [seq, batch, d].
struct AttentionBlockImpl : torch::nn::Module {
  AttentionBlockImpl(int64_t d, int64_t heads, double p)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        attn(register_module("attn",
                             torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(d, heads).dropout(p)))),
        mlp(register_module("mlp", MlpBlock(d, 4 * d, p))) {}

  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = norm(x);
    const at::Tensor a = std::get<0>(attn(h, h, h));
    return mlp(x + a);
  }

  torch::nn::LayerNorm norm;
  torch::nn::MultiheadAttention attn;
  MlpBlock mlp;
};
TORCH_MODULE(AttentionBlock);

/// Same dtype, shape and bytes (0.0 and -0.0 differ; NaNs compare by payload).
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) {
    return false;
  }
  if (!a.defined()) {
    return true;
  }
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
    return false;
  }
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  // An empty tensor's data pointer may be null, which memcmp must not see.
  return ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

inline void expect_bitwise_equal(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(got[i], want[i])) << what << " #" << i;
  }
}

inline void clear_grads(torch::nn::Module& m) {
  for (at::Tensor& p : m.parameters()) {
    p.mutable_grad().reset();
  }
}

/// Runs `body`, expecting a c10::Error whose message (without backtrace) contains `needle`.
inline void expect_error(const std::function<void()>& body, const std::string& needle) {
  try {
    body();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(needle), std::string::npos) << "message was: " << msg;
    return;
  }
  ADD_FAILURE() << "expected an error containing: " << needle;
}

/// Bitwise comparisons on CPU need a fixed intra-op thread count for the whole test.
class FixedThreads {
 public:
  FixedThreads() : saved_(at::get_num_threads()) { at::set_num_threads(1); }
  ~FixedThreads() { at::set_num_threads(saved_); }

 private:
  int saved_;
};

}  // namespace remat::testing
