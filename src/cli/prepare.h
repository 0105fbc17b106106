// `remat prepare`: builds (or finds cached) a tokenized corpus directory.
#pragma once

#include <CLI/CLI.hpp>

namespace remat::cli {

/// Adds the `prepare` subcommand to `app`.
void add_prepare_command(CLI::App& app);

}  // namespace remat::cli
