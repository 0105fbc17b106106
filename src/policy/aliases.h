// The spellings other frameworks give a recompute policy (torchtune, Megatron-LM,
// ColossalAI, nanotron) and an offload (torchtune, Megatron-LM, TransformerEngine), each
// mapped one-to-one to the canonical grammar (grammar.h): private to src/policy.
#pragma once

#include "policy/grammar.h"
#include "remat/config.h"

#include <string>
#include <vector>

namespace remat::policy {

/// A policy asked for by one spelling: where it came from and its plan.
struct Candidate {
  std::string origin;
  ActivationPlan plan;
};

/// The policy each framework's keys in `ac` ask for, appended to `out` (none where its keys
/// are unset); a framework's keys that contradict each other are refused.
void torchtune(const AcConfig& ac, std::vector<Candidate>& out, const Compile& compile);
void megatron(const AcConfig& ac, std::vector<Candidate>& out, const Compile& compile);
void colossalai(const AcConfig& ac, const StageSplit& split, std::vector<Candidate>& out, const Compile& compile);
void nanotron(const AcConfig& ac, std::vector<Candidate>& out, const Compile& compile);

/// An offload asked for by a framework's key: where it came from and its offload term.
struct OffloadAsk {
  std::string origin;
  std::string term;
};

/// The offloads the framework keys ask for, each checked against the recompute `plan`
/// the policy keys agreed on.
std::vector<OffloadAsk> offload_aliases(const AcConfig& ac, const StageSplit& split, const ActivationPlan& plan);

}  // namespace remat::policy
