// Checkpointed torch::nn models give the un-checkpointed gradients bitwise, in both modes.
#include "remat/checkpoint.h"

#include "checkpoint/checkpoint_test_util.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

namespace {

using remat::testing::AttentionBlock;
using remat::testing::bitwise_equal;
using remat::testing::clear_grads;
using remat::testing::expect_bitwise_equal;
using remat::testing::FixedThreads;
using remat::testing::MlpBlock;
using remat::testing::seeded;

using Forward = std::function<at::Tensor(const at::Tensor&)>;

enum class Api { backward, grad };

// What one step produces: the output, the gradients (parameters, then the input when it
// requires grad) and the next numbers of the default generator after the step.
struct Step {
  at::Tensor out;
  std::vector<at::Tensor> grads;
  at::Tensor next_random;
};

Step run_step(const Forward& forward, torch::nn::Module& model, const at::Tensor& input, const at::Tensor& probe,
              Api api, bool input_requires_grad = true) {
  clear_grads(model);
  const at::Tensor x = input.clone().requires_grad_(input_requires_grad);
  torch::manual_seed(1234);
  Step s;
  s.out = forward(x);
  const at::Tensor loss = (s.out * probe).sum();
  std::vector<at::Tensor> wrt = model.parameters();
  if (input_requires_grad) {
    wrt.push_back(x);
  }
  if (api == Api::backward) {
    loss.backward();
    for (const at::Tensor& t : wrt) {
      s.grads.push_back(t.grad());
    }
  } else {
    s.grads = torch::autograd::grad({loss}, wrt);
  }
  s.next_random = at::rand({8});
  return s;
}

void expect_same_step(const Step& got, const Step& want) {
  EXPECT_TRUE(bitwise_equal(got.out, want.out)) << "outputs differ";
  expect_bitwise_equal(got.grads, want.grads, "gradient");
  EXPECT_TRUE(bitwise_equal(got.next_random, want.next_random))
      << "the recompute shifted the default generator's stream";
}

torch::nn::Sequential mlp_stack(int64_t blocks, double p) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < blocks; ++i) {
    seq->push_back(MlpBlock(16, 64, p));
  }
  return seq;
}

torch::nn::ModuleList attention_stack(int64_t blocks, double p) {
  torch::manual_seed(0);
  torch::nn::ModuleList list;
  for (int64_t i = 0; i < blocks; ++i) {
    list->push_back(AttentionBlock(16, 4, p));
  }
  return list;
}

at::Tensor call_attention(torch::nn::Module& m, const at::Tensor& x) { return m.as<AttentionBlock>()->forward(x); }

// Parameterised by use_reentrant.
class CheckpointGradTest : public ::testing::TestWithParam<bool> {
 protected:
  remat::CheckpointOptions options() const {
    remat::CheckpointOptions o;
    o.use_reentrant = GetParam();
    return o;
  }

  FixedThreads threads_;
};

TEST_P(CheckpointGradTest, MlpSequentialFullWithDropoutIsBitwise) {
  torch::nn::Sequential seq = mlp_stack(3, 0.2);
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({8, 16}, gen);
  const at::Tensor probe = at::randn({8, 16}, gen);
  const Step plain = run_step([&](const at::Tensor& x) { return seq->forward(x); }, *seq, input, probe, Api::backward);
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "full", options());
  const Step ckpt = run_step([&](const at::Tensor& x) { return stack.forward(x); }, *seq, input, probe, Api::backward);
  expect_same_step(ckpt, plain);
}

TEST_P(CheckpointGradTest, UnrestoredGeneratorChangesGradients) {
  // Shows that the comparison above can fail: without the replayed generator state the
  // recompute draws other dropout masks.
  torch::nn::Sequential seq = mlp_stack(2, 0.5);
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({8, 16}, gen);
  const at::Tensor probe = at::randn({8, 16}, gen);
  const Step plain = run_step([&](const at::Tensor& x) { return seq->forward(x); }, *seq, input, probe, Api::backward);
  remat::CheckpointOptions o = options();
  o.preserve_rng_state = false;
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "full", o);
  const Step ckpt = run_step([&](const at::Tensor& x) { return stack.forward(x); }, *seq, input, probe, Api::backward);
  EXPECT_TRUE(bitwise_equal(ckpt.out, plain.out));
  EXPECT_FALSE(bitwise_equal(ckpt.grads.front(), plain.grads.front()));
}

TEST_P(CheckpointGradTest, AttentionModuleListUnderEveryPolicyIsBitwise) {
  torch::nn::ModuleList list = attention_stack(4, 0.1);
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({5, 2, 16}, gen);
  const at::Tensor probe = at::randn({5, 2, 16}, gen);
  auto plain_forward = [&](const at::Tensor& x) {
    at::Tensor h = x;
    for (const auto& m : *list) {
      h = call_attention(*m, h);
    }
    return h;
  };
  const Step plain = run_step(plain_forward, *list, input, probe, Api::backward);
  for (const char* policy : {"full", "every:2", "uniform:3"}) {
    SCOPED_TRACE(policy);
    const remat::CheckpointedStack stack = remat::apply_checkpointing(list, policy, call_attention, options());
    const Step ckpt =
        run_step([&](const at::Tensor& x) { return stack.forward(x); }, *list, input, probe, Api::backward);
    expect_same_step(ckpt, plain);
  }
}

TEST_P(CheckpointGradTest, NestedCheckpointsAreBitwise) {
  // An outer checkpoint over two blocks, each block checkpointed again inside it, in
  // either mode: the outer mode is the parameter, the inner one takes both values.
  torch::nn::Sequential seq = mlp_stack(2, 0.2);
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({8, 16}, gen);
  const at::Tensor probe = at::randn({8, 16}, gen);
  const Step plain = run_step([&](const at::Tensor& x) { return seq->forward(x); }, *seq, input, probe, Api::backward);
  for (const bool inner_reentrant : {false, true}) {
    SCOPED_TRACE(inner_reentrant ? "inner reentrant" : "inner non-reentrant");
    remat::CheckpointOptions inner;
    inner.use_reentrant = inner_reentrant;
    const remat::CheckpointedStack blocks = remat::apply_checkpointing(seq, "full", inner);
    auto outer = [&](const at::Tensor& x) {
      return remat::checkpoint([blocks](const at::Tensor& h) { return blocks.forward(h); }, x, options());
    };
    expect_same_step(run_step(outer, *seq, input, probe, Api::backward), plain);
  }
}

TEST_P(CheckpointGradTest, RetainedGraphBackwardTwiceRecomputesEachTime) {
  torch::nn::Sequential seq = mlp_stack(2, 0.2);
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({8, 16}, gen);
  const at::Tensor probe = at::randn({8, 16}, gen);
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "full", options());
  auto twice = [&](const Forward& forward) {
    clear_grads(*seq);
    const at::Tensor x = input.clone().requires_grad_(true);
    torch::manual_seed(1234);
    const at::Tensor loss = (forward(x) * probe).sum();
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : seq->parameters()) {
      grads.push_back(p.grad());
    }
    grads.push_back(x.grad());
    return grads;
  };
  const auto plain = twice([&](const at::Tensor& x) { return seq->forward(x); });
  const auto ckpt = twice([&](const at::Tensor& x) { return stack.forward(x); });
  expect_bitwise_equal(ckpt, plain, "gradient after two backwards");
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, CheckpointGradTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "reentrant" : "non_reentrant";
                         });

TEST(CheckpointGrad, AutogradGradNonReentrantIsBitwise) {
  FixedThreads threads;
  torch::nn::ModuleList list = attention_stack(2, 0.1);
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({5, 2, 16}, gen);
  const at::Tensor probe = at::randn({5, 2, 16}, gen);
  auto plain_forward = [&](const at::Tensor& x) { return call_attention(*list[1], call_attention(*list[0], x)); };
  const Step plain = run_step(plain_forward, *list, input, probe, Api::grad);
  const remat::CheckpointedStack stack = remat::apply_checkpointing(list, "full", call_attention);
  const Step ckpt = run_step([&](const at::Tensor& x) { return stack.forward(x); }, *list, input, probe, Api::grad);
  expect_same_step(ckpt, plain);
  // Nested, through grad() as well.
  auto nested = [&](const at::Tensor& x) {
    return remat::checkpoint([stack](const at::Tensor& h) { return stack.forward(h); }, x);
  };
  expect_same_step(run_step(nested, *list, input, probe, Api::grad), plain);
}

TEST(CheckpointGrad, BackwardWithInputsNonReentrantIsBitwise) {
  FixedThreads threads;
  torch::nn::Sequential seq = mlp_stack(2, 0.2);
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "full");
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({8, 16}, gen);
  auto input_grad = [&](const Forward& forward) {
    const at::Tensor x = input.clone().requires_grad_(true);
    torch::manual_seed(1234);
    forward(x).sum().backward({}, /*retain_graph=*/false, /*create_graph=*/false, {x});
    return x.grad();
  };
  clear_grads(*seq);
  const at::Tensor plain = input_grad([&](const at::Tensor& x) { return seq->forward(x); });
  const at::Tensor ckpt = input_grad([&](const at::Tensor& x) { return stack.forward(x); });
  EXPECT_TRUE(bitwise_equal(ckpt, plain));
  for (const at::Tensor& p : seq->parameters()) {
    EXPECT_FALSE(p.grad().defined());  // backward(inputs) accumulates into x only
  }
}

TEST(CheckpointGrad, NonReentrantWorksWhenOnlyParametersRequireGrad) {
  FixedThreads threads;
  torch::nn::Sequential seq = mlp_stack(3, 0.2);
  at::Generator gen = seeded(1);
  const at::Tensor input = at::randn({8, 16}, gen);
  const at::Tensor probe = at::randn({8, 16}, gen);
  const Step plain = run_step([&](const at::Tensor& x) { return seq->forward(x); }, *seq, input, probe, Api::backward,
                              /*input_requires_grad=*/false);
  const remat::CheckpointedStack stack = remat::apply_checkpointing(seq, "full");
  const Step ckpt = run_step([&](const at::Tensor& x) { return stack.forward(x); }, *seq, input, probe, Api::backward,
                             /*input_requires_grad=*/false);
  ASSERT_TRUE(plain.grads.front().defined());
  expect_same_step(ckpt, plain);
}

// fn counts how often it starts and how often it gets past its last saving op.
struct CountingFn {
  std::shared_ptr<int> starts = std::make_shared<int>(0);
  std::shared_ptr<int> ends = std::make_shared<int>(0);

  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& in) const {
    ++*starts;
    const at::Tensor y = (in[0] * in[1]).tanh();  // saves in[0], in[1], then tanh's result
    const at::Tensor out = y + 1.0;               // saves nothing
    ++*ends;
    return {out};
  }
};

TEST(CheckpointGrad, EarlyStopSkipsWhatFollowsTheLastSavedTensor) {
  at::Generator gen = seeded(1);
  const at::Tensor a0 = at::randn({4}, gen), b0 = at::randn({4}, gen);
  // The reference is the same fn under plain autograd, not a closed form: a formula
  // rounded differently drifts from it near tanh's saturation, while a recompute that
  // replays fn must give its gradient bitwise.
  const at::Tensor a_plain = a0.clone().requires_grad_(true);
  CountingFn()({a_plain, b0.clone().requires_grad_(true)})[0].sum().backward();
  for (const bool early_stop : {true, false}) {
    SCOPED_TRACE(early_stop ? "early_stop" : "no early_stop");
    CountingFn fn;
    remat::CheckpointOptions o;
    o.early_stop = early_stop;
    const at::Tensor a = a0.clone().requires_grad_(true);
    const at::Tensor b = b0.clone().requires_grad_(true);
    const at::Tensor out = remat::checkpoint(fn, {a, b}, o)[0];
    EXPECT_EQ(*fn.starts, 1);
    out.sum().backward();
    EXPECT_EQ(*fn.starts, 2);
    EXPECT_EQ(*fn.ends, early_stop ? 1 : 2);
    EXPECT_TRUE(bitwise_equal(a.grad(), a_plain.grad()));
  }
}

TEST(CheckpointGrad, GradModeOffSimplyRunsFn) {
  at::Generator gen = seeded(1);
  for (const bool reentrant : {false, true}) {
    SCOPED_TRACE(reentrant ? "reentrant" : "non-reentrant");
    CountingFn fn;
    remat::CheckpointOptions o;
    o.use_reentrant = reentrant;
    const at::Tensor a = at::randn({4}, gen).requires_grad_(true);
    c10::NoGradGuard no_grad;
    const at::Tensor out = remat::checkpoint(fn, {a, at::randn({4}, gen)}, o)[0];
    EXPECT_EQ(*fn.starts, 1);
    EXPECT_FALSE(out.requires_grad());
  }
}

}  // namespace
