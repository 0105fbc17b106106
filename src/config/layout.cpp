#include "remat/layout.h"

#include <fmt/format.h>

#include <stdexcept>

namespace remat::pipeline {

const char* schedule_name(Schedule s) { return s == Schedule::gpipe ? "gpipe" : "1f1b"; }

Schedule schedule_of_name(const std::string& name) {
  if (name == "1f1b") return Schedule::one_f_one_b;
  if (name == "gpipe") return Schedule::gpipe;
  throw std::invalid_argument(fmt::format(
      "parallel.schedule = \"{}\" is not a pipeline schedule; use 1f1b (each stage alternates forwards and "
      "backwards once the pipeline is full, holding at most one microbatch per later stage) or gpipe (every "
      "forward, then every backward, holding all microbatches).",
      name));
}

std::vector<int64_t> even_split(int64_t layers, int64_t stages) {
  std::vector<int64_t> sizes;
  for (int64_t s = 0; s < stages; ++s) sizes.push_back(layers / stages + (s < layers % stages ? 1 : 0));
  return sizes;
}

}  // namespace remat::pipeline
