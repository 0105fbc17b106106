// The `remat` command line: subcommand parsing and dispatch.
#pragma once

namespace remat::cli {

/// Parses argv and runs the chosen subcommand; returns the process exit code.
/// Every user error is reported as one sentence on stderr with a non-zero exit.
int run(int argc, char** argv);

}  // namespace remat::cli
