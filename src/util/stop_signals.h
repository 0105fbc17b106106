// The signals that ask a run to stop (SIGINT from Ctrl-C, SIGTERM from a scheduler or
// `kill`, SIGHUP from a closed terminal or a dropped SSH session): caught while a
// StopSignals lives, so that the loop holding it stops at its next safe point, writes
// what there is to save and says so, instead of dying where it stands.
#pragma once

#include <string>

namespace remat::util {

class StopSignals {
 public:
  /// Catches the three from now on, but for any ignored when it starts (nohup's SIGHUP);
  /// the previous handlers come back at destruction.
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

/// From now on, wherever no StopSignals holds them, the three (but for any ignored now, as
/// under nohup) end the process at once with one line on stderr, "remat: interrupted
/// (SIGINT) while <the Phase>; it ends here ...", the temporary files of unfinished
/// AtomicFiles removed, and exit status 128 + signal: for the phases with nothing to save
/// (reading, preparing a corpus, measuring, planning, generating), where waiting for a safe
/// point could take minutes.
void end_on_stop_signals();

/// What the process is doing, for end_on_stop_signals' line, while it lives ("planning");
/// the enclosing one comes back after. `what` must outlive it (a string literal).
class Phase {
 public:
  explicit Phase(const char* what);
  ~Phase();
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  const char* previous_;
};

}  // namespace remat::util
