// Feeds the memory-budget parser (parse_budget, remat/budget.h): the input is ac.budget's
// text, against a no-recompute peak of 3 GiB.
// A finding: anything but a std::exception out of parse_budget, or an accepted budget
// outside [0, 4 EiB] (the most it accepts), which the planner would add up in int64.
#include <cstdint>
#include <exception>
#include <string>

#include "harness.h"
#include "remat/budget.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  int64_t budget = 0;
  try {
    budget = remat::parse_budget(text, int64_t{3} << 30);
  } catch (const std::exception&) {
    return 0;
  }
  if (budget < 0 || budget > (int64_t{1} << 62)) {
    remat::fuzz::finding("the budget \"" + text + "\" parses to " + std::to_string(budget) + " bytes");
  }
  return 0;
}
