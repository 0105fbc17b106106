// A run's training checkpoints on disk: writing and pruning them, choosing the one to
// resume from (verified, with a fallback to an older whole one), the temporary files a
// killed write leaves, the metrics kept up to a checkpoint, and the data a run trained on.
#pragma once

#include "remat/data.h"
#include "train/step.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace remat {

/// "<run_dir>/checkpoints".
std::filesystem::path checkpoint_dir(const std::string& run_dir);

/// The files named as checkpoints ("step-<steps, zero-padded>.safetensors"), oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::string& run_dir);

/// How to continue a run of `run_dir` stopped by a failed write (a full disk), as the end
/// of a sentence: from its newest checkpoint with `remat train --resume`, or, when it has
/// none yet, by starting it again from its config.toml.
std::string how_to_continue(const std::string& run_dir);

/// Writes the state after `steps` steps (TrainStep::save_checkpoint, with `extra` in its
/// metadata), flushes the directory entry, then removes all but the newest `keep`
/// checkpoints. A tensor-parallel rank that does not `write` only gives its parts. A failed
/// write throws a sentence that ends with how_to_continue.
void write_checkpoint(const TrainStep& stepper, const std::string& run_dir, int64_t steps, const std::mt19937_64& rng,
                      int64_t keep, bool write, const std::map<std::string, std::string>& extra);

/// Removes what a killed write of remat's left in the run directory and its checkpoints:
/// "<file>.tmp.<pid>" for the files remat writes there, and nothing else.
void remove_temp_files(const std::string& run_dir);

/// Keeps the metrics of the first `steps` steps (and the validations up to them) in
/// metrics.jsonl, dropping what a stopped run logged after its last checkpoint and any
/// line a kill cut short; returns them.
std::vector<nlohmann::json> keep_metrics(const std::string& run_dir, int64_t steps);

/// Where a resumed run starts.
struct ResumePoint {
  std::filesystem::path path;                   ///< the checkpoint
  int64_t steps = 0;                            ///< completed steps it holds
  std::map<std::string, std::string> metadata;  ///< its metadata (the plan, the data's digests)
};

/// Why the checkpoint at `path` cannot be trusted (its checksum differs, its header or
/// metadata is damaged or out of range), as a clause; "" when it is whole.
std::string checkpoint_problem(const std::string& path);

/// The newest checkpoint of `run_dir`. With `verify`, each is checked whole
/// (checkpoint_problem) from the newest down, and each that fails is renamed
/// "<name>.damaged", out of the way of the run's later checkpoints, and reported through
/// `note` with its reason; the first whole one is chosen. Throws a sentence when there is
/// none to resume from.
ResumePoint resume_point(const std::string& run_dir, bool verify, const std::function<void(const std::string&)>& note);

/// The metadata entries that record which data a run trains on, for its checkpoints.
std::map<std::string, std::string> data_digests(const data::CorpusInfo& corpus);

/// Refuses, with a sentence, to resume the run `run_dir` on other data than it trained on:
/// `corpus`'s text and tokenizer must be those the checkpoint's `metadata` records
/// (checkpoints written before the digests were recorded are held to the run's
/// tokenizer.model). Where the run's tokenizer.model is missing or is not the one the
/// checkpoint records but the prepared one is, writes it back from the corpus (where
/// `restore`: rank 0) and returns a note saying so; else returns "".
std::string check_same_data(const std::string& run_dir, const data::CorpusInfo& corpus,
                            const std::map<std::string, std::string>& metadata, bool restore);

}  // namespace remat
