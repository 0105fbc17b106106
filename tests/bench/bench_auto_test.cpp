// A sweep with both `auto` settings: each row names the attention op and the loss head its
// entry ran, the ones the run's resolution (remat plan's) takes for that entry.
#include "data/test_text.h"
#include "remat/bench.h"
#include "remat/trainer.h"
#include "run/choice_profiles.h"
#include "run/run.h"
#include "util/temp_dir.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace remat {
namespace {

namespace fs = std::filesystem;

TEST(BenchAuto, RowsNameTheChoicesEachEntryRan) {
  const testing::TempDir dir;
  std::ofstream(dir / "corpus.txt") << testing::make_text(600);
  // tiny-gpt2 at 256 positions: math keeps the [T x T] probabilities, tiled does not, so a
  // budget between their least peaks fits tiled alone.
  const std::vector<std::string> common = {"model.preset=tiny-gpt2",
                                           "model.vocab_size=512",
                                           "model.max_seq=256",
                                           "train.batch=2",
                                           "train.seq=256",
                                           "model.attention=auto",
                                           "model.loss_head=auto",
                                           "ac.profile=false",
                                           "data.vocab_size=512",
                                           "data.text=" + (dir / "corpus.txt").string(),
                                           "data.dir=" + (dir / "data").string(),
                                           "run.threads=1",
                                           "run.progress=false"};
  Config base = load_config("", common);
  base.model.loss_head = LossHead::fused;
  const int64_t math = testing::least_budget(base, Attention::math),
                tiled = testing::least_budget(base, Attention::tiled);
  ASSERT_LT(tiled + (1 << 20), math);  // a MiB apart: the corpus the run holds does not matter
  const std::string between = std::to_string((math + tiled) / 2);

  BenchOptions o;
  o.overrides = common;
  o.entries = {{"none", {"ac.policy=none"}}, {"budget", {"ac.budget=" + between}}};
  o.steps = 1;
  o.warmup = 0;
  o.out = (dir / "bench").string();
  const BenchResult result = run_bench(o);
  ASSERT_EQ(result.rows.size(), 2u);

  // What remat plan resolves for each entry, on the same corpus.
  RunInputs in;
  in.corpus = data::load_corpus_info(corpus_dir(base.data));
  PriceSource prices(
      [](const Config&) {
        Prices p;
        p.times.flops_per_second = 1.0;
        return p;
      },
      [](const Config&, Prices&) {});
  in.prices = &prices;
  for (size_t i = 0; i < o.entries.size(); ++i) {
    std::vector<std::string> overrides = common;
    overrides.push_back(o.entries[i].overrides[0]);
    const RunSpec spec = resolve_run(load_config("", overrides), in);
    EXPECT_EQ(result.rows[i].attention, attention_name(spec.cfg.model.attention)) << o.entries[i].label;
    EXPECT_EQ(result.rows[i].loss_head, loss_head_name(spec.cfg.model.loss_head)) << o.entries[i].label;
    EXPECT_EQ(result.rows[i].predicted_peak_bytes, spec.plan.peak()) << o.entries[i].label;
  }
  EXPECT_EQ(result.rows[0].attention, "math");
  EXPECT_EQ(result.rows[0].loss_head, "fused");
  EXPECT_EQ(result.rows[1].attention, "tiled");
  EXPECT_LE(result.rows[1].peak_bytes, std::stoll(between));
}

}  // namespace
}  // namespace remat
