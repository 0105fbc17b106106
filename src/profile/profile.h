// The measured prices (remat/prices.h) a plan's time is predicted from: how long each
// recompute node takes at the run's shapes on this device, how long a microbatch's
// forward and backward take without recompute, and the update around them; the
// tensor-parallel links and the host copies. Measured once per device and shape and cached
// on disk (src/profile/cache.cpp), measured here (measure.cpp).
#pragma once

#include "remat/config.h"
#include "remat/cost.h"
#include "remat/data.h"
#include "remat/dist.h"
#include "remat/model.h"
#include "remat/prices.h"
#include "util/cpu_load.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace remat {

/// Prices measured on this machine (their path the cache file), and whether they were read
/// from it.
struct TimeProfile : Prices {
  bool cached = false;  ///< read from the cache rather than measured now
};

/// Reads the profile of `cfg`'s model and train shape on `model`'s device from
/// `<run.out_dir>/.profiles/`, or measures it there: a few forward/backward passes of one
/// batch of `data` with every layer recomputed (the store times each node; the base time
/// is the pass minus its measured recompute), and twice the update around the passes:
/// the gradients zeroed (Model::zero_grad: the embedding's) and clipped, AdamW on scratch
/// copies of the parameters (under parallel.zero = 1, of data-parallel rank 0's share of
/// them over parallel.dp ranks; the exchange of the updated parameters is not timed, nor is
/// the gradient all-reduce) and the weights cast to the compute dtype. The model's weights
/// are untouched; its gradients are zeroed and its activation plan must be set again
/// afterwards.
///
/// Timed beside other work (more of the machine's CPUs busy with other processes than
/// util::tolerated_other_cpus allows for the run's threads: rank 0's machine governs), it
/// is measured again, at most twice, and if still loaded used but not cached, which stderr
/// says. Under tensor parallelism (parallel.tp > 1, `together` the job) the links
/// measure_link_rate measures are cached with it too, and read from the cache.
///
/// With `together` (tensor parallelism, whose passes run the group's collectives, or
/// pipeline stages sharing a host), every rank calls this at once: all read the cache
/// before any writes, measure unless every one found it, and rank 0 alone writes it; then
/// every rank takes rank 0's times, so that all of them plan alike, and caches them or not
/// as rank 0 does.
TimeProfile measure_time_profile(const Config& cfg, Model& model, const data::TokenDataset& data,
                                 dist::Comm* together = nullptr);

/// Where measure_time_profile and a run read the clocks that tell how busy the machine
/// was: util::read_cpu_times, or `reader` (a test's readings); an empty one restores it.
void set_cpu_times_reader(std::function<util::CpuTimes()> reader);
/// The clocks now, as that reader reads them.
util::CpuTimes cpu_times();

/// How much of rank 0's machine other processes used over a window, as every rank is told.
struct MachineLoad {
  std::optional<double> other_cpus;  ///< unknown where /proc/stat could not be read
  double tolerated = 0;              ///< util::tolerated_other_cpus for this job's threads
  bool suspect() const { return other_cpus && *other_cpus > tolerated; }
};

/// The load on rank 0's machine between `from` and `to`, on every rank of `together` (all
/// of them call this at once). The ranks running at once on rank 0's host are this job,
/// not other processes: their CPU time is taken off the machine's (each process once:
/// ranks may be threads of one) and their threads count as the job's.
MachineLoad machine_load(dist::Comm* together, const util::CpuTimes& from, const util::CpuTimes& to);

/// measure_time_profile for this rank of the job `ranks` (null: alone), `cfg` its
/// rank_share: under tensor parallelism every rank measures at once on its `model`;
/// otherwise rank 0 measures alone while the others wait (rank0_first). Every rank
/// returns rank 0's profile.
TimeProfile rank_time_profile(const Config& cfg, Model& model, const data::TokenDataset& data, dist::Comm* ranks);

/// The time profile pipeline stages (parallel.pp > 1) plan with: a stage is not a whole
/// model, so it is measured on probes of `cfg`'s model cut to two layers and to one (split
/// over the tensor-parallel group as the stages are), each built in `dtype` on `device` for
/// this and freed after, by every rank of `ranks` at once (measure_time_profile's
/// `together`), as the stages will run. The two-layer probe's node times price
/// every layer's recompute; the difference of the two probes' passes is one layer's pass
/// and the rest the embedding's and head's (NodeTimes::layer_pass_seconds,
/// ends_pass_seconds), from which the planner times each stage; its base and optimizer
/// times are the probe's, not a stage's (scale the optimizer's by optimizer_bytes).
TimeProfile probe_time_profile(const Config& cfg, at::Device device, at::ScalarType dtype,
                               const data::TokenDataset& data, dist::Comm* ranks);

/// The links of `group`, one of `ranks`' groups (its tensor- or data-parallel one, named
/// by `links` in failures), measured: every such group times
/// all-gathers of a small and a large tensor at once (as its collectives will run, groups
/// sharing a host's links), fits the ring model of graph::LinkTraffic to them (the
/// latency per ring step and the rate each rank sends at) and every rank takes rank 0's
/// fit, so that all of them plan alike. Every rank of the job calls it; a second or so.
struct LinkRate {
  double bytes_per_second = 0;
  double latency_seconds = 0;
};
LinkRate measure_link_rate(dist::Comm& ranks, dist::Group& group, const std::string& links);

/// How fast the offloaded slots' copies move between `device` and host memory
/// (memory::HostPool), each way: bytes a second and seconds a storage, fitted to the
/// median round trips of one 64 MiB tensor (beyond the caches) and of 64 tensors of 4 KiB;
/// on CUDA, whose copies run beside the compute, also how much slower `dtype` matmuls of
/// 4096 x 4096 run beside a copy of 256 MiB each way (NodeTimes::host_copy_slowdown).
struct HostCopy {
  double bytes_per_second = 0;
  double latency_seconds = 0;
  double compute_slowdown = 0;
};
HostCopy measure_host_copy(at::Device device, at::ScalarType dtype);

/// Sets `prices`' host copy rate, latency and compute slowdown to those
/// measure_host_copy measures on `device` in `dtype` now, rank 0's for every rank of
/// `ranks` (as the rest of a profile is), and whether the copies overlap the compute (on
/// CUDA; NodeTimes::host_copies_overlap).
void add_host_copy(Prices& prices, at::Device device, at::ScalarType dtype, dist::Comm* ranks);

/// The prices a run of `cfg` (a rank_share) plans from, as `remat train` and `remat bench`
/// take them: under ac.profile, rank_time_profile on the whole model `create` builds, left
/// in `model` for the caller to train (the one there before is freed first), or, with
/// pipeline stages, probe_time_profile; without ac.profile, FLOPs at `matmul_rate`, which
/// predict no step time. Under tensor parallelism either way, with the links
/// measure_link_rate measures (cached with the profile under ac.profile), which price the
/// collectives no node time covers (all of them without ac.profile). With several
/// data-parallel ranks, their links measured so too (each run, uncached), which price the
/// gradient sums, ZeRO's exchange and gathers (cost::DataParallelTraffic). The host copies are
/// add_host_copy's, measured apart: a run that offloads prices its ops as one that does not.
Prices run_prices(const Config& cfg, at::Device device, at::ScalarType dtype, const data::TokenDataset& data,
                  dist::Comm* ranks, double matmul_rate, const std::function<std::unique_ptr<Model>()>& create,
                  std::unique_ptr<Model>& model);

}  // namespace remat
