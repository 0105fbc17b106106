// The bytes a model's Saved structs hold, measured on a real forward, equal the sum of
// what its ops report from shapes alone: the basis of every memory prediction.
#include "remat/model.h"
#include "remat/ops.h"

#include <gtest/gtest.h>

namespace remat {
namespace {

using namespace remat::ops;

ActivationBytes measure(const ModelConfig& cfg, int64_t B, int64_t T) {
  auto model = Model::create(cfg, at::kCPU, at::kFloat, 1);
  auto gen = at::detail::createCPUGenerator(1);
  auto tok = at::randint(cfg.vocab_size, {B, T}, gen, at::kLong);
  auto tgt = at::randint(cfg.vocab_size, {B, T}, gen, at::kLong);
  ActivationBytes m;
  model->forward_backward(tok, tgt, {1, 0, 0}, 1.0, 64, &m);
  return m;
}

// What the loss op of each head keeps beside the final norm's.
int64_t loss_saved_bytes(const ModelConfig& c, int64_t N, at::ScalarType f) {
  return c.loss_head == LossHead::fused ? fused_cross_entropy_saved_bytes(N, c.d_model, c.vocab_size, f)
                                        : cross_entropy_saved_bytes(N, c.d_model, f);
}

TEST(ModelBytes, Gpt2SavedBytesEqualTheOpsReports) {
  for (auto [p, head] : {std::pair{0.0, LossHead::fused}, {0.1, LossHead::fused}, {0.1, LossHead::recompute}}) {
    ModelConfig c = model_preset("tiny-gpt2");
    c.dropout = p;
    c.loss_head = head;
    const int64_t B = 3, T = 11, N = B * T, C = c.d_model, F = c.d_ff;
    const auto f = at::kFloat;
    const ActivationBytes m = measure(c, B, T);
    const int64_t block = 2 * layernorm_saved_bytes(N, C, f) + linear_saved_bytes(N, C, f) +
                          attention_saved_bytes({B, T, c.n_head, c.n_head, c.head_dim()}, p, f) +
                          linear_saved_bytes(N, C, f) + dropout_saved_bytes(N * C, p) + linear_saved_bytes(N, C, f) +
                          gelu_saved_bytes(N * F, f) + linear_saved_bytes(N, F, f) + dropout_saved_bytes(N * C, p);
    ASSERT_EQ(m.blocks.size(), static_cast<size_t>(c.n_layer));
    for (int64_t b : m.blocks) EXPECT_EQ(b, block) << "p=" << p;
    EXPECT_EQ(m.embedding, embedding_saved_bytes(N) + dropout_saved_bytes(N * C, p));
    EXPECT_EQ(m.head, layernorm_saved_bytes(N, C, f) + loss_saved_bytes(c, N, f)) << loss_head_name(head);
  }
}

TEST(ModelBytes, LlamaSavedBytesEqualTheOpsReports) {
  for (auto [p, head] : {std::pair{0.0, LossHead::fused}, {0.2, LossHead::fused}, {0.2, LossHead::recompute}}) {
    ModelConfig c = model_preset("tiny-llama");
    c.dropout = p;
    c.loss_head = head;
    const int64_t B = 2, T = 13, N = B * T, C = c.d_model, F = c.d_ff;
    const auto f = at::kFloat;
    const ActivationBytes m = measure(c, B, T);
    // q/k/v read one saved normed input, gate/up another.
    const int64_t block = 2 * rmsnorm_saved_bytes(N, C, f) + linear_saved_bytes(N, C, f) +
                          attention_saved_bytes({B, T, c.n_head, c.n_kv_head, c.head_dim()}, p, f) +
                          linear_saved_bytes(N, C, f) + linear_saved_bytes(N, C, f) + swiglu_saved_bytes(N * F, f) +
                          linear_saved_bytes(N, F, f);
    for (int64_t b : m.blocks) EXPECT_EQ(b, block) << "p=" << p;
    EXPECT_EQ(m.embedding, embedding_saved_bytes(N));
    EXPECT_EQ(m.head, rmsnorm_saved_bytes(N, C, f) + loss_saved_bytes(c, N, f)) << loss_head_name(head);
  }
}

}  // namespace
}  // namespace remat
