#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "remat/data.h"
#include "util/atomic_file.h"

namespace remat::data {

namespace {

// Uniform in [0, n) by rejection: unbiased, and unlike std::uniform_int_distribution the
// same on every standard library, so a seed names the same batches everywhere.
uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  const uint64_t limit = max - max % n;  // a multiple of n
  uint64_t x;
  do {
    x = rng();
  } while (x >= limit);
  return x % n;
}

// Rows of seq + 1 consecutive tokens starting at `starts` ([B] int64) -> inputs and targets.
Batch gather_windows(const at::Tensor& tokens, const at::Tensor& starts, int64_t seq) {
  const at::Tensor index = starts.unsqueeze(1) + at::arange(seq + 1, at::kLong).unsqueeze(0);
  const at::Tensor windows = tokens.take(index).to(at::kLong);  // [B, seq + 1]
  return {windows.narrow(1, 0, seq).contiguous(), windows.narrow(1, 1, seq).contiguous()};
}

}  // namespace

TokenDataset::TokenDataset(const at::Tensor& tokens, std::string name) : name_(std::move(name)) {
  TORCH_CHECK(tokens.dim() == 1 && !at::isFloatingType(tokens.scalar_type()) && tokens.scalar_type() != at::kBool,
              "[TokenDataset] needs a 1-D integer tensor of token ids, got ", tokens.scalar_type(), " ",
              tokens.sizes());
  tokens_ = tokens.to(at::kCPU, at::kInt).contiguous();
}

TokenDataset TokenDataset::open(const std::string& dir, Split split) { return open(load_corpus_info(dir), split); }

TokenDataset TokenDataset::open(const CorpusInfo& info, Split split) {
  const bool train = split == Split::train;
  const std::string path = train ? info.train_path() : info.val_path();
  const int64_t count = train ? info.train_tokens : info.val_tokens;
  const std::string bytes = util::read_file(path, "the token file");
  if (static_cast<int64_t>(bytes.size()) != count * info.token_bytes) {
    throw std::runtime_error("The token file " + path + " has " + std::to_string(bytes.size()) +
                             " bytes but meta.json records " + std::to_string(count) + " tokens of " +
                             std::to_string(info.token_bytes) + " bytes; run `remat prepare` to rebuild the corpus.");
  }
  at::Tensor tokens = at::empty({count}, at::kInt);
  int32_t* out = tokens.data_ptr<int32_t>();
  // The files are little-endian, as is every host remat builds for (see corpus.cpp).
  for (int64_t i = 0; i < count; ++i) {
    uint32_t id = 0;
    std::memcpy(&id, bytes.data() + i * info.token_bytes, static_cast<size_t>(info.token_bytes));
    if (id >= static_cast<uint32_t>(info.vocab_size)) {
      throw std::runtime_error("The token file " + path + " holds id " + std::to_string(id) + " at position " +
                               std::to_string(i) + ", outside the " + std::to_string(info.vocab_size) +
                               "-piece vocabulary; run `remat prepare` to rebuild the corpus.");
    }
    out[i] = static_cast<int32_t>(id);
  }
  return TokenDataset(tokens, (train ? "the train split of " : "the val split of ") + info.dir);
}

void TokenDataset::check_shape(int64_t batch, int64_t seq) const {
  if (batch < 1 || seq < 1) {
    throw std::runtime_error("A batch needs at least one sequence of at least one token, got " + std::to_string(batch) +
                             " x " + std::to_string(seq) + ".");
  }
  if (seq + 1 > size()) {
    throw std::runtime_error("A sequence of " + std::to_string(seq) + " tokens needs at least " +
                             std::to_string(seq + 1) + " tokens (inputs and next-token targets), but " + name_ +
                             " has " + std::to_string(size()) + ".");
  }
}

Batch TokenDataset::sample(int64_t batch, int64_t seq, std::mt19937_64& rng) const {
  check_shape(batch, seq);
  at::Tensor starts = at::empty({batch}, at::kLong);
  int64_t* s = starts.data_ptr<int64_t>();
  const auto positions = static_cast<uint64_t>(size() - seq);  // valid starts: [0, N - seq - 1]
  for (int64_t b = 0; b < batch; ++b) s[b] = static_cast<int64_t>(uniform_below(rng, positions));
  return gather_windows(tokens_, starts, seq);
}

int64_t TokenDataset::num_sequential_batches(int64_t batch, int64_t seq) const {
  check_shape(batch, seq);
  const int64_t windows = (size() - 1) / seq;
  return (windows + batch - 1) / batch;
}

Batch TokenDataset::sequential(int64_t index, int64_t batch, int64_t seq) const {
  const int64_t count = num_sequential_batches(batch, seq);
  if (index < 0 || index >= count) {
    throw std::runtime_error("Sequential batch " + std::to_string(index) + " does not exist: " + name_ + " has " +
                             std::to_string(count) + " batches of " + std::to_string(batch) + " x " +
                             std::to_string(seq) + " tokens.");
  }
  const int64_t windows = (size() - 1) / seq;
  const int64_t rows = std::min(batch, windows - index * batch);
  const at::Tensor starts = (at::arange(rows, at::kLong) + index * batch) * seq;
  return gather_windows(tokens_, starts, seq);
}

}  // namespace remat::data
