#include "profile/cache.h"

#include "util/atomic_file.h"
#include "util/device.h"
#include "util/sha256.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace remat::profile {
namespace {

namespace fs = std::filesystem;

// The executable measuring: a rebuilt remat may run its ops at other speeds (its kernels
// changed), so a profile cached by another build must not be read. Its path, size and
// modification time stand for it (a digest of its bytes would cost a read of the whole
// binary every run); "unknown" where /proc/self/exe cannot be read.
std::string build_identity() {
  static const std::string id = [] {
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (ec) return std::string("unknown");
    const auto size = fs::file_size(exe, ec);
    if (ec) return std::string("unknown");
    const auto modified = fs::last_write_time(exe, ec);
    if (ec) return std::string("unknown");
    return util::sha256_hex(fmt::format("{}:{}:{}", exe.string(), size, modified.time_since_epoch().count()))
        .substr(0, 8);
  }();
  return id;
}

// Everything a measured time depends on, as a file name.
// `at_once`: the ranks measuring together, sharing the host as they will train.
std::string profile_key(const Config& cfg, const Model& model, int at_once) {
  const ModelConfig& m = cfg.model;
  const TrainConfig& t = cfg.train;
  // The BLAS and its threading change every matmul's time: a digest of their description.
  // "ig": tensor parallelism alone, whose profile times the gather of a sharded input.
  std::string key =
      fmt::format("{}-{}-{}-L{}-C{}-H{}-KV{}-F{}-V{}-p{}-{}{}-B{}-T{}-tp{}{}-ce{}{}-es{}-threads{}-blas{}-build{}",
                  model.device().str(), cfg.run.dtype, arch_name(m.arch), m.n_layer, m.d_model, m.n_head, m.n_kv_head,
                  m.d_ff, m.vocab_size, m.dropout, attention_name(m.attention),
                  m.attention == Attention::tiled ? m.attention_tile : 0, t.batch, t.seq, model.tp_size(),
                  model.sequence_parallel() ? "sp"
                  : model.tp_size() > 1     ? "ig"
                                            : "",
                  t.ce_chunk, loss_head_name(m.loss_head), cfg.ac.early_stop ? 1 : 0, at::get_num_threads(),
                  util::sha256_hex(blas_name()).substr(0, 8), build_identity());
  // ZeRO-1 updates a share of the parameters; without it the key is as it always was.
  if (zero_ranks(cfg) > 1) key += fmt::format("-zero{}", zero_ranks(cfg));
  if (at_once > 1) key += fmt::format("-ranks{}", at_once);
  std::replace(key.begin(), key.end(), ':', '_');
  return key + ".json";
}

// `p`'s prices from `j`, its path and optimizer bytes (the model's, not measured) kept.
void take_prices(TimeProfile& p, const nlohmann::json& j) {
  const int64_t bytes = p.optimizer_bytes;
  const std::string path = p.path;
  static_cast<Prices&>(p) = prices_from_json(j);
  p.optimizer_bytes = bytes;
  p.path = path;
}

}  // namespace

int64_t zero_ranks(const Config& cfg) {
  Layout layout;
  layout.dp = cfg.parallel.dp;
  layout.zero = cfg.parallel.zero;
  return layout.zero_ranks();
}

TimeProfile unmeasured(const Config& cfg, const Model& model, int at_once) {
  TimeProfile p;
  p.path = (fs::path(cfg.run.out_dir) / ".profiles" / profile_key(cfg, model, at_once)).string();
  for (const auto& prm : model.params()) p.optimizer_bytes += static_cast<int64_t>(prm.value.nbytes());
  if (zero_ranks(cfg) > 1) {
    std::vector<int64_t> numels;
    for (const auto& prm : model.params()) numels.push_back(prm.value.numel());
    const std::vector<int> owner = cost::zero_owners(numels, zero_ranks(cfg));
    p.optimizer_bytes = 0;
    for (size_t i = 0; i < owner.size(); ++i) {
      if (owner[i] == 0) p.optimizer_bytes += static_cast<int64_t>(model.params()[i].value.nbytes());
    }
  }
  return p;
}

bool read_cached(TimeProfile& p) {
  std::ifstream in(p.path);
  const auto j = nlohmann::json::parse(std::istreambuf_iterator<char>(in), {}, nullptr, /*allow_exceptions=*/false);
  try {
    take_prices(p, j);
    return true;
  } catch (const std::exception& e) {
    fmt::print(stderr, "The cached time profile {} is damaged ({}); measuring it again.\n", p.path, e.what());
    return false;
  }
}

void write_cached(const TimeProfile& p) {
  std::error_code ec;
  fs::create_directories(fs::path(p.path).parent_path(), ec);
  util::write_file_atomically(p.path, to_json(p).dump(2) + "\n");
}

void take_rank0s(dist::Comm* ranks, TimeProfile& p) {
  if (ranks == nullptr || ranks->size() == 1) return;
  const std::string key = "time-profile/" + fs::path(p.path).filename().string();
  if (ranks->rank() == 0) {
    nlohmann::json j = to_json(p);
    j["cached"] = p.cached;  // whether it is cached is rank 0's word too
    ranks->post(key, j.dump());
    return;
  }
  const auto j = nlohmann::json::parse(ranks->await(key, "sharing rank 0's time profile"), nullptr, false);
  try {
    take_prices(p, j);
    p.cached = j.at("cached").get<bool>();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("The time profile rank 0 shared could not be read (") + e.what() + ").");
  }
}

double rank0s(dist::Comm& ranks, double value, const std::string& what) {
  static_assert(sizeof(double) == sizeof(int64_t));
  std::vector<int64_t> bits(1);
  std::memcpy(bits.data(), &value, sizeof(double));
  bits = ranks.all_gather(bits, what)[0];
  std::memcpy(&value, bits.data(), sizeof(double));
  return value;
}

}  // namespace remat::profile
