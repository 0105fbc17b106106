// A run's prices are measured once per attention op and loss head: a plan that offloads
// adds the host copies to the same ops' prices a plan without copies took, so two bench
// entries that differ in their copies alone differ in their predicted step by the copies
// alone. What a run recorded plans again, and what it did not price is refused.
#include "run/price_source.h"

#include "util/error_of.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>

namespace remat {
namespace {

// Each measure of the ops a different price, as a loaded machine's would be.
struct Counting {
  int ops = 0, copies = 0;
  PriceSource source() {
    return PriceSource(
        [this](const Config&) {
          Prices p;
          p.times.flops_per_second = 1e12;
          p.base_seconds = 1.0 + ++ops;
          return p;
        },
        [this](const Config&, Prices& p) { p.times.host_bytes_per_second = 1e9 * ++copies; });
  }
};

std::string error_of(const std::function<void()>& f) { return testing::error_of<std::invalid_argument>(f); }

Config with(Attention attention) {
  Config c;
  c.model.attention = attention;
  return c;
}

TEST(PriceSource, MeasuresTheOpsOnceWithOrWithoutCopies) {
  Counting n;
  PriceSource prices = n.source();
  const Config math = with(Attention::math);
  const Prices copied = prices.of(math, true);
  const Prices plain = prices.of(math, false);
  EXPECT_EQ(n.ops, 1);
  EXPECT_EQ(n.copies, 1);
  EXPECT_EQ(copied.base_seconds, plain.base_seconds);
  EXPECT_EQ(copied.times.host_bytes_per_second, 1e9);
  EXPECT_EQ(plain.times.host_bytes_per_second, 0.0);
  // Asked again, nothing is measured again; another op is measured on its own.
  EXPECT_EQ(prices.of(math, true).times.host_bytes_per_second, 1e9);
  EXPECT_NE(prices.of(with(Attention::tiled), false).base_seconds, plain.base_seconds);
  EXPECT_EQ(n.ops, 2);
  EXPECT_EQ(n.copies, 1);
}

TEST(PriceSource, ARecordPlansAgainAndRefusesWhatItDidNotPrice) {
  const testing::TempDir dir;
  Counting n;
  PriceSource measured = n.source();
  const Prices copied = measured.of(with(Attention::math), true);
  std::ofstream(dir.path() / "prices.json") << measured.record();

  PriceSource recorded = PriceSource::recorded(dir.path().string());
  EXPECT_EQ(recorded.of(with(Attention::math), true).base_seconds, copied.base_seconds);
  EXPECT_EQ(recorded.of(with(Attention::math), true).times.host_bytes_per_second, 1e9);
  // The ops without copies were measured on the way and are recorded too.
  EXPECT_EQ(recorded.of(with(Attention::math), false).times.host_bytes_per_second, 0.0);
  const std::string other = error_of([&] { recorded.of(with(Attention::tiled), true); });
  EXPECT_NE(other.find("priced math attention with the fused head; math attention with the fused head and host "
                       "copies, not tiled attention"),
            std::string::npos)
      << other;
}

TEST(PriceSource, ARecordWithoutCopiesRefusesThem) {
  const testing::TempDir dir;
  Counting n;
  PriceSource measured = n.source();
  measured.of(with(Attention::math), false);
  std::ofstream(dir.path() / "prices.json") << measured.record();
  PriceSource recorded = PriceSource::recorded(dir.path().string());
  const std::string copies = error_of([&] { recorded.of(with(Attention::math), true); });
  EXPECT_NE(copies.find("priced math attention with the fused head, not math attention with the fused head and host "
                        "copies"),
            std::string::npos)
      << copies;
}

}  // namespace
}  // namespace remat
