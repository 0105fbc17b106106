// One traced forward_backward: valid Chrome-trace JSON whose op slices are exactly the
// ops that ran (the forward ops, and the ops the store says it re-executed), properly
// nested inside the per-layer slices, with a memory track below the measured peak.
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "remat/trace.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace remat {
namespace {

struct Slice {
  std::string name, cat;
  int64_t begin, end;  // ns, as Perfetto reads the microseconds back
  const Slice* parent = nullptr;
};

bool is_op(const Slice& s) { return s.cat == "forward" || s.cat == "backward" || s.cat == "recompute"; }

// The nearest enclosing slice for which `pred` holds, or null.
template <class Pred>
const Slice* ancestor(const Slice& s, Pred pred) {
  for (const Slice* p = s.parent; p != nullptr; p = p->parent) {
    if (pred(*p)) return p;
  }
  return nullptr;
}

struct Traced {
  std::vector<Slice> slices;  // in file order: by begin time, parents first
  std::vector<int64_t> memory;
  int64_t peak = 0;
  StoreCounters counters;

  // Op slices not inside another op (attention's own dropout is part of attention).
  int64_t outermost_ops(const std::string& cat) const {
    int64_t n = 0;
    for (const Slice& s : slices) n += s.cat == cat && ancestor(s, is_op) == nullptr;
    return n;
  }
  int64_t named(const std::string& name) const {
    int64_t n = 0;
    for (const Slice& s : slices) n += s.name == name;
    return n;
  }
};

int64_t to_ns(const nlohmann::json& us) { return std::llround(us.get<double>() * 1000.0); }

// Traces one microbatch of `cfg` under `policy` and reads the file back, checking the
// fields every event needs and that slices nest on their thread.
Traced trace_step(const ModelConfig& cfg, const std::string& policy, StoreOptions options = {}) {
  memory::install_cpu_tracking();
  auto model = Model::create(cfg, at::kCPU, at::kFloat, 3);
  model->set_activation_plan(compile_policy(policy, cfg.n_layer, cfg.dropout), options);
  auto gen = at::detail::createCPUGenerator(9);
  const at::Tensor tokens = at::randint(cfg.vocab_size, {2, 8}, gen, at::kLong);
  const at::Tensor targets = at::randint(cfg.vocab_size, {2, 8}, gen, at::kLong);

  memory::reset_peak(at::kCPU);
  trace::start(at::kCPU);
  model->forward_backward(tokens, targets, {5, 2, 0}, 1.0, 7);
  const nlohmann::json file = nlohmann::json::parse(trace::stop());

  Traced r;
  r.peak = memory::stats(at::kCPU).peak;
  if (model->store() != nullptr) r.counters = model->store()->counters();
  EXPECT_EQ(file.at("displayTimeUnit"), "ms");
  const auto& events = file.at("traceEvents");
  r.slices.reserve(events.size());          // parents are pointed to: no reallocation
  std::map<int, std::vector<Slice*>> open;  // per thread: the chain of enclosing slices
  for (const auto& e : events) {
    const std::string ph = e.at("ph");
    if (ph == "C") {
      EXPECT_EQ(e.at("name"), "memory");
      r.memory.push_back(e.at("args").at("bytes").get<int64_t>());
      continue;
    }
    if (ph != "X") continue;
    for (const char* key : {"name", "cat", "ts", "dur", "pid", "tid"}) {
      EXPECT_TRUE(e.contains(key)) << key << " missing in " << e.dump();
    }
    const int64_t begin = to_ns(e.at("ts"));
    r.slices.push_back(
        {e.at("name").get<std::string>(), e.at("cat").get<std::string>(), begin, begin + to_ns(e.at("dur"))});
    Slice& s = r.slices.back();
    auto& chain = open[e.at("tid").get<int>()];
    while (!chain.empty() && chain.back()->end <= s.begin) chain.pop_back();
    if (!chain.empty()) {
      EXPECT_LE(s.end, chain.back()->end) << s.name << " overlaps the end of " << chain.back()->name;
      s.parent = chain.back();
    }
    chain.push_back(&s);
  }
  return r;
}

ModelConfig shape(const std::string& preset, double dropout) {
  ModelConfig c = model_preset(preset);
  c.n_layer = 3;
  c.dropout = dropout;
  return c;
}

// What every traced step shows, whatever the policy.
void expect_common(const Traced& t, int64_t layers, int64_t forward_ops) {
  EXPECT_EQ(t.outermost_ops("forward"), forward_ops);
  EXPECT_EQ(t.outermost_ops("recompute"), t.counters.ops_recomputed);
  EXPECT_GT(t.outermost_ops("backward"), 0);
  for (int64_t l = 1; l <= layers; ++l) {
    EXPECT_EQ(t.named(fmt::format("layer {} forward", l)), 1) << l;
    EXPECT_EQ(t.named(fmt::format("layer {} backward", l)), 1) << l;
  }
  for (const char* part : {"embedding forward", "loss head forward", "loss head backward", "embedding backward"}) {
    EXPECT_EQ(t.named(part), 1) << part;
  }
  for (const Slice& s : t.slices) {
    if (!is_op(s)) continue;
    EXPECT_NE(ancestor(s, [](const Slice& p) { return p.cat == "layer"; }), nullptr) << s.name << " outside a layer";
    // Recompute ops, and only they, run inside a "layer N recompute" slice.
    const Slice* rec = ancestor(s, [](const Slice& p) { return p.name.find(" recompute") != std::string::npos; });
    EXPECT_EQ(rec != nullptr, s.cat == "recompute") << s.name << " (" << s.cat << ")";
  }
  // Both ends of every slice sample memory; no sample exceeds the measured peak.
  EXPECT_EQ(t.memory.size(), 2 * t.slices.size());
  ASSERT_FALSE(t.memory.empty());
  const int64_t top = *std::max_element(t.memory.begin(), t.memory.end());
  EXPECT_GT(top, 0);
  EXPECT_LE(top, t.peak);
}

// Forward ops of one GPT-2 microbatch: token and position embedding and their dropout (a
// mask and its product); per block 2 layernorms, 4 linears, attention, GELU, 2 residual
// dropouts (each a mask and its product), 2 residual adds; the final layernorm and the loss head.
int64_t gpt2_forward_ops(int64_t layers) { return 4 + 14 * layers + 2; }
// Llama: the embedding; per block 2 RMSNorms, the q/k/v and gate/up projections (one op
// each), 2 more linears, 2 RoPEs, attention, SwiGLU, 2 residual adds; the final norm and
// the loss head.
int64_t llama_forward_ops(int64_t layers) { return 1 + 12 * layers + 2; }

TEST(Trace, NoneRecomputesNothing) {
  const Traced t = trace_step(shape("tiny-gpt2", 0.1), "none");
  expect_common(t, 3, gpt2_forward_ops(3));
  EXPECT_EQ(t.outermost_ops("recompute"), 0);
  for (const Slice& s : t.slices) EXPECT_EQ(s.name.find("recompute"), std::string::npos) << s.name;
}

TEST(Trace, FullMarksEveryRecomputedOp) {
  const Traced t = trace_step(shape("tiny-gpt2", 0.1), "full");
  ASSERT_GT(t.counters.ops_recomputed, 0);
  expect_common(t, 3, gpt2_forward_ops(3));
  for (int64_t l = 1; l <= 3; ++l) EXPECT_GE(t.named(fmt::format("layer {} recompute", l)), 1) << l;
}

TEST(Trace, WholeBlockRerunAndLlama) {
  StoreOptions whole;
  whole.early_stop = false;
  const Traced g = trace_step(shape("tiny-gpt2", 0.1), "full", whole);
  ASSERT_GT(g.counters.ops_recomputed, 0);
  expect_common(g, 3, gpt2_forward_ops(3));
  const Traced l = trace_step(shape("tiny-llama", 0.1), "full");
  ASSERT_GT(l.counters.ops_recomputed, 0);
  expect_common(l, 3, llama_forward_ops(3));
}

TEST(Trace, ChunkRecomputeShowsEachLayer) {
  const Traced t = trace_step(shape("tiny-gpt2", 0.0), "uniform:3");
  ASSERT_GT(t.counters.ops_recomputed, 0);
  expect_common(t, 3, gpt2_forward_ops(3) - 3 * 4 - 2);  // no dropout at p = 0
  for (int64_t l = 1; l <= 3; ++l) EXPECT_EQ(t.named(fmt::format("layer {} recompute", l)), 1) << l;
}

TEST(Trace, RecordsNothingWhenStopped) {
  auto model = Model::create(shape("tiny-gpt2", 0.1), at::kCPU, at::kFloat, 3);
  const at::Tensor tokens = at::zeros({1, 4}, at::kLong);
  trace::start(at::kCPU);
  const nlohmann::json empty = nlohmann::json::parse(trace::stop());
  EXPECT_FALSE(trace::recording());
  model->forward_backward(tokens, tokens, {}, 1.0, 7);
  // stop() hands over whatever was recorded since the last one: nothing, while stopped.
  EXPECT_EQ(nlohmann::json::parse(trace::stop()), empty);
}

TEST(Trace, UnwritablePathIsRefusedWithTheReason) {
  EXPECT_NO_THROW(trace::check_writable("trace-check.json"));
  try {
    trace::check_writable("/nonexistent-dir/step.json");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'/nonexistent-dir/step.json' (run.trace, --trace): the directory "
                                         "/nonexistent-dir does not exist"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(trace::check_writable("/tmp"), std::invalid_argument);
  EXPECT_THROW(trace::check_writable("/tmp/"), std::invalid_argument);
}

}  // namespace
}  // namespace remat
