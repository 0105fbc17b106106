// Every refusal of remat::checkpoint, and the determinism checks, with their messages.
#include "remat/checkpoint.h"

#include "checkpoint/checkpoint_test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>

namespace {

using remat::CheckpointOptions;
using remat::DeterminismCheck;
using remat::testing::expect_error;
using remat::testing::seeded;

CheckpointOptions named(const std::string& name, bool reentrant = false) {
  CheckpointOptions o;
  o.name = name;
  o.use_reentrant = reentrant;
  return o;
}

// fn whose behaviour depends on how often it ran: `first` at forward, `later` after.
remat::CheckpointFn changing(std::function<std::vector<at::Tensor>(const at::Tensor&)> first,
                             std::function<std::vector<at::Tensor>(const at::Tensor&)> later) {
  auto calls = std::make_shared<int>(0);
  return [=](const std::vector<at::Tensor>& in) { return (*calls)++ == 0 ? first(in[0]) : later(in[0]); };
}

TEST(CheckpointErrors, DoubleBackwardIsRefusedInBothModes) {
  at::Generator gen = seeded(1);
  for (const bool reentrant : {false, true}) {
    SCOPED_TRACE(reentrant ? "reentrant" : "non-reentrant");
    const at::Tensor x = at::randn({3}, gen).requires_grad_(true);
    const at::Tensor y = remat::checkpoint([](const at::Tensor& t) { return t.tanh(); }, x, named("blk", reentrant));
    expect_error([&] { torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
                 "remat::checkpoint 'blk': double backward through a checkpoint is not supported");
  }
}

TEST(CheckpointErrors, ReentrantOutputCountChangeOnRecompute) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({2, 3}, gen).requires_grad_(true);
  auto fn = changing([](const at::Tensor& t) { return std::vector<at::Tensor>{t * 2}; },
                     [](const at::Tensor& t) {
                       return std::vector<at::Tensor>{t * 2, t * 3};
                     });
  const auto out = remat::checkpoint(fn, {x}, named("r", true));
  expect_error([&] { out[0].sum().backward(); },
               "remat::checkpoint 'r': fn returned 2 outputs on recompute but 1 in the forward pass");
}

TEST(CheckpointErrors, ReentrantOutputShapeChangeOnRecompute) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({2, 3}, gen).requires_grad_(true);
  auto fn = changing([](const at::Tensor& t) { return std::vector<at::Tensor>{t * 2}; },
                     [](const at::Tensor& t) {
                       return std::vector<at::Tensor>{at::cat({t, t}, 1)};
                     });
  const auto out = remat::checkpoint(fn, {x}, named("r", true));
  expect_error([&] { out[0].sum().backward(); },
               "remat::checkpoint 'r': output 0 is Float [2, 6] on cpu on recompute but was "
               "Float [2, 3] on cpu in the forward pass");
}

TEST(CheckpointErrors, NonReentrantOutputCountChangeWhenFnRunsToItsEnd) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({3}, gen).requires_grad_(true);
  auto fn = changing([](const at::Tensor& t) { return std::vector<at::Tensor>{t.tanh()}; },
                     [](const at::Tensor& t) {
                       return std::vector<at::Tensor>{t.tanh(), t};
                     });
  CheckpointOptions o = named("nr");
  o.early_stop = false;
  const auto out = remat::checkpoint(fn, {x}, o);
  expect_error([&] { out[0].sum().backward(); },
               "remat::checkpoint 'nr': fn returned 2 outputs on recompute but 1 in the forward pass");
}

TEST(CheckpointErrors, NonReentrantSavedTensorCountChange) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({3}, gen).requires_grad_(true);
  // tanh saves its result: two tanh save two tensors, one saves one.
  auto fn = changing([](const at::Tensor& t) { return std::vector<at::Tensor>{t.tanh().tanh()}; },
                     [](const at::Tensor& t) { return std::vector<at::Tensor>{t.tanh() * 1.0}; });
  const auto out = remat::checkpoint(fn, {x}, named("nr"));
  expect_error([&] { out[0].sum().backward(); },
               "remat::checkpoint 'nr': the forward pass saved 2 tensors for backward but the "
               "recompute saved 1");
}

TEST(CheckpointErrors, NonReentrantSavedTensorMetaChange) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({4}, gen).requires_grad_(true);
  // narrow saves no tensor; tanh saves its result, 2 then 3 elements; the output is a sum.
  auto fn = changing([](const at::Tensor& t) { return std::vector<at::Tensor>{t.narrow(0, 0, 2).tanh().sum()}; },
                     [](const at::Tensor& t) { return std::vector<at::Tensor>{t.narrow(0, 0, 3).tanh().sum()}; });
  const auto out = remat::checkpoint(fn, {x}, named("nr"));
  expect_error([&] { out[0].backward(); },
               "remat::checkpoint 'nr': saved tensor 0 of 1 is Float [3] on cpu on recompute but "
               "was Float [2] on cpu in the forward pass (determinism_check=meta)");
}

TEST(CheckpointErrors, ValuesCheckNamesTheCheckpointWhenFnReadsACounter) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({4}, gen).requires_grad_(true);
  auto calls = std::make_shared<double>(1.0);
  // Same shapes every time, different values: only the values check sees it.
  auto fn = [calls](const at::Tensor& t) { return (t * (*calls)++).tanh(); };
  CheckpointOptions meta = named("counter");
  const at::Tensor quiet = remat::checkpoint(fn, x, meta);
  EXPECT_NO_THROW(quiet.sum().backward());

  CheckpointOptions values = named("counter");
  values.determinism_check = DeterminismCheck::values;
  const at::Tensor loud = remat::checkpoint(fn, x, values);
  expect_error([&] { loud.sum().backward(); },
               "remat::checkpoint 'counter': saved tensor 0 of 1 (Float [4] on cpu) has different "
               "values on recompute (determinism_check=values)");
}

TEST(CheckpointErrors, ValuesCheckCatchesAGeneratorThatIsNotRestored) {
  const at::Tensor x = at::randn({4}, seeded(1)).requires_grad_(true);
  // A private generator: preserve_rng_state replays only the default generators.
  at::Generator noise = at::make_generator<at::CPUGeneratorImpl>(7);
  auto fn = [noise](const at::Tensor& t) { return t * at::rand({4}, noise); };
  CheckpointOptions o = named("noise");
  o.determinism_check = DeterminismCheck::values;
  const at::Tensor y = remat::checkpoint(fn, x, o);
  expect_error([&] { y.sum().backward(); }, "remat::checkpoint 'noise': saved tensor");
  expect_error([&] { remat::checkpoint(fn, x, o).sum().backward(); },
               "has different values on recompute (determinism_check=values)");
}

TEST(CheckpointErrors, ValuesCheckPassesForDropoutAndFailsWithoutRngPreservation) {
  at::Generator gen = seeded(1);
  for (const bool preserve : {true, false}) {
    SCOPED_TRACE(preserve ? "preserve_rng_state" : "no preserve_rng_state");
    const at::Tensor x = at::randn({64}, gen).requires_grad_(true);
    CheckpointOptions o = named("drop");
    o.determinism_check = DeterminismCheck::values;
    o.preserve_rng_state = preserve;
    const at::Tensor y =
        remat::checkpoint([](const at::Tensor& t) { return at::dropout(t, 0.5, /*train=*/true).tanh(); }, x, o);
    if (preserve) {
      EXPECT_NO_THROW(y.sum().backward());
    } else {
      expect_error([&] { y.sum().backward(); }, "remat::checkpoint 'drop': saved tensor");
    }
  }
}

TEST(CheckpointErrors, ValuesCheckReportsAnInPlaceChangeOfASavedTensor) {
  // tanh saves its result y, which fn then scales in place: without checkpointing
  // LibTorch's version check refuses the backward; a hooked saved tensor has no version
  // check, so it is the values check that reports it.
  auto fn = [](const at::Tensor& t) {
    at::Tensor y = t.tanh();
    y.mul_(2.0);
    return y * t;
  };
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({4}, gen).requires_grad_(true);
  expect_error([&] { fn(x).sum().backward(); }, "modified by an inplace operation");
  CheckpointOptions o = named("inplace");
  o.determinism_check = DeterminismCheck::values;
  const at::Tensor z = remat::checkpoint(fn, x, o);
  expect_error([&] { z.sum().backward(); },
               "remat::checkpoint 'inplace': saved tensor 0 of 3 (Float [4] on cpu) has "
               "different values on recompute");
}

TEST(CheckpointErrors, ReentrantValuesCheckComparesOutputs) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({4}, gen).requires_grad_(true);
  auto calls = std::make_shared<double>(1.0);
  CheckpointOptions o = named("r", true);
  o.determinism_check = DeterminismCheck::values;
  const at::Tensor y = remat::checkpoint([calls](const at::Tensor& t) { return t * (*calls)++; }, x, o);
  expect_error([&] { y.sum().backward(); },
               "remat::checkpoint 'r': output 0 (Float [4] on cpu) has different values on "
               "recompute (determinism_check=values)");
}

TEST(CheckpointErrors, ReentrantRefusesAutogradGradAndBackwardWithInputs) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({3}, gen).requires_grad_(true);
  const at::Tensor y = remat::checkpoint([](const at::Tensor& t) { return t.tanh(); }, x, named("r", true));
  expect_error([&] { torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true); },
               "remat::checkpoint 'r': use_reentrant=true does not work with "
               "torch::autograd::grad or with backward given `inputs`");
  expect_error([&] { y.sum().backward({}, false, false, {x}); },
               "remat::checkpoint 'r': use_reentrant=true does not work with "
               "torch::autograd::grad or with backward given `inputs`");
}

TEST(CheckpointErrors, ReentrantRefusesWhenNoInputRequiresGrad) {
  const std::shared_ptr<torch::nn::LinearImpl> lin = torch::nn::Linear(3, 3).ptr();
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({2, 3}, gen);
  expect_error([&] { remat::checkpoint([lin](const at::Tensor& t) { return lin->forward(t); }, x, named("r", true)); },
               "remat::checkpoint 'r': use_reentrant=true needs at least one input that requires grad");
}

TEST(CheckpointErrors, NonReentrantRefusesABackwardInsideItsOwnRegion) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({3}, gen).requires_grad_(true);
  auto fn = [](const at::Tensor& t) {
    const at::Tensor y = t.tanh();
    // A gradient taken inside the region needs tanh's saved result, a placeholder.
    return torch::autograd::grad({y.sum()}, {t}, {}, /*retain_graph=*/true)[0] + y;
  };
  expect_error([&] { remat::checkpoint(fn, x, named("inner")); },
               "remat::checkpoint 'inner': a backward inside fn needed a tensor saved inside the "
               "same checkpoint before fn returned");
}

TEST(CheckpointErrors, BackwardTwiceWithoutRetainGraphIsLibTorchsError) {
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({3}, gen).requires_grad_(true);
  const at::Tensor loss = remat::checkpoint([](const at::Tensor& t) { return t.tanh(); }, x).sum();
  loss.backward();
  expect_error([&] { loss.backward(); }, "Trying to backward through the graph a second time");
}

TEST(CheckpointErrors, InputModifiedInPlaceBeforeBackwardIsReported) {
  at::Generator gen = seeded(1);
  const at::Tensor w = at::randn({3}, gen).requires_grad_(true);
  at::Tensor x = at::randn({3}, gen);
  const at::Tensor loss = remat::checkpoint([w](const at::Tensor& t) { return (t * w).tanh(); }, x).sum();
  x.add_(1.0);
  expect_error([&] { loss.backward(); }, "modified by an inplace operation");
}

// An engine that is neither LibTorch's base engine nor remat's, standing for PyTorch's
// Python engine.
struct OtherEngine final : torch::autograd::Engine {
  ~OtherEngine() override { stop(); }
};

torch::autograd::Engine& other_engine() {
  static OtherEngine engine;
  return engine;
}

TEST(CheckpointErrors, NonReentrantRefusesAForeignDefaultEngine) {
  torch::autograd::set_default_engine_stub(&other_engine);
  at::Generator gen = seeded(1);
  const at::Tensor x = at::randn({3}, gen).requires_grad_(true);
  expect_error([&] { remat::checkpoint([](const at::Tensor& t) { return t.tanh(); }, x); },
               "remat::checkpoint: use_reentrant=false needs remat's autograd engine");
  // Back to LibTorch's engine, which remat may replace again.
  torch::autograd::set_default_engine_stub(&torch::autograd::Engine::get_base_engine);
  remat::install_checkpoint_engine();
  EXPECT_NO_THROW(remat::checkpoint([](const at::Tensor& t) { return t.tanh(); }, x).sum().backward());
}

}  // namespace
