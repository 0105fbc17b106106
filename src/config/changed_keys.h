// What a hand edit changed in a resolved configuration: the keys of two config.toml texts
// whose values differ (a resumed run names them).
#pragma once

#include <string>
#include <vector>

namespace remat {

/// The keys whose values differ between two texts config_to_toml wrote, in the order of
/// `after`, each as "train.lr = 0.003 -> 0.01" ("(unset)" for an unset alias key), leaving
/// out the keys of `ignored`.
std::vector<std::string> changed_keys(const std::string& before, const std::string& after,
                                      const std::vector<std::string>& ignored);

}  // namespace remat
