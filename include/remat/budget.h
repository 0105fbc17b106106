// The memory budget's text ("12GiB", "0.6"), parsed apart from the planner that uses it:
// the config validates a budget with it, and a header free of LibTorch's keeps that
// translation unit (and the fuzz build's config harness) light.
#pragma once

#include <cstdint>
#include <string>

namespace remat {

/// Parses "12GiB", "96MiB", "1.5e9", "4096" (bytes) or "0.6" / "60%" (a fraction of
/// `reference`). Throws std::invalid_argument with a sentence on anything else.
int64_t parse_budget(const std::string& text, int64_t reference);

/// Parses ac.host_budget: "0" (offload nothing), bytes as parse_budget reads them, or a
/// fraction of `reference` (the host memory free). Throws std::invalid_argument with a
/// sentence on anything else.
int64_t parse_host_budget(const std::string& text, int64_t reference);

}  // namespace remat
