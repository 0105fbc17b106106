// bench/peers/peers.py, the PyTorch side of the README's comparison, builds the models remat
// builds: the same parameter count for GPT-2 and Llama at the same shape, so a change to
// either side that makes the comparison unequal fails here rather than in a reader's table.
#include "util/paths.h"
#include "util/processes.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>

namespace {

using remat::testing::Result;
using remat::testing::run_remat;
using remat::testing::run_shell;

// The JSON object in `output`: from the first line that opens one to the last closing
// brace (stderr lines, joined in, come before it).
nlohmann::json json_in(const std::string& output) {
  const size_t line = output.rfind('{', 0) == 0 ? 0 : output.find("\n{");
  const size_t end = output.rfind('}');
  if (line == std::string::npos || end == std::string::npos) return nullptr;
  const size_t start = line == 0 ? 0 : line + 1;
  return nlohmann::json::parse(output.substr(start, end + 1 - start), nullptr, false);
}

TEST(Peers, ParameterCountsEqualRemats) {
  struct Arch {
    const char* name;
    int64_t kv, ff;
  };
  for (const Arch a : {Arch{"gpt2", 4, 256}, Arch{"llama", 2, 176}}) {
    const std::string shape = " --layers 2 --d-model 64 --heads 4 --kv-heads " + std::to_string(a.kv) + " --d-ff " +
                              std::to_string(a.ff) + " --vocab 512 --seq 32";
    const Result peers = run_shell(std::string("/usr/bin/python3 ") + remat::testing::kSourceDir +
                                   "/bench/peers/peers.py --param-count --arch " + std::string(a.name) + shape);
    ASSERT_EQ(peers.exit_code, 0) << peers.output;
    const nlohmann::json p = json_in(peers.output);
    ASSERT_TRUE(p.is_object()) << peers.output;

    const Result plan =
        run_remat(std::string("plan --json model.preset=") + a.name +
                  "-demo model.n_layer=2 model.d_model=64 model.n_head=4 model.n_kv_head=" + std::to_string(a.kv) +
                  " model.d_ff=" + std::to_string(a.ff) +
                  " model.vocab_size=512 model.max_seq=32 train.seq=32 run.dtype=float32");
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    const nlohmann::json r = json_in(plan.output);
    ASSERT_TRUE(r.is_object()) << plan.output;
    // float32 gradients: one 4-byte element per parameter.
    EXPECT_EQ(p.at("parameters").get<int64_t>(), r.at("breakdown").at("gradients").get<int64_t>() / 4) << a.name;
  }
}

}  // namespace
