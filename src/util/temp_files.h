// The temporary files AtomicFile writes (util/atomic_file.h), seen from outside a write:
// removed on the way out of a process a signal ends, and after a process that was killed.
#pragma once

#include <string>
#include <vector>

namespace remat::util {

/// Removes the temporary files of the AtomicFiles not yet committed or destroyed (up to 16
/// at a time are known), with async-signal-safe calls only: for a signal handler that ends
/// the process, so that it leaves no temporary file behind.
void remove_open_temp_files();

/// Removes the files of directory `dir` that AtomicFile wrote for one of `bases` (see
/// is_temp_name_of) whose process no longer runs: those a killed process left.
void remove_stale_temp_files(const std::string& dir, const std::vector<std::string>& bases);

}  // namespace remat::util
