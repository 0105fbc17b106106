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

}  // namespace

TokenDataset::TokenDataset(const at::Tensor& tokens, std::string name) : name_(std::move(name)) {
  TORCH_CHECK(tokens.dim() == 1 && !at::isFloatingType(tokens.scalar_type()) && tokens.scalar_type() != at::kBool,
              "[TokenDataset] needs a 1-D integer tensor of token ids, got ", tokens.scalar_type(), " ",
              tokens.sizes());
  auto held = std::make_shared<const at::Tensor>(tokens.to(at::kCPU, at::kInt).contiguous());
  data_ = reinterpret_cast<const uint8_t*>(held->data_ptr<int32_t>());
  size_ = held->numel();
  owner_ = std::move(held);
}

TokenDataset TokenDataset::open(const std::string& dir, Split split) { return open(load_corpus_info(dir), split); }

TokenDataset TokenDataset::open(const CorpusInfo& info, Split split) {
  const bool train = split == Split::train;
  const std::string path = train ? info.train_path() : info.val_path();
  const int64_t count = train ? info.train_tokens : info.val_tokens;
  auto file = std::make_shared<const util::MappedFile>(path, "the token file");
  if (file->size() != count * info.token_bytes) {
    throw std::runtime_error("The token file " + path + " has " + std::to_string(file->size()) +
                             " bytes but meta.json records " + std::to_string(count) + " tokens of " +
                             std::to_string(info.token_bytes) + " bytes; run `remat prepare` to rebuild the corpus.");
  }
  TokenDataset d;
  d.data_ = file->data();
  d.owner_ = std::move(file);
  d.width_ = info.token_bytes;
  d.size_ = count;
  d.vocab_ = static_cast<uint32_t>(info.vocab_size);
  d.path_ = path;
  d.name_ = (train ? "the train split of " : "the val split of ") + info.dir;
  return d;
}

int64_t TokenDataset::id_at(int64_t i) const {
  // The files are little-endian, as is every host remat builds for (see corpus.cpp).
  uint32_t id = 0;
  std::memcpy(&id, data_ + i * width_, static_cast<size_t>(width_));
  if (vocab_ == 0) return static_cast<int32_t>(id);  // int32 in memory, as given
  if (id >= vocab_) {
    throw std::runtime_error("The token file " + path_ + " holds id " + std::to_string(id) + " at position " +
                             std::to_string(i) + ", outside the " + std::to_string(vocab_) +
                             "-piece vocabulary; run `remat prepare` to rebuild the corpus.");
  }
  return id;
}

std::vector<int32_t> TokenDataset::ids(int64_t begin, int64_t count) const {
  TORCH_CHECK(begin >= 0 && count >= 0 && begin + count <= size_, "[TokenDataset] ids ", begin, " + ", count,
              " outside ", size_);
  std::vector<int32_t> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = static_cast<int32_t>(id_at(begin + i));
  return out;
}

Batch TokenDataset::windows(const std::vector<int64_t>& starts, int64_t seq) const {
  const auto rows = static_cast<int64_t>(starts.size());
  at::Tensor inputs = at::empty({rows, seq}, at::kLong), targets = at::empty({rows, seq}, at::kLong);
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* out = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t previous = id_at(starts[static_cast<size_t>(r)]);
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t next = id_at(starts[static_cast<size_t>(r)] + t + 1);
      in[r * seq + t] = previous;
      out[r * seq + t] = next;
      previous = next;
    }
  }
  return {inputs, targets};
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
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  const auto positions = static_cast<uint64_t>(size() - seq);  // valid starts: [0, N - seq - 1]
  for (int64_t& s : starts) s = static_cast<int64_t>(uniform_below(rng, positions));
  return windows(starts, seq);
}

int64_t TokenDataset::num_sequential_batches(int64_t batch, int64_t seq) const {
  check_shape(batch, seq);
  const int64_t count = (size() - 1) / seq;
  return (count + batch - 1) / batch;
}

Batch TokenDataset::sequential(int64_t index, int64_t batch, int64_t seq) const {
  const int64_t count = num_sequential_batches(batch, seq);
  if (index < 0 || index >= count) {
    throw std::runtime_error("Sequential batch " + std::to_string(index) + " does not exist: " + name_ + " has " +
                             std::to_string(count) + " batches of " + std::to_string(batch) + " x " +
                             std::to_string(seq) + " tokens.");
  }
  const int64_t rows = std::min(batch, (size() - 1) / seq - index * batch);
  std::vector<int64_t> starts(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) starts[static_cast<size_t>(r)] = (index * batch + r) * seq;
  return windows(starts, seq);
}

}  // namespace remat::data
