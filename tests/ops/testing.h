// Helpers shared by the op tests: float64 comparison against autograd references.
#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "util/seeded.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace remat::testing {

inline at::TensorOptions f64() { return at::TensorOptions().dtype(at::kDouble); }

/// Largest absolute difference relative to the largest magnitude of `want`.
inline double rel_err(const at::Tensor& got, const at::Tensor& want) {
  EXPECT_EQ(got.sizes(), want.sizes());
  if (got.sizes() != want.sizes()) return 1.0;
  const double scale = want.abs().max().item<double>();
  const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

/// Largest absolute difference divided by `scale`. For a result that is a difference of
/// terms of magnitude `scale`, two correct implementations round those terms differently
/// by a few ulps of `scale`, however far the result itself cancels below it: the error
/// relative to the result would then measure the cancellation, not the implementation.
inline double err_over(const at::Tensor& got, const at::Tensor& want, double scale) {
  EXPECT_EQ(got.sizes(), want.sizes());
  if (got.sizes() != want.sizes()) return 1.0;
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / scale;
}

/// A leaf that requires grad, for building the autograd reference.
inline at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

/// Gradients of sum(out * dout) with respect to `inputs`, through LibTorch autograd.
inline std::vector<at::Tensor> grads(const at::Tensor& out, const at::Tensor& dout,
                                     const std::vector<at::Tensor>& inputs) {
  return torch::autograd::grad({out}, inputs, {dout});
}

/// Whether two tensors share any storage (a Saved tensor aliasing an input, say).
inline bool same_storage(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.storage().is_alias_of(b.storage());
}

/// Runs `fn`, expecting a c10::Error whose message contains every string of `parts`.
template <class F>
void expect_error(F&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning " << parts.front();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

/// Sums 2 m k n over the matrix products (mm, bmm, addmm, baddbmm, in place too) that LibTorch runs on
/// this thread while the counter lives: an op's matmul FLOPs read from what it executes.
class MatmulFlopCounter {
 public:
  MatmulFlopCounter() {
    total() = 0;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_start).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
  ~MatmulFlopCounter() { at::removeCallback(handle_); }
  MatmulFlopCounter(const MatmulFlopCounter&) = delete;
  MatmulFlopCounter& operator=(const MatmulFlopCounter&) = delete;
  double flops() const { return total(); }

 private:
  static double& total() {
    thread_local double t = 0;
    return t;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    const auto in = fn.inputs();
    // a [.., m, k] times b [.., k, n]: 2 * numel(a) * n.
    auto add = [](const c10::IValue& a, const c10::IValue& b) {
      total() += 2.0 * a.toTensor().numel() * b.toTensor().size(-1);
    };
    if (name == "aten::mm" || name == "aten::bmm") add(in[0], in[1]);
    if (name == "aten::addmm" || name == "aten::addmm_" || name == "aten::baddbmm" || name == "aten::baddbmm_") {
      add(in[1], in[2]);
    }
    return nullptr;
  }
  at::CallbackHandle handle_;
};

/// Causal attention written out head by head, for autograd to differentiate: K and V
/// repeated to the query heads, explicit masked scores, softmax as exp / sum, dropout as a
/// multiply by the given keep-mask [B, Hq, T, T] (ignored when p == 0). q [B, T, Hq, D],
/// k, v [B, T, Hkv, D]; returns [B, T, Hq, D].
inline at::Tensor attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double p,
                                      const at::Tensor& mask) {
  const int64_t T = q.size(1), D = q.size(3), G = q.size(2) / k.size(2);
  at::Tensor qh = q.transpose(1, 2);                          // [B, Hq, T, D]
  at::Tensor kh = k.repeat_interleave(G, 2).transpose(1, 2);  // [B, Hq, T, D]
  at::Tensor vh = v.repeat_interleave(G, 2).transpose(1, 2);
  at::Tensor scores = at::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(double(D));
  at::Tensor future = at::ones({T, T}, at::kBool).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  at::Tensor e = at::exp(scores - std::get<0>(scores.max(-1, true)).detach());
  at::Tensor probs = e / e.sum(-1, true);
  if (p > 0) probs = probs * mask.to(probs.scalar_type()) / (1 - p);
  return at::matmul(probs, vh).transpose(1, 2);
}

}  // namespace remat::testing
