// Where a run's prices come from (remat/prices.h): measured on this machine, declared
// (`remat plan`'s rates), or recorded by an earlier run, each rank share's attention op
// and loss head priced once however often planning asks. `remat train` and `remat bench`
// share it; a run writes what it took into its directory (prices.json), which
// `remat plan --prices` reads back.
#pragma once

#include "remat/config.h"
#include "remat/prices.h"

#include <functional>
#include <map>
#include <string>
#include <tuple>

namespace remat {

class PriceSource {
 public:
  /// The prices of `local` (its model.attention and model.loss_head named), with the host
  /// copies' rate where `host_copies` (the run's policy offloads, or its budget plan may).
  using Measure = std::function<Prices(const Config& local, bool host_copies)>;
  explicit PriceSource(Measure measure);

  /// `remat plan`'s: Prices::declared of each config.
  static PriceSource declared();
  /// What a run recorded: `path` is its directory or its prices.json. Throws a sentence
  /// where the file is missing or damaged; asked for prices it does not hold, `of` throws
  /// one naming what the run priced.
  static PriceSource recorded(const std::string& path);

  /// The prices of `local`, measured (or read) the first time they are asked for.
  Prices of(const Config& local, bool host_copies);
  /// Every price taken so far, as prices.json holds it.
  std::string record() const;

 private:
  using Key = std::tuple<Attention, LossHead, bool>;
  Measure measure_;
  std::map<Key, Prices> taken_;
};

}  // namespace remat
