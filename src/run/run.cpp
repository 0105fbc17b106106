#include "run/run.h"

#include "train/data_parallel.h"

namespace remat {

Config resolve_config(const Config& cfg, const std::optional<data::CorpusInfo>& corpus) {
  Config out = cfg;
  if (corpus) {
    resolve_vocab_size(out, corpus->vocab_size);
  } else if (out.model.vocab_size == 0) {
    // What `remat prepare` will train, padded as a run pads it.
    out.model.vocab_size = padded_vocab_size(out, out.data.vocab_size);
  }
  validate_config(out);
  return out;
}

RunSpec resolve_run(const Config& cfg, const RunInputs& in) {
  RunSpec spec;
  spec.cfg = resolve_config(cfg, in.corpus);
  spec.corpus = in.corpus;
  spec.corpus_dir = in.corpus_dir;
  if (in.corpus) spec.resident = data::TokenDataset::held_bytes(*in.corpus);
  spec.local = rank_share(spec.cfg);
  const ParallelConfig& p = spec.local.parallel;
  spec.layout = {p.dp, p.tp, p.sp, p.pp, in.stage, p.zero};
  spec.dtype = in.dtype;
  spec.plan = plan_run_auto(spec.cfg, spec.local, in.dtype, in.profile_of, spec.resident, in.stage, in.saved);
  spec.shape = step_shape(spec.local, in.dtype, spec.resident);
  return spec;
}

}  // namespace remat
