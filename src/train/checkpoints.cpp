#include "train/checkpoints.h"

#include "remat/safetensors.h"
#include "train/run_dir.h"
#include "util/atomic_file.h"
#include "util/sha256.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace remat {

namespace fs = std::filesystem;

namespace {

// "step-<digits>.safetensors", the names write_checkpoint gives.
bool is_checkpoint_name(const std::string& name) {
  const std::string prefix = "step-", suffix = ".safetensors";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  return digits.find_first_not_of("0123456789") == std::string::npos;
}

// The files remat writes atomically in a run directory (a temporary copy first).
constexpr const char* kRunFiles[] = {
    "config.toml",  "config.json",     "plan.txt",       "metrics.jsonl",         "model.safetensors", "sample.txt",
    "summary.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "prices.json",       kJobIdFile};

}  // namespace

fs::path checkpoint_dir(const std::string& run_dir) { return fs::path(run_dir) / "checkpoints"; }

std::vector<fs::path> list_checkpoints(const std::string& run_dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(checkpoint_dir(run_dir), ec)) {
    if (is_checkpoint_name(e.path().filename().string())) out.push_back(e.path());
  }
  // The zero-padded step orders the names; a step past 10^8 has more digits and comes later.
  std::sort(out.begin(), out.end(), [](const fs::path& a, const fs::path& b) {
    const std::string x = a.filename().string(), y = b.filename().string();
    return x.size() != y.size() ? x.size() < y.size() : x < y;
  });
  return out;
}

std::string how_to_continue(const std::string& run_dir) {
  const std::vector<fs::path> saved = list_checkpoints(run_dir);
  if (saved.empty()) {
    return fmt::format(
        "it has no checkpoint yet, so free space (or fix the file) and start it again with `remat train --config "
        "{}/config.toml`",
        run_dir);
  }
  return fmt::format(
      "free space (or fix the file) and continue it from its newest checkpoint, {}, with `remat train --resume {}`",
      saved.back().filename().string(), run_dir);
}

void write_checkpoint(const TrainStep& stepper, const std::string& run_dir, int64_t steps, const std::mt19937_64& rng,
                      int64_t keep, bool write, const std::map<std::string, std::string>& extra) {
  const fs::path dir = checkpoint_dir(run_dir);
  const std::string path = (dir / fmt::format("step-{:08d}.safetensors", steps)).string();
  if (!write) {
    stepper.save_checkpoint(path, steps, rng, false, extra);
    return;
  }
  std::error_code ec;
  try {
    fs::create_directories(dir, ec);
    if (ec) {
      throw std::runtime_error(
          fmt::format("Cannot create the checkpoint directory {}: {}.", dir.string(), ec.message()));
    }
    stepper.save_checkpoint(path, steps, rng, true, extra);
    util::sync_directory(dir.string());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("{} The checkpoint after step {} is not written, so the run stops here; {}.",
                                         e.what(), steps, how_to_continue(run_dir)));
  }
  const std::vector<fs::path> all = list_checkpoints(run_dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove(all[i], ec);
}

void remove_temp_files(const std::string& run_dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(run_dir), ec)) {
    const std::string name = e.path().filename().string();
    for (const char* base : kRunFiles) {
      if (util::is_temp_name_of(name, base)) fs::remove(e.path(), ec);
    }
  }
  for (const auto& e : fs::directory_iterator(checkpoint_dir(run_dir), ec)) {
    const std::string name = e.path().filename().string();
    const size_t tmp = name.rfind(".tmp.");
    if (tmp != std::string::npos && is_checkpoint_name(name.substr(0, tmp)) &&
        util::is_temp_name_of(name, name.substr(0, tmp))) {
      fs::remove(e.path(), ec);
    }
  }
}

std::vector<nlohmann::json> keep_metrics(const std::string& run_dir, int64_t steps) {
  const std::string path = (fs::path(run_dir) / "metrics.jsonl").string();
  std::istringstream lines(util::read_file(path, "the metrics"));
  std::vector<nlohmann::json> kept;
  std::string text;
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    // A line cut short by a kill is not JSON; everything after the checkpoint goes too.
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() > steps) {
      continue;
    }
    kept.push_back(j);
    text += line + "\n";
  }
  util::write_file_atomically(path, text);
  return kept;
}

std::string checkpoint_problem(const std::string& path) {
  try {
    switch (model::verify_safetensors_checksum(path)) {
      case model::Checksum::differs:
        return "its bytes are not those written (the checksum over its tensors and metadata differs)";
      case model::Checksum::absent:
        return fmt::format(
            "it has no checksum (the '{}' tensor every checkpoint remat writes ends with), so its "
            "bytes cannot be verified",
            model::kChecksumTensor);
      case model::Checksum::matches:
        break;
    }
    return checkpoint_metadata_problem(model::read_safetensors_header(path).metadata);
  } catch (const std::exception& e) {
    // The reader's sentence, as a clause of the caller's.
    std::string why = e.what();
    if (!why.empty() && why.back() == '.') why.pop_back();
    return why;
  }
}

ResumePoint resume_point(const std::string& run_dir, bool verify, const std::function<void(const std::string&)>& note) {
  const std::vector<fs::path> saved = list_checkpoints(run_dir);
  std::vector<std::string> damaged;
  for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
    const std::string path = it->string();
    const std::string why = verify ? checkpoint_problem(path) : "";
    if (!why.empty()) {
      std::error_code ec;
      fs::rename(*it, path + ".damaged", ec);
      damaged.push_back(fmt::format("{} ({})", path, why));
      if (note) {
        note(fmt::format("The checkpoint {} cannot be resumed from: {}; it is kept as {}.damaged{}.", path, why,
                         it->filename().string(),
                         std::next(it) != saved.rend() ? ", and the previous one is tried" : ""));
      }
      continue;
    }
    ResumePoint point;
    point.path = *it;
    point.metadata = model::read_safetensors_header(path).metadata;
    CheckpointState state;
    if (const std::string bad = checkpoint_metadata_problem(point.metadata, &state); !bad.empty()) {
      throw std::runtime_error(fmt::format("The checkpoint {} cannot be resumed from: {}.", path, bad));
    }
    point.steps = state.steps;
    return point;
  }
  if (!damaged.empty()) {
    throw std::invalid_argument(
        fmt::format("{} has no whole checkpoint to resume from: every one is damaged ({}); "
                    "start the run again.",
                    run_dir, fmt::join(damaged, "; ")));
  }
  throw std::invalid_argument(
      fmt::format("{} has no training checkpoint to resume from (none was written before the "
                  "run stopped); start the run again.",
                  run_dir));
}

std::map<std::string, std::string> data_digests(const data::CorpusInfo& corpus) {
  return {{"data.text_sha256", corpus.text_sha256}, {"data.tokenizer_sha256", corpus.tokenizer_sha256}};
}

std::string check_same_data(const std::string& run_dir, const data::CorpusInfo& corpus,
                            const std::map<std::string, std::string>& metadata, bool restore) {
  const auto text = metadata.find("data.text_sha256");
  if (text != metadata.end() && text->second != corpus.text_sha256) {
    throw std::invalid_argument(
        fmt::format("The training text ({}, SHA-256 {}) is not the one the run trained on (SHA-256 {}, recorded in its "
                    "checkpoint): it changed since the run started; restore it, or start a new run.",
                    corpus.source, corpus.text_sha256, text->second));
  }
  const std::string own = (fs::path(run_dir) / "tokenizer.model").string();
  std::error_code ec;
  const std::string own_sha256 =
      fs::is_regular_file(own, ec) ? util::sha256_hex(util::read_file(own, "the run's tokenizer")) : "";
  const auto recorded = metadata.find("data.tokenizer_sha256");
  // The tokenizer the run trained with: recorded by its checkpoint, else its own file.
  const std::string trained = recorded != metadata.end() ? recorded->second : own_sha256;
  if (!trained.empty() && trained != corpus.tokenizer_sha256) {
    throw std::invalid_argument(fmt::format(
        "The tokenizer prepared now from the run's data ({}) differs from the one the run trained with ({}): the "
        "training text (data.text) or its preparation (data.vocab_size, data.tokenizer) changed since the run started, "
        "so its token ids would mean other pieces; restore the text the run trained on, or start a new run.",
        corpus.source, recorded != metadata.end() ? "recorded in its checkpoint" : own));
  }
  if (own_sha256 == corpus.tokenizer_sha256) return "";
  if (restore) {
    util::write_file_atomically(own, util::read_file(corpus.tokenizer_path(), "the prepared tokenizer"));
  }
  return fmt::format(
      "{} was {}; written again from the prepared corpus, whose tokenizer is the one the run trained with.", own,
      own_sha256.empty() ? "missing" : "damaged");
}

}  // namespace remat
