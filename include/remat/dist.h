// Several processes training one model: rendezvous, a c10d process group, and collectives
// and point-to-point transfers that never hang silently.
//
// Ranks meet through a c10d TCPStore found from the launcher's environment (torchrun's
// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OpenMPI's and Slurm's equivalents) and talk
// through c10d process groups: Gloo on the CPU, NCCL or Gloo between GPUs (choose_backend),
// and always a Gloo group on the CPU for the job's own small exchanges. Every collective
// and transfer is waited for in
// slices: a rank that sees one fail (a peer's connection reset) posts the failure in the
// store, and every other rank, still waiting, reads it and stops too. Which rank is lost
// comes from heartbeats each rank's background thread adds to the store: the one whose
// count stops.
// So a dead, stopped or never-started rank ends every rank with a sentence naming it,
// within parallel.timeout, never a silent hang.
#pragma once

#include "remat/config.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace remat::dist {

/// How a collective combines the ranks' elements.
enum class Reduce { sum, max };

/// A point-to-point transfer or a collective under way (Group::send, Group::recv,
/// Group::start_all_reduce). It holds the tensors until wait() returns, so the caller may
/// drop its own references at once.
class Transfer {
 public:
  virtual ~Transfer() = default;
  /// Returns once the transfer is done: a sent tensor may then change, a received one
  /// holds the peer's bits. Fails like a collective: a sentence naming the operation and
  /// the lost rank, within the job's timeout. Call it once; destroying a transfer never
  /// waited for abandons it (after a failure elsewhere).
  virtual void wait() = 0;
};

/// Ranks that act together: every rank of a job, the ranks sharing one copy of the model's
/// tensors (a tensor-parallel group), the ranks holding the same shard of it (a
/// data-parallel group), or the stages one microbatch passes through (a pipeline group).
/// Ops reach their group through graph::RunContext; a null group there means one rank.
class Group {
 public:
  virtual ~Group() = default;
  /// This rank's index in the group, from 0, and the group's size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Combines each tensor element by element over the group, in place (float32, float64
  /// or int64; contiguous; on the CPU or this rank's GPU, either on either backend).
  /// `what` names the operation in a failure ("the tensor-parallel all-reduce of
  /// attn_c_proj in layer 3").
  virtual void all_reduce(std::vector<at::Tensor>& tensors, Reduce op, const std::string& what) = 0;
  /// all_reduce started and returned at once, so that work goes on while it runs (the
  /// gradients' all-reduce during the backward); the tensors hold the result once wait()
  /// returns and must not change before. Every rank of the group starts the same
  /// collectives in the same order.
  virtual std::unique_ptr<Transfer> start_all_reduce(std::vector<at::Tensor> tensors, Reduce op,
                                                     const std::string& what) = 0;
  /// Every rank's `t` (the same shape on every rank), concatenated along `dim` in rank
  /// order; a new tensor.
  virtual at::Tensor all_gather(const at::Tensor& t, int64_t dim, const std::string& what) = 0;
  /// Starts sending `t` (any dtype, bfloat16 too, which Gloo's collectives refuse: its
  /// bytes travel as they are) to rank `peer` of this group, which receives it with recv(_, this rank, `tag`); returns at once. Tensors sent
  /// to one peer under one tag (>= 0) arrive in the order sent. A send is done only once
  /// the peer has posted the matching receive (Gloo moves no bytes before), so post a
  /// step's receives before waiting for its sends: two neighbours that each send, then
  /// receive (a 1F1B stage's activations forward, its neighbour's gradients back), then
  /// wait, never block each other.
  virtual std::unique_ptr<Transfer> send(const at::Tensor& t, int peer, int tag, const std::string& what) = 0;
  /// Starts receiving into `t` (contiguous, with exactly the bytes the peer sends: same
  /// dtype and element count) what rank `peer` of this group sends under `tag`.
  virtual std::unique_ptr<Transfer> recv(at::Tensor& t, int peer, int tag, const std::string& what) = 0;

  /// What this rank's all-reduces over the group have summed so far (a group of more than
  /// one rank): the tensors' bytes and how many, each tensor a collective of its own, which
  /// the cost model's data-parallel traffic is held to (cost::DataParallelTraffic).
  struct Reduced {
    int64_t bytes = 0;
    int64_t collectives = 0;
  };
  Reduced reduced() const { return reduced_; }

 protected:
  Reduced reduced_;
};

/// An all-gather of whole tensors from their owners, as an exact all-reduce in place over
/// `group`: every rank but a tensor's owner (`owned`) gives -0.0, and x + (-0.0) == x bit for
/// bit for every float x (a +0.0 fill would turn an owner's -0.0 into +0.0), in whatever
/// order the ranks are summed. In place, it allocates nothing where Group::all_gather would
/// need a packed copy of each rank's tensors and the gathered copies of all of them.
/// `whole` is the one tensor the collective moves: one of `tensors`, or a buffer they are
/// all views of (one collective where each tensor would be one of its own).
void from_owners(const std::vector<at::Tensor>& tensors, const std::vector<bool>& owned, const at::Tensor& whole,
                 Group& group, const std::string& what);

/// Where this process stands in a multi-process job, as its launcher described it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  ///< ranks on this host (they share its cores)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True): every rank,
  /// rank 0 too, connects as a client, under `store_prefix`.
  bool agent_store = false;
  std::string store_prefix;
};

/// Reads the launch variables from `getenv`: torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE,
/// TORCHELASTIC_RESTART_COUNT), else OpenMPI's (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
/// LOCAL_SIZE) or Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
/// SLURM_NTASKS_PER_NODE), whose MASTER_ADDR and MASTER_PORT must still be set.
/// nullopt when no launcher set a world size (a single process). Throws a sentence naming
/// the variable when one is set but malformed or inconsistent (rank outside the world).
std::optional<LaunchEnv> launch_env(const std::function<const char*(const char*)>& getenv);
/// launch_env of this process's environment.
std::optional<LaunchEnv> launch_env();

/// The library a Comm's tensor, data and pipeline groups run on (choose_backend).
enum class Backend { gloo, nccl };
/// "Gloo" / "NCCL", for sentences.
const char* backend_name(Backend b);

/// The GPU a CUDA rank binds, as an index among those CUDA shows the process (`gpus` of
/// them, CUDA_VISIBLE_DEVICES counted): the index run.device names (`asked`), which every
/// rank then shares; else its local rank when this host's ranks have a GPU each; else its
/// local rank modulo `gpus`, so that ranks share GPUs evenly (a launcher that gives each
/// rank its own CUDA_VISIBLE_DEVICES shows it one GPU: index 0). Throws a sentence when
/// the process sees no GPU or `asked` is not among them.
int bind_gpu(const LaunchEnv& env, std::optional<int> asked, int gpus);

/// What names a GPU across the job: the host, and the device as CUDA_VISIBLE_DEVICES names
/// the `index`-th it shows (an index or a UUID), or `index` when it is unset. Ranks with
/// the same identity share one GPU.
std::string gpu_identity(const std::string& host, const char* visible_devices, int index);

/// What this process's NCCL allows (nccl_support).
struct NcclSupport {
  int major = 0, minor = 0;  ///< the library's version; 0.0: this build has no NCCL
  /// NCCL_MULTI_RANK_GPU_ENABLE=1 is set for a NCCL that reads it (2.30 and later): two
  /// ranks may then share a GPU, which NCCL refuses otherwise ("Duplicate GPU detected").
  bool multi_rank = false;
};
/// This build's NCCL, read from the library, and the multi-rank variable.
NcclSupport nccl_support();

/// The backend of a job whose ranks hold the GPUs `gpus` names (gpu_identity, one per
/// rank; empty for CPU ranks), as parallel.backend asks; the same on every rank, since
/// every rank decides from the same identities. auto: NCCL where the build has it and no
/// GPU holds more ranks than NCCL allows, else Gloo (on CUDA tensors, through the host for
/// sends and receives). Throws a sentence naming the ranks and GPU for what cannot run:
/// NCCL asked for CPU ranks, for a build without it, or for ranks sharing a GPU beyond
/// its multi-rank mode.
Backend choose_backend(CommBackend asked, const std::vector<std::string>& gpus, const NcclSupport& nccl);

/// Where a rank's tensors live and which backend it asks for (Comm::connect).
struct RankDevice {
  at::Device device = at::kCPU;  ///< the CPU, or the GPU bind_gpu chose for this rank
  CommBackend backend = CommBackend::automatic;
};

/// A process group of every rank, with failure detection, and its tensor-parallel,
/// data-parallel and pipeline groups. Not copyable; one per process (tests may hold
/// several, one per thread, joined through one store).
class Comm {
 public:
  /// Joins the job `env` describes: rank 0 hosts the store (unless the agent does), every
  /// rank announces itself and waits for the others, then the Gloo groups connect. Throws
  /// a sentence naming the ranks that did not join within `timeout`, or the store address
  /// that could not be reached. `timeout` also bounds every collective.
  ///
  /// Gloo listens on the address of the interface this host's route to MASTER_ADDR goes
  /// through, so ranks on other hosts (or network namespaces) reach it whatever this
  /// host's name resolves to; the interface GLOO_SOCKET_IFNAME names, when it is set,
  /// instead (PyTorch's variable, for hosts whose peers reach them by another network).
  ///
  /// The world is `pp` pipeline stages x dp data-parallel replicas x `tp` tensor-parallel
  /// ranks, ordered as Megatron orders them, tensor-parallel innermost so that a
  /// tensor-parallel group shares a host where it can: rank = stage * dp * tp + replica *
  /// tp + tp rank. A tensor-parallel group is `tp` ranks in a row (same stage and replica);
  /// a data-parallel group the ranks of one stage at the same place in their
  /// tensor-parallel groups; a pipeline group the ranks at the same replica and place in
  /// every stage, its rank() the stage. `tp` must divide the world size, and `pp` the
  /// world size over `tp` (a sentence says so before any rank connects).
  ///
  /// Each rank tells the others its GPU (gpu_identity of `device`) as it joins, so that
  /// every rank chooses the same backend (choose_backend) before any group connects.
  static std::unique_ptr<Comm> connect(const LaunchEnv& env, std::chrono::milliseconds timeout, int tp = 1, int pp = 1,
                                       const RankDevice& device = {});
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// This rank's device (RankDevice), and the backend of the groups below.
  at::Device device() const;
  Backend backend() const;
  /// How many ranks of the job share this rank's GPU (1 for a CPU rank): their memory is
  /// one device's.
  int device_sharers() const;
  /// Every rank; this rank's tensor-parallel group; its data-parallel group; its pipeline
  /// group. Their collectives and transfers fail like this class's own (a sentence naming
  /// the lost rank, by its rank in the job).
  Group& world();
  Group& tensor();
  Group& data();
  Group& pipeline();

  /// Every rank's `values` (the same count on every rank), in rank order.
  std::vector<std::vector<int64_t>> all_gather(const std::vector<int64_t>& values, const std::string& what);
  /// Returns when every rank has called it.
  void barrier(const std::string& what);
  /// Publishes `value` under `key` in the job's store, for await().
  void post(const std::string& key, const std::string& value);
  /// The value another rank posted under `key`, waited for with no timeout as long as
  /// every rank's heartbeat goes on (for work of unknown length on one rank, such as
  /// preparing a corpus); `what` names the wait in a failure.
  std::string await(const std::string& key, const std::string& what);
  /// Stops the job with `message`: every other rank ends with it as its own error, in
  /// whatever it waits for. Returns once they have read it (a lost rank is waited for at
  /// most two heartbeat silences), for the caller to throw its own error; this rank's
  /// collectives are unusable after it.
  void abort(const std::string& message);
  /// Every rank leaves together: each says it finished (a rank still waiting for it then
  /// names it as finished, not lost), the heartbeats stop and a barrier makes sure no rank
  /// closes the store (rank 0 hosts it) while another still talks to it. Call at the end
  /// of a successful run; the destructor does not, since after an error no barrier can be
  /// trusted to return.
  void finish();

  /// The store, the groups and the heartbeat thread (c10d stays out of this header).
  struct State;

 private:
  Comm(std::unique_ptr<State> state, int rank, int size);
  std::unique_ptr<State> state_;
  int rank_;
  int size_;
};

}  // namespace remat::dist
