// The time profile's cache (<run.out_dir>/.profiles/) and the sharing of rank 0's
// profile, for measure.cpp.
#pragma once

#include "profile/profile.h"

#include <string>

namespace remat::profile {

/// The data-parallel ranks ZeRO-1 shards `cfg`'s optimizer over (1: none).
int64_t zero_ranks(const Config& cfg);

/// The path and optimizer bytes of the profile of `cfg` on `model`, nothing measured yet;
/// `at_once`: the ranks measuring together, sharing the host as they will train.
TimeProfile unmeasured(const Config& cfg, const Model& model, int at_once);

/// Fills `p`'s prices from the cache file at its path when it is whole and sane. A damaged
/// one (a killed write, a hand edit) is said on stderr and measured again, rather than
/// failing every later run with a bare JSON error.
bool read_cached(TimeProfile& p);

/// Writes `p`'s prices to the cache file at its path.
void write_cached(const TimeProfile& p);

/// Every rank of `ranks` takes rank 0's prices (and its word on whether they are cached):
/// each plans from them, and ranks that plan from their own measurements (or their own
/// hosts' caches) may choose other plans, which the stages' split, the tensor-parallel
/// collectives and the predictions all need alike.
void take_rank0s(dist::Comm* ranks, TimeProfile& p);

/// Rank 0's `value`, bit for bit, on every rank of `ranks`.
double rank0s(dist::Comm& ranks, double value, const std::string& what);

}  // namespace remat::profile
