// Feeds the recompute-policy grammar (compile_policy, remat/policy.h). The first byte picks
// the layer count (1 to 48), the second the pipeline stages (1 to 4, at most the layers)
// and whether dropout is on; the rest is the ac.policy string.
// A finding: anything but a std::exception out of compile_policy (a crash, a sanitizer
// report, a hang, runaway memory), or an accepted policy whose canonical spelling
// (plan.policy) does not compile back to the same plan under the same spelling.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>

#include "harness.h"
#include "remat/policy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int64_t layers = 1 + data[0] % 48;
  remat::AcConfig ac;
  ac.stages = std::min<int64_t>(1 + data[1] % 4, layers);
  const double dropout = (data[1] & 0x80) != 0 ? 0.1 : 0.0;
  ac.policy = std::string(reinterpret_cast<const char*>(data + 2), size - 2);
  remat::ActivationPlan plan;
  try {
    plan = remat::compile_policy(ac, layers, dropout);
  } catch (const std::exception&) {
    return 0;  // refused with a sentence: the contract
  }
  remat::explain_plan(plan);
  ac.policy = plan.policy;
  remat::ActivationPlan again;
  try {
    again = remat::compile_policy(ac, layers, dropout);
  } catch (const std::exception& e) {
    remat::fuzz::finding("the canonical policy \"" + plan.policy + "\" is refused: " + e.what());
  }
  if (!remat::same_layers(plan, again) || again.policy != plan.policy) {
    remat::fuzz::finding("the canonical policy \"" + plan.policy + "\" compiles to another plan (\"" + again.policy +
                         "\")");
  }
  return 0;
}
