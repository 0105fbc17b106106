// What a checkpointed stack keeps, measured by the tracking allocator against bytes
// derived from the shapes and the policy's plan.
#include "remat/checkpoint.h"
#include "remat/memory.h"

#include "checkpoint/checkpoint_test_util.h"

#include <ATen/Context.h>

namespace {

using remat::testing::clear_grads;
using remat::testing::seeded;

constexpr int64_t kBatch = 256;
constexpr int64_t kDim = 16;
constexpr int64_t kHidden = 256;
constexpr size_t kBlocks = 8;
constexpr int64_t kFloat = sizeof(float);

// y = x + fc2(tanh(fc1(x))). Autograd keeps per block: fc1's input x (the block input)
// and tanh's result t (saved by tanh and by fc2); the rest dies within the block.
struct TanhBlockImpl : torch::nn::Module {
  TanhBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kDim, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kDim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(fc1(x).tanh()); }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(TanhBlock);

constexpr int64_t kInputBytes = kBatch * kDim * kFloat;          // a block input (and output)
constexpr int64_t kActivationBytes = kBatch * kHidden * kFloat;  // t, one per block

int64_t rng_state_bytes() {
  return static_cast<int64_t>(at::globalContext().defaultGenerator(at::kCPU).get_state().nbytes());
}

// Bytes a forward pass leaves behind under `segments` (the model's input excluded): every
// plain module keeps its t; every checkpointed segment keeps a generator state; block
// output i is kept when it is the stack's output or the input of module i+1 and that
// module is plain or starts a checkpointed segment (inside a segment it is dropped).
int64_t expected_retained(const std::vector<remat::CheckpointSegment>& segments) {
  int64_t bytes = 0;
  std::vector<bool> input_kept(kBlocks + 1, false);
  input_kept[kBlocks] = true;  // the stack's output
  for (const auto& seg : segments) {
    if (seg.checkpointed) {
      bytes += rng_state_bytes();
      input_kept[seg.begin] = true;
    } else {
      for (size_t i = seg.begin; i < seg.end; ++i) {
        bytes += kActivationBytes;
        input_kept[i] = true;
      }
    }
  }
  for (size_t i = 1; i <= kBlocks; ++i) {
    bytes += input_kept[i] ? kInputBytes : 0;
  }
  return bytes;
}

struct Measured {
  int64_t retained = 0;       // after forward
  int64_t forward_peak = 0;   // during forward
  int64_t backward_peak = 0;  // during forward and backward
};

class CheckpointMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    remat::memory::install_cpu_tracking();
    torch::manual_seed(0);
    for (size_t i = 0; i < kBlocks; ++i) {
      stack_->push_back(TanhBlock());
    }
    input_ = at::randn({kBatch, kDim}, seeded(1)).requires_grad_(true);
  }

  Measured measure(const std::string& policy, bool reentrant) {
    remat::CheckpointOptions o;
    o.use_reentrant = reentrant;
    const remat::CheckpointedStack stack = remat::apply_checkpointing(stack_, policy, o);
    return measure([&](const at::Tensor& x) { return stack.forward(x); });
  }

  Measured measure(const std::function<at::Tensor(const at::Tensor&)>& forward) {
    clear_grads(*stack_);
    input_.mutable_grad().reset();
    const at::Device cpu(at::kCPU);
    Measured m;
    remat::memory::reset_peak(cpu);
    const int64_t base = remat::memory::stats(cpu).current;
    {
      at::Tensor out = forward(input_);
      m.retained = remat::memory::stats(cpu).current - base;
      m.forward_peak = remat::memory::stats(cpu).peak - base;
      out.sum().backward();
    }
    m.backward_peak = remat::memory::stats(cpu).peak - base;
    return m;
  }

  torch::nn::Sequential stack_;
  at::Tensor input_;
};

TEST_F(CheckpointMemory, ForwardKeepsExactlyWhatThePlanSays) {
  for (const bool reentrant : {false, true}) {
    for (const char* policy : {"none", "full", "every:2", "every:3", "uniform:2", "uniform:3"}) {
      SCOPED_TRACE(std::string(policy) + (reentrant ? " reentrant" : " non-reentrant"));
      const int64_t want = expected_retained(remat::plan_checkpoint_segments(policy, kBlocks));
      EXPECT_EQ(measure(policy, reentrant).retained, want);
    }
  }
}

TEST_F(CheckpointMemory, FullKeepsBlockInputsInsteadOfActivations) {
  const int64_t n = static_cast<int64_t>(kBlocks);
  const Measured plain = measure("none", false);
  EXPECT_GE(plain.retained, n * (kInputBytes + kActivationBytes));

  const Measured full = measure("full", false);
  EXPECT_LE(full.retained, n * (kInputBytes + rng_state_bytes()));
  // While a block runs it also holds fc1's output, t, fc2's output and its own output.
  const int64_t block_working_set = 2 * kActivationBytes + 2 * kInputBytes;
  EXPECT_LE(full.forward_peak, n * (kInputBytes + rng_state_bytes()) + block_working_set);

  // Backward adds the parameter gradients, and one block at a time: its recomputed
  // activations and the gradients flowing through it (at most as many again).
  int64_t param_grad_bytes = 0;
  for (const at::Tensor& p : stack_->parameters()) {
    param_grad_bytes += static_cast<int64_t>(p.nbytes());
  }
  EXPECT_LE(full.backward_peak, n * (kInputBytes + rng_state_bytes()) + param_grad_bytes + 2 * block_working_set);
  EXPECT_LT(full.backward_peak, plain.retained);
}

TEST_F(CheckpointMemory, NestedCheckpointKeepsOnlyTheOutermostInput) {
  // Every block checkpointed inside one checkpoint of the whole stack: the blocks' inputs
  // are saved through the outer checkpoint's placeholders, so none of them is kept.
  const remat::CheckpointedStack blocks = remat::apply_checkpointing(stack_, "full");
  for (const bool outer_reentrant : {false, true}) {
    SCOPED_TRACE(outer_reentrant ? "outer reentrant" : "outer non-reentrant");
    remat::CheckpointOptions outer;
    outer.use_reentrant = outer_reentrant;
    const Measured m = measure([&](const at::Tensor& x) {
      return remat::checkpoint([blocks](const at::Tensor& h) { return blocks.forward(h); }, x, outer);
    });
    // The output, the outer generator state and, when the outer forward records a graph
    // (non-reentrant), each inner checkpoint's generator state.
    const int64_t states = outer_reentrant ? 1 : 1 + static_cast<int64_t>(kBlocks);
    EXPECT_EQ(m.retained, kInputBytes + states * rng_state_bytes());
  }
}

}  // namespace
