#include "util/error_of.h"
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "util/temp_dir.h"
#include "data/test_text.h"
#include "remat/data.h"

namespace {

using namespace remat::data;

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::runtime_error>(f); }

// Token i has id (i * 7) % 1000: distinct neighbours, so shifted windows are checkable.
TokenDataset ramp(int64_t n) { return TokenDataset((at::arange(n, at::kLong) * 7) % 1000, "the ramp"); }

TEST(TokenDataset, SamplesAreNextTokenPairs) {
  const TokenDataset data = ramp(5000);
  std::mt19937_64 rng(42);
  const Batch batch = data.sample(8, 64, rng);
  ASSERT_EQ(batch.tokens.sizes(), at::IntArrayRef({8, 64}));
  ASSERT_EQ(batch.targets.sizes(), at::IntArrayRef({8, 64}));
  EXPECT_EQ(batch.tokens.scalar_type(), at::kLong);
  EXPECT_EQ(batch.targets.scalar_type(), at::kLong);
  // targets are the inputs shifted by one, and both are consecutive runs of the stream.
  EXPECT_TRUE(at::equal(batch.tokens.narrow(1, 1, 63), batch.targets.narrow(1, 0, 63)));
  EXPECT_TRUE(at::equal(batch.targets, (batch.tokens + 7) % 1000));
}

TEST(TokenDataset, SamplingIsDeterministicPerSeed) {
  const TokenDataset data = ramp(5000);
  std::mt19937_64 a(7), b(7), c(8);
  const Batch x = data.sample(4, 32, a), y = data.sample(4, 32, b), z = data.sample(4, 32, c);
  EXPECT_TRUE(at::equal(x.tokens, y.tokens));
  EXPECT_TRUE(at::equal(x.targets, y.targets));
  EXPECT_FALSE(at::equal(x.tokens, z.tokens));
  // The stream continues: the next batch differs from the first.
  EXPECT_FALSE(at::equal(data.sample(4, 32, a).tokens, x.tokens));
}

TEST(TokenDataset, SampleOffsetsCoverEveryValidStart) {
  // 10 tokens, windows of 3 + 1: starts 0..6 are valid, and each must occur.
  const TokenDataset data(at::arange(10, at::kInt));
  std::mt19937_64 rng(1);
  std::set<int64_t> starts;
  for (int i = 0; i < 200; ++i) {
    const Batch b = data.sample(5, 3, rng);
    for (int64_t r = 0; r < 5; ++r) starts.insert(b.tokens[r][0].item<int64_t>());
  }
  EXPECT_EQ(starts, (std::set<int64_t>{0, 1, 2, 3, 4, 5, 6}));
}

TEST(TokenDataset, SequentialBatchesTileTheStream) {
  const TokenDataset data(at::arange(101, at::kInt));  // windows of 10: 10 of them
  EXPECT_EQ(data.num_sequential_batches(4, 10), 3);    // 4 + 4 + 2 rows
  const Batch first = data.sequential(0, 4, 10);
  EXPECT_TRUE(at::equal(first.tokens, at::arange(40, at::kLong).view({4, 10})));
  EXPECT_TRUE(at::equal(first.targets, at::arange(1, 41, at::kLong).view({4, 10})));
  const Batch last = data.sequential(2, 4, 10);
  ASSERT_EQ(last.tokens.size(0), 2);
  EXPECT_EQ(last.targets[1][9].item<int64_t>(), 100);
  EXPECT_TRUE(at::equal(data.sequential(1, 4, 10).tokens, data.sequential(1, 4, 10).tokens));
  EXPECT_NE(error_of([&] { data.sequential(3, 4, 10); }).find("has 3 batches"), std::string::npos);
}

TEST(TokenDataset, RefusesSequencesLongerThanTheData) {
  const TokenDataset data = ramp(100);
  std::mt19937_64 rng(0);
  EXPECT_EQ(error_of([&] { data.sample(2, 100, rng); }),
            "A sequence of 100 tokens needs at least 101 tokens (inputs and next-token "
            "targets), but the ramp has 100.");
  EXPECT_NO_THROW(data.sample(2, 99, rng));
  EXPECT_NE(error_of([&] { data.num_sequential_batches(1, 200); }).find("the ramp has 100"), std::string::npos);
  EXPECT_NE(error_of([&] { data.sample(0, 10, rng); }).find("0 x 10"), std::string::npos);
}

TEST(TokenDataset, OpensPreparedSplitsAndChecksIds) {
  remat::testing::TempDir dir;
  std::ofstream(dir / "text.txt") << remat::testing::make_text(800);
  PrepareOptions options;
  options.text_file = dir / "text.txt";
  options.out_dir = dir / "corpus";
  options.vocab_size = 400;
  const CorpusInfo info = prepare_corpus(options);

  const TokenDataset val = TokenDataset::open(options.out_dir, Split::val);
  EXPECT_EQ(val.size(), info.val_tokens);
  const std::vector<int32_t> ids = val.ids(0, val.size());
  EXPECT_LT(*std::max_element(ids.begin(), ids.end()), 400);

  // An id beyond the vocabulary (a corrupted file of the right size) is refused by name.
  {
    std::fstream f(info.train_path(), std::ios::in | std::ios::out | std::ios::binary);
    const char big[2] = {'\xff', '\xff'};  // 65535, little-endian
    f.seekp(2 * 5);
    f.write(big, 2);
  }
  // The file is mapped, not scanned: the id is refused where a read meets it, not before.
  const TokenDataset train = TokenDataset::open(info, Split::train);
  EXPECT_NO_THROW(train.ids(0, 5));
  EXPECT_NO_THROW(train.sequential(0, 1, 4));  // tokens 0 to 4
  const std::string error = error_of([&] { train.sequential(0, 1, 5); });
  EXPECT_EQ(error, "The token file " + info.train_path() +
                       " holds id 65535 at position 5, outside the 400-piece vocabulary; run `remat prepare` to "
                       "rebuild the corpus.");
  EXPECT_EQ(error_of([&] { train.ids(3, 4); }), error);
}

}  // namespace
