#include "run/price_source.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>

namespace remat {
namespace {

namespace fs = std::filesystem;

const char* kFile = "prices.json";

// The value of `values` that `name_of` spells `name`; throws naming `what`.
template <class E, size_t N>
E named(const std::string& name, const E (&values)[N], const char* (*name_of)(E), const char* what) {
  for (const E v : values) {
    if (name == name_of(v)) return v;
  }
  throw std::invalid_argument(fmt::format("\"{}\" is no {} of this build", name, what));
}

constexpr LossHead kHeads[] = {LossHead::fused, LossHead::recompute};

}  // namespace

PriceSource::PriceSource(Measure measure, AddCopies add_copies)
    : measure_(std::move(measure)), add_copies_(std::move(add_copies)) {}

PriceSource PriceSource::declared() {
  // Declared prices hold ac.offload_rate already.
  return PriceSource([](const Config& local) { return Prices::declared(local); }, [](const Config&, Prices&) {});
}

PriceSource PriceSource::recorded(const std::string& path) {
  const fs::path file = fs::is_directory(path) ? fs::path(path) / kFile : fs::path(path);
  const auto damaged = [&](const std::string& why) {
    return std::invalid_argument(fmt::format(
        "--prices {}: {} {}; give a run directory that `remat train` wrote (it records the prices it planned with in "
        "{}), or leave --prices out to price the run at parallel.compute_rate, link_rate and ac.offload_rate.",
        path, file.string(), why, kFile));
  };
  std::ifstream in(file);
  if (!in) throw damaged("cannot be read");
  const auto j = nlohmann::json::parse(std::istreambuf_iterator<char>(in), {}, nullptr, /*allow_exceptions=*/false);
  auto taken = std::make_shared<std::map<Key, Prices>>();
  try {
    if (!j.is_array()) throw std::invalid_argument("is not a JSON list");
    for (const nlohmann::json& e : j) {
      const Key key{named(e.at("attention").get<std::string>(), kAttentionOps, attention_name, "attention op"),
                    named(e.at("loss_head").get<std::string>(), kHeads, loss_head_name, "loss head"),
                    e.at("host_copies").get<bool>()};
      (*taken)[key] = prices_from_json(e.at("prices"));
    }
  } catch (const std::exception& e) {
    throw damaged(fmt::format("is damaged ({})", e.what()));
  }
  // Every price the run took is in `taken_`; asked for another, the source refuses it.
  const auto refuse = [taken, path](const Config& local, bool host_copies) {
    std::string priced;
    for (const auto& [k, p] : *taken) {
      priced +=
          fmt::format("{}{} attention with the {} head{}", priced.empty() ? "" : "; ", attention_name(std::get<0>(k)),
                      loss_head_name(std::get<1>(k)), std::get<2>(k) ? " and host copies" : "");
    }
    return std::invalid_argument(fmt::format(
        "The run at --prices {} priced {}, not {} attention with the {} head{}: plan it with its own config.toml "
        "(--config), whose settings it priced.",
        path, priced.empty() ? "nothing" : priced, attention_name(local.model.attention),
        loss_head_name(local.model.loss_head), host_copies ? " and host copies" : ""));
  };
  PriceSource source([refuse](const Config& local) -> Prices { throw refuse(local, false); },
                     [refuse](const Config& local, Prices&) { throw refuse(local, true); });
  source.taken_ = *taken;
  return source;
}

Prices PriceSource::of(const Config& local, bool host_copies) {
  const Key key{local.model.attention, local.model.loss_head, host_copies};
  if (const auto it = taken_.find(key); it != taken_.end()) return it->second;
  const Key ops{local.model.attention, local.model.loss_head, false};
  const auto it = taken_.find(ops);
  Prices p = it != taken_.end() ? it->second : measure_(local);
  if (it == taken_.end()) taken_[ops] = p;
  if (host_copies) add_copies_(local, p);
  return taken_[key] = p;
}

std::string PriceSource::record() const {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [key, p] : taken_) {
    out.push_back({{"attention", attention_name(std::get<0>(key))},
                   {"loss_head", loss_head_name(std::get<1>(key))},
                   {"host_copies", std::get<2>(key)},
                   {"prices", to_json(p)}});
  }
  return out.dump(2) + "\n";
}

}  // namespace remat
