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
  /// The prices of `local` (its model.attention and model.loss_head named).
  using Measure = std::function<Prices(const Config& local)>;
  /// Sets the host copies' rate in `prices`, those of `local` (the run's policy offloads,
  /// or its budget plan may).
  using AddCopies = std::function<void(const Config& local, Prices& prices)>;
  PriceSource(Measure measure, AddCopies add_copies);

  /// `remat plan`'s: Prices::declared of each config.
  static PriceSource declared();
  /// What a run recorded: `path` is its directory or its prices.json. Throws a sentence
  /// where the file is missing or damaged; asked for prices it does not hold, `of` throws
  /// one naming what the run priced.
  static PriceSource recorded(const std::string& path);

  /// The prices of `local`, with the host copies' where `host_copies`: its ops measured (or
  /// read) the first time they are asked for, with or without copies, so that a plan that
  /// offloads and one that does not price the same ops alike.
  Prices of(const Config& local, bool host_copies);
  /// Every price taken so far, as prices.json holds it.
  std::string record() const;

 private:
  using Key = std::tuple<Attention, LossHead, bool>;
  Measure measure_;
  AddCopies add_copies_;
  std::map<Key, Prices> taken_;
};

}  // namespace remat
