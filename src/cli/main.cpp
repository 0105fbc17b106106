#include "cli/commands.h"

int main(int argc, char** argv) { return remat::cli::run(argc, argv); }
