// `remat launch`: one subcommand run as N local ranks of a distributed job, like
// `torchrun --standalone --nproc-per-node N`, or as this node's share of a job over several
// nodes, like torchrun's `--nnodes --node-rank --master-addr` (one launcher per node, each
// started by hand or by a scheduler). Rank 0, on node 0, hosts the c10d TCPStore; when one
// local rank fails, the launcher stops the others, as torchrun's agent does, and the ranks
// on other nodes stop through the job's failure detection (see remat/dist.h); with
// --max-restarts it then starts the job again, as torchrun's agent does.
#pragma once

#include <string>
#include <vector>

namespace remat::cli {

struct LaunchArgs {
  int nproc = 0;      ///< ranks to start on this node, 1 to 1024; the same on every node
  int nnodes = 1;     ///< nodes in the job, 1 to 1024, each running one `remat launch`
  int node_rank = 0;  ///< this node's index, 0 to nnodes - 1
  /// Node 0's address as every node reaches it; empty: 127.0.0.1, allowed only for one node.
  std::string master_addr;
  int master_port = 0;   ///< rank 0's store port; 0: a port free on 127.0.0.1 now (one node only)
  double grace = 30;     ///< seconds the ranks get to stop after SIGTERM, then SIGKILL
  int max_restarts = 0;  ///< starts of a failed job again, 0 to 1000 (torchrun's --max-restarts)
  /// The job's id, the same on every node and every start (TORCHELASTIC_RUN_ID); empty: one
  /// made for this launch, allowed only for one node when the job may restart.
  std::string run_id;
  std::vector<std::string> command;  ///< the subcommand and its arguments, verbatim for every rank
};

/// A TCP port free on 127.0.0.1 when asked (another process may still take it before
/// rank 0 binds it, which is what --master-port is for). Throws a sentence when the kernel
/// gives none.
int free_port();

/// The subcommands a rank may run: prepare, train, plan, bench, generate.
const std::vector<std::string>& launchable_subcommands();

/// The environment of local rank `local` of the node `args` describes, in its start
/// `restart` (0: the first), as "NAME=value" strings: `base` (a null-terminated array like
/// `environ`) without TORCHELASTIC_USE_AGENT_STORE and without its own values of the
/// variables set here, plus torchrun's: RANK = node_rank * nproc + local, LOCAL_RANK =
/// local, WORLD_SIZE = nnodes * nproc, LOCAL_WORLD_SIZE = nproc, GROUP_RANK = node_rank,
/// GROUP_WORLD_SIZE = nnodes, MASTER_ADDR = master_addr (127.0.0.1 when empty), MASTER_PORT
/// = port, TORCHELASTIC_RESTART_COUNT = restart, TORCHELASTIC_MAX_RESTARTS = max_restarts
/// and TORCHELASTIC_RUN_ID = run_id.
std::vector<std::string> rank_environment(const LaunchArgs& args, int local, int port, int restart,
                                          const char* const* base);

/// Runs `args.command` as args.nproc children of this executable, each with its
/// rank_environment and the launcher's stdout and stderr, and waits for all of them.
/// SIGINT and SIGTERM sent to the launcher go to every local rank. When a rank fails, one
/// sentence on stderr names it (by its rank in the job) and the other local ranks get
/// SIGTERM, then SIGKILL after args.grace seconds. Children also get SIGTERM if the
/// launcher dies. A job that failed (not one the launcher was asked to stop) starts again,
/// up to args.max_restarts times, each time with a sentence saying why; a restarted
/// `remat train` continues from its run's newest whole checkpoint. Returns 0 when every
/// local rank exits 0, else the last start's first failing rank's exit code (128 + signal
/// for a signal). Throws std::invalid_argument with a sentence, before starting anything,
/// for arguments out of range, several nodes without --master-addr and --master-port (or,
/// with restarts, --run-id), an address that does not resolve, or a command that is not a
/// launchable subcommand.
int cmd_launch(const LaunchArgs& args);

}  // namespace remat::cli
