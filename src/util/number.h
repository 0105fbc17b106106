// Numbers read from text (config values, the policy grammar's K, N and R): the whole text
// or nothing, so "4x" or "1e400" is refused rather than read as 4 or infinity.
#pragma once

#include <cmath>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

namespace remat::util {

/// `text` as a whole decimal integer (an optional sign; std::stoll's leading spaces), or
/// nullopt where it is empty, holds anything else or leaves int64.
inline std::optional<int64_t> parse_int(const std::string& text) {
  size_t used = 0;
  int64_t out = 0;
  try {
    out = std::stoll(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used == 0 || used != text.size()) return std::nullopt;
  return out;
}

/// `text` as a whole finite number (std::stod's forms: 0.5, 1e-3, 3), or nullopt where it
/// is empty, holds anything else, or is infinite or not a number.
inline std::optional<double> parse_real(const std::string& text) {
  size_t used = 0;
  double out = 0;
  try {
    out = std::stod(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used == 0 || used != text.size() || !std::isfinite(out)) return std::nullopt;
  return out;
}

}  // namespace remat::util
