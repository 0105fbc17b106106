// Feeds the configuration loader as the commands call it (load_run_config: load_config,
// hence validate_config, then validate_plan, the [ac] aliases' compile_policy and
// parse_budget): the input up to a line "%%" is the TOML file, every line after it one
// `key=value` override, as on the command line.
// A finding: anything but a std::exception out of load_run_config (a crash, a sanitizer report,
// a hang, runaway memory), or a loaded config whose resolved TOML (config_to_toml, what a
// run directory records) does not load back to the same resolved TOML.
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "harness.h"
#include "remat/config.h"
#include "remat/policy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::string toml = input;
  std::vector<std::string> overrides;
  const size_t split = input.rfind("%%\n", 0) == 0 ? 0 : input.find("\n%%\n");
  if (split != std::string::npos) {
    toml = input.substr(0, split);
    size_t pos = input.find('\n', split + 1) + 1;
    while (pos < input.size()) {
      size_t end = input.find('\n', pos);
      if (end == std::string::npos) end = input.size();
      overrides.push_back(input.substr(pos, end - pos));
      pos = end + 1;
    }
  }
  const auto bytes = [](const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); };
  const remat::fuzz::TempFile file(remat::fuzz::temp_path("config"), bytes(toml), toml.size());
  std::string resolved;
  try {
    resolved = remat::config_to_toml(remat::load_run_config(file.path(), overrides));
  } catch (const std::exception&) {
    return 0;
  }
  const remat::fuzz::TempFile again_file(remat::fuzz::temp_path("config-resolved"), bytes(resolved), resolved.size());
  std::string again;
  try {
    again = remat::config_to_toml(remat::load_config(again_file.path(), {}));
  } catch (const std::exception& e) {
    remat::fuzz::finding("the resolved config does not load back: " + std::string(e.what()) + "\n" + resolved);
  }
  if (again != resolved) remat::fuzz::finding("the resolved config loads back as another:\n" + resolved + "\n" + again);
  return 0;
}
