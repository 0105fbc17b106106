// The `remat` command line: subcommand parsing and dispatch.
#pragma once

#include <string>

namespace remat::cli {

/// The message printed for an error: LibTorch's refusal to allocate (the allocator's
/// "can't allocate memory: you tried to allocate N bytes") as a sentence saying what to
/// change, and any message of more than 2,000 bytes cut to its start and end around a
/// note, so that no message repeats megabytes of input.
std::string error_text(const std::string& message);

/// Parses argv and runs the chosen subcommand; returns the process exit code.
/// Every user error is reported as one sentence on stderr with a non-zero exit.
int run(int argc, char** argv);

}  // namespace remat::cli
