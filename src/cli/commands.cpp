#include "cli/commands.h"

#include "cli/prepare.h"

#include "remat/memory.h"

#include <CLI/CLI.hpp>

namespace remat::cli {

int run(int argc, char** argv) {
  memory::install_cpu_tracking();
  CLI::App app{"remat: transformer training with planned activation recomputation"};
  app.require_subcommand(1);
  add_prepare_command(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}

}  // namespace remat::cli
