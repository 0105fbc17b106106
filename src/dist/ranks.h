// The ranks of a job: how many the launcher started and how a run of a config spreads over
// them (each rank's share of the batch, its threads and memory), and the small exchanges
// every rank makes alike (rank 0 first, each step's peaks).
#pragma once

#include "remat/config.h"
#include "remat/dist.h"

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace remat {

/// The job the launcher started, joined: null when this process runs alone (no launcher,
/// or one rank). Refuses with a sentence a parallel.dp x parallel.tp x parallel.pp that is
/// not the number of ranks started (the sentence shows how to start `subcommand`, "train"
/// or "bench", with the ranks it needs), or a train.batch they cannot share
/// evenly (data_parallel_ranks). A CUDA rank binds its GPU (dist::bind_gpu: its local
/// rank's, or the one run.device names), which the Comm's device() then is, and the ranks
/// agree on parallel.backend's choice (dist::choose_backend).
std::unique_ptr<dist::Comm> join_ranks(const Config& cfg, const std::string& subcommand);

/// The device this rank's tensors live on: the Comm's (the GPU join_ranks bound), or
/// run.device when the process runs alone (`ranks` null).
at::Device rank_device(const Config& cfg, const dist::Comm* ranks);

/// The data-parallel ranks a run of `cfg` trains on: parallel.dp when set, else the ranks
/// the launcher started over parallel.tp (1 without a launcher). Each rank's microbatch is
/// train.batch / that; refuses with a sentence a train.batch they cannot share evenly, or
/// a parallel.tp not dividing the ranks started.
int64_t data_parallel_ranks(const Config& cfg);

/// What one rank runs of `cfg`: train.batch its share of each microbatch over the
/// data_parallel_ranks (refused with their sentence when it does not divide), parallel.dp
/// their number (the ranks ZeRO-1 shards the optimizer over). Memory and time are planned
/// for it.
Config rank_share(const Config& cfg);

/// How a run of rank_share `local` spreads over the ranks, for a header line: empty for
/// one process, else e.g. ", data parallel over 2 ranks of 8 sequences, each layer split
/// over 2 tensor-parallel ranks".
std::string describe_ranks(const Config& local);

/// One step's peak tensor bytes on every rank, in rank order, and the stop signal to act
/// on: this rank's `signal` if it caught one, else the first any rank caught (0: none),
/// so that every rank stops after the same step. Without `ranks`, this rank's alone.
struct RankStep {
  std::vector<int64_t> peaks;
  int stop = 0;
};
/// Gathers them for 1-based `step` (named in a failure's sentence); every rank must call it.
RankStep gather_step(dist::Comm* ranks, int64_t peak_bytes, int signal, int64_t step);

/// The stop signal the ranks of `group` act on together: 0 when none caught one, else the
/// highest any caught; every rank of the group must call it. Without a group, `signal`.
int agreed_signal(dist::Group* group, int signal);

/// Raises `highest[i]` to `peaks[i]` for every rank i, growing `highest` to their count:
/// the highest peak of each rank over the steps seen so far.
void keep_highest(std::vector<int64_t>& highest, const std::vector<int64_t>& peaks);

/// Every rank's peak beside the prediction each was planned to (`predicted`, per rank),
/// e.g. "rank 0 81.00 MiB, rank 1 81.00 MiB (each predicted 81.02 MiB)", or with
/// predictions that differ (pipeline stages) "rank 0 90.1 MiB (predicted 90.2 MiB), ...".
std::string format_rank_peaks(const std::vector<int64_t>& peaks, const std::vector<int64_t>& predicted);

/// The intra-op threads of this rank: run.threads when set, else the host's cores shared
/// evenly by the ranks the launcher started on it (at least one).
int64_t rank_threads(const Config& cfg);

/// The memory a rank may still allocate on `device` (memory_available): a GPU's free
/// bytes shared evenly by the ranks on that GPU, or the host's shared evenly by the ranks
/// the launcher started on it; the least
/// over `ranks` (null: this process alone), so that every rank judges a plan alike; -1
/// where any rank cannot tell.
int64_t rank_memory(at::Device device, dist::Comm* ranks);

/// Rank 0 runs `work` first while the others wait for it (with no timeout, as long as its
/// heartbeat goes on: preparing a corpus may take minutes), then the others run it: for
/// work that fills a cache on disk they share (the prepared corpus, the time profile). A
/// failure on rank 0 ends every rank with rank 0's sentence. Without `comm`, just `work`.
void rank0_first(dist::Comm* comm, const std::string& what, const std::function<void()>& work);

}  // namespace remat
