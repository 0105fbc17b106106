// `remat launch`: one subcommand run as N local ranks of a distributed job, like
// `torchrun --standalone --nproc-per-node N`. Rank 0 hosts the c10d TCPStore; when one rank
// fails, the launcher stops the others, as torchrun's agent does.
#pragma once

#include <string>
#include <vector>

namespace remat::cli {

struct LaunchArgs {
  int nproc = 0;                     ///< ranks to start, 1 to 1024
  int master_port = 0;               ///< rank 0's store port; 0: a port free on 127.0.0.1 now
  double grace = 30;                 ///< seconds the ranks get to stop after SIGTERM, then SIGKILL
  std::vector<std::string> command;  ///< the subcommand and its arguments, verbatim for every rank
};

/// A TCP port free on 127.0.0.1 when asked (another process may still take it before
/// rank 0 binds it, which is what --master-port is for). Throws a sentence when the kernel
/// gives none.
int free_port();

/// The subcommands a rank may run: prepare, train, plan, bench, generate.
const std::vector<std::string>& launchable_subcommands();

/// The environment of local rank `rank` of `nproc`, as "NAME=value" strings: `base` (a
/// null-terminated array like `environ`) without TORCHELASTIC_USE_AGENT_STORE and without
/// its own values of the variables set here, plus RANK and LOCAL_RANK (= rank), WORLD_SIZE
/// and LOCAL_WORLD_SIZE (= nproc), GROUP_RANK=0, MASTER_ADDR=127.0.0.1 and MASTER_PORT=port.
std::vector<std::string> rank_environment(int rank, int nproc, int port, const char* const* base);

/// Runs `args.command` as args.nproc children of this executable, each with its
/// rank_environment and the launcher's stdout and stderr, and waits for all of them.
/// SIGINT and SIGTERM sent to the launcher go to every rank. When a rank fails, one
/// sentence on stderr names it and the others get SIGTERM, then SIGKILL after args.grace
/// seconds. Children also get SIGTERM if the launcher dies. Returns 0 when every rank
/// exits 0, else the first failing rank's exit code (128 + signal for a signal).
/// Throws std::invalid_argument with a sentence, before starting anything, for arguments
/// out of range or a command that is not a launchable subcommand.
int cmd_launch(const LaunchArgs& args);

}  // namespace remat::cli
