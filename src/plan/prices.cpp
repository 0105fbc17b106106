#include "remat/prices.h"

#include "remat/planner.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <stdexcept>

namespace remat {

Prices Prices::declared(const Config& cfg) {
  Prices p;
  p.times.flops_per_second = cfg.parallel.compute_rate * 1e12;
  p.times.link_bytes_per_second = cfg.parallel.link_rate * 1e9;
  p.times.link_latency_seconds = cfg.parallel.link_latency * 1e-6;
  p.times.data_link_bytes_per_second = cfg.parallel.dp_link_rate * 1e9;
  p.times.data_link_latency_seconds = cfg.parallel.dp_link_latency * 1e-6;
  p.times.host_bytes_per_second = cfg.ac.offload_rate * 1e9;
  // A GPU's copy engines run beside its compute; the CPU's copies take its cores.
  p.times.host_copies_overlap = cfg.run.device.is_cuda();
  p.times.host_copy_slowdown = cfg.ac.offload_slowdown;
  return p;
}

namespace {

// The optimizer step of the slowest stage to update (they update at once): the measured
// step's time per parameter byte updated, times the bytes each stage updates (half its
// moments' bytes: its share under ZeRO-1).
double stages_optimizer_seconds(const Prices& prices, const PlanResult& r) {
  if (prices.optimizer_bytes <= 0) return 0;
  int64_t most = 0;
  for (const auto& st : r.stages) most = std::max(most, st.statics.optimizer / 2);
  return prices.optimizer_seconds * static_cast<double>(most) / static_cast<double>(prices.optimizer_bytes);
}

}  // namespace

double data_parallel_seconds(const PlanResult& r) {
  double most = 0;
  for (const auto& st : r.stages) most = std::max(most, st.data_parallel_seconds);
  return most;
}

double predicted_step_seconds(const Prices& prices, const PlanResult& r, int64_t stage, int64_t grad_accum) {
  if (prices.times.layer_pass_seconds > 0) {
    return r.simulated_seconds + stages_optimizer_seconds(prices, r) + data_parallel_seconds(r);
  }
  if (r.stages.size() > 1 || prices.base_seconds <= 0) return 0;
  const cost::StepPrediction& p = r.stages[static_cast<size_t>(stage)];
  return prices.step_seconds(grad_accum, p.added_seconds()) + p.data_parallel_seconds;
}

double declared_step_seconds(const PlanResult& r) { return r.simulated_seconds + data_parallel_seconds(r); }

nlohmann::json to_json(const Prices& p) {
  const cost::NodeTimes& t = p.times;
  return {{"node_seconds", t.seconds},
          {"flops_per_second", t.flops_per_second},
          {"link_bytes_per_second", t.link_bytes_per_second},
          {"link_latency_seconds", t.link_latency_seconds},
          {"data_link_bytes_per_second", t.data_link_bytes_per_second},
          {"data_link_latency_seconds", t.data_link_latency_seconds},
          {"host_bytes_per_second", t.host_bytes_per_second},
          {"host_copy_latency_seconds", t.host_copy_latency_seconds},
          {"host_copies_overlap", t.host_copies_overlap},
          {"host_copy_slowdown", t.host_copy_slowdown},
          {"layer_pass_seconds", t.layer_pass_seconds},
          {"ends_pass_seconds", t.ends_pass_seconds},
          {"base_seconds", p.base_seconds},
          {"optimizer_seconds", p.optimizer_seconds},
          {"optimizer_bytes", p.optimizer_bytes},
          {"other_cpus", p.other_cpus ? nlohmann::json(*p.other_cpus) : nlohmann::json(nullptr)},
          {"path", p.path}};
}

Prices prices_from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw std::invalid_argument("the prices are not a JSON object");
  // A price is a finite number, at least 0; those written before a field existed read as 0.
  const auto price = [&](const char* key, bool required) {
    if (!j.contains(key)) {
      if (required) throw std::invalid_argument(std::string("the prices have no \"") + key + "\"");
      return 0.0;
    }
    const double v = j.at(key).get<double>();
    if (!std::isfinite(v) || v < 0) {
      throw std::invalid_argument(std::string("the price \"") + key + "\" is negative or not finite");
    }
    return v;
  };
  Prices p;
  cost::NodeTimes& t = p.times;
  t.seconds = j.at("node_seconds").get<std::map<std::string, double>>();
  for (const auto& [node, seconds] : t.seconds) {
    if (!std::isfinite(seconds) || seconds < 0) {
      throw std::invalid_argument("the time of node " + node + " is negative or not finite");
    }
  }
  t.flops_per_second = price("flops_per_second", true);
  if (t.flops_per_second <= 0) throw std::invalid_argument("the prices' FLOP rate is not positive");
  t.link_bytes_per_second = price("link_bytes_per_second", false);
  t.link_latency_seconds = price("link_latency_seconds", false);
  t.data_link_bytes_per_second = price("data_link_bytes_per_second", false);
  t.data_link_latency_seconds = price("data_link_latency_seconds", false);
  t.host_bytes_per_second = price("host_bytes_per_second", false);
  t.host_copy_latency_seconds = price("host_copy_latency_seconds", false);
  t.host_copies_overlap = j.value("host_copies_overlap", true);
  t.host_copy_slowdown = price("host_copy_slowdown", false);
  if (t.host_copy_slowdown >= 1) throw std::invalid_argument("the host copies' slowdown is not below 1");
  t.layer_pass_seconds = price("layer_pass_seconds", false);
  t.ends_pass_seconds = price("ends_pass_seconds", false);
  p.base_seconds = price("base_seconds", true);
  p.optimizer_seconds = price("optimizer_seconds", true);
  p.optimizer_bytes = static_cast<int64_t>(price("optimizer_bytes", false));
  if (j.contains("other_cpus") && !j.at("other_cpus").is_null()) p.other_cpus = price("other_cpus", false);
  p.path = j.value("path", std::string());
  return p;
}

}  // namespace remat
