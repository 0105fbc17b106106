// The signals that ask a run to stop (SIGINT from Ctrl-C, SIGTERM from a scheduler or
// `kill`, SIGHUP from a closed terminal or a dropped SSH session): caught while a
// StopSignals lives, so that the loop holding it stops at its next safe point, writes
// what there is to save and says so, instead of dying where it stands.
#pragma once

#include <string>

namespace remat::util {

class StopSignals {
 public:
  /// Catches the three from now on; the previous handlers come back at destruction.
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  /// The first signal caught since construction, or 0.
  int caught() const;
};

/// "interrupted (SIGINT)", "terminated (SIGTERM)", "hung up (SIGHUP)": what a stopped run
/// says it was.
std::string stop_name(int signal);

}  // namespace remat::util
