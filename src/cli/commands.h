// The `remat` command line: subcommand parsing and dispatch.
#pragma once

#include <filesystem>
#include <string>

namespace remat::cli {

/// The message printed for an error: LibTorch's refusal to allocate (the allocator's
/// "can't allocate memory: you tried to allocate N bytes") as a sentence saying what to
/// change, and any message of more than 2,000 bytes cut to its start and end around a
/// note, so that no message repeats megabytes of input; its control characters but line
/// breaks escaped (util::terminal_text), whatever text a file put in it.
std::string error_text(const std::string& message);

/// The sentence for a file the filesystem refused (a loop of symbolic links, a permission,
/// a missing file): its path, the system's reason and what to do, where
/// std::filesystem's own text ("filesystem error: status: ...") says neither.
std::string filesystem_text(const std::filesystem::filesystem_error& e);

/// Parses argv and runs the chosen subcommand; returns the process exit code.
/// Every user error is reported as one sentence on stderr with a non-zero exit.
int run(int argc, char** argv);

}  // namespace remat::cli
