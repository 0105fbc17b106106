// Helpers shared by the op tests: float64 comparison against autograd references.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

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

}  // namespace remat::testing
