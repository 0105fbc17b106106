#include "remat/budget.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <utility>

namespace remat {

int64_t parse_budget(const std::string& text, int64_t reference) {
  const auto fail = [&] {
    return std::invalid_argument(fmt::format(
        "The memory budget \"{}\" is not a size; write bytes with an optional unit (e.g. 12GiB, 512MiB, 3e9) "
        "or a fraction of the no-recompute peak (e.g. 0.6 or 60%).",
        text));
  };
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw fail();
  }
  std::string unit = text.substr(used);
  unit.erase(0, unit.find_first_not_of(' '));
  // std::stod also reads hexadecimal ("0x10" as 16 bytes), "inf" and "nan": decimal only.
  if (text.substr(0, used).find_first_not_of(" 0123456789.eE+-") != std::string::npos || !std::isfinite(value)) {
    throw fail();
  }
  if (!(value > 0)) {
    throw std::invalid_argument(
        fmt::format("The memory budget \"{}\" leaves no memory; give a size above 0 (e.g. 512MiB) or a fraction "
                    "of the no-recompute peak (e.g. 0.6 or 60%).",
                    text));
  }
  // Bytes past int64 would wrap to a negative budget; 2^62 (4 EiB) is beyond any device.
  const auto bytes = [&](double b) {
    if (b >= 0x1p62) {
      throw std::invalid_argument(
          fmt::format("The memory budget \"{}\" is {:.3g} bytes, beyond any device (the most "
                      "accepted is 4 EiB); give a size such as 12GiB or a fraction such as 0.6.",
                      text, b));
    }
    return static_cast<int64_t>(std::floor(b));
  };
  // A percentage is always a fraction of the peak (101% is 1.01 of it, not 1 byte); a bare
  // number is a fraction up to 1 and a whole count of bytes above.
  if (unit == "%") return bytes(value / 100.0 * static_cast<double>(reference));
  if (unit.empty() && value <= 1.0) return bytes(value * static_cast<double>(reference));
  if (unit.empty() && value != std::floor(value)) {
    throw std::invalid_argument(fmt::format(
        "The memory budget \"{}\" is neither a fraction of the no-recompute peak (at most 1) nor a whole number of "
        "bytes; write e.g. 0.6, 60% or 512MiB.",
        text));
  }
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1.0},    {"B", 1.0},      {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) return bytes(value * scale);
  }
  throw fail();
}

int64_t parse_host_budget(const std::string& text, int64_t reference) {
  if (text == "0") return 0;
  int64_t bytes = 0;
  bool over = false;
  try {
    bytes = parse_budget(text, reference);
    // A bare fraction above 1 is refused as bytes that are not whole; a percentage above
    // 100 is more than there is.
    constexpr int64_t kWhole = int64_t{1} << 20;
    over = text.back() == '%' && parse_budget(text, kWhole) > kWhole;
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(fmt::format(
        "ac.host_budget = \"{}\" is not a size; write bytes with an optional unit (e.g. 64GiB), a fraction of the "
        "host memory free (e.g. 0.5 or 50%), or 0 to offload nothing.",
        text));
  }
  if (over) {
    throw std::invalid_argument(
        fmt::format("ac.host_budget = \"{}\" is more than all the host memory free; give at most 100% (or a size, "
                    "e.g. 64GiB).",
                    text));
  }
  return bytes;
}

}  // namespace remat
