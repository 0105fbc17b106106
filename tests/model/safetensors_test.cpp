#include "util/error_of.h"
#include "remat/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <sys/stat.h>
#include <fstream>
#include <sstream>

#include "util/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using namespace remat::model;
using remat::testing::TempDir;

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::runtime_error>(f); }

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// A file made by hand: the 8-byte length, `header`, then `data`.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t{header.size()} >> (8 * i));
  return out + header + data;
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.is_contiguous() && b.is_contiguous() &&
         (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

TEST(SafeTensors, RoundTripsEveryDtypeBitwise) {
  TempDir dir;
  at::Generator gen = at::detail::createCPUGenerator(0);
  // Random bit patterns (NaN payloads and subnormals included) for every dtype but BOOL.
  auto random_bits = [&gen](at::ScalarType dtype, std::vector<int64_t> shape) {
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    std::vector<int64_t> byte_shape = shape;
    byte_shape.back() *= item;
    return at::randint(0, 256, byte_shape, gen, at::kByte).view(dtype);
  };
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"f64", random_bits(at::kDouble, {3, 5})},
      {"f32", random_bits(at::kFloat, {2, 3, 4})},
      {"f16", random_bits(at::kHalf, {7})},
      {"bf16", random_bits(at::kBFloat16, {4, 4})},
      {"i64", random_bits(at::kLong, {6})},
      {"i32", random_bits(at::kInt, {1, 9})},
      {"i16", random_bits(at::kShort, {5})},
      {"i8", random_bits(at::kChar, {11})},
      {"u8", random_bits(at::kByte, {3})},
      {"bool", at::randint(0, 2, {2, 5}, gen, at::kBool)},
      {"scalar", at::scalar_tensor(2.5, at::kFloat)},
      {"empty", at::empty({0, 3}, at::kFloat)},
      {"transposed", at::arange(12, at::kFloat).view({3, 4}).t()},  // non-contiguous
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "42"}};
  const std::string path = dir / "all.safetensors";
  save_safetensors(path, tensors, metadata);

  // The data section starts 8-byte aligned, and the temporary file is gone.
  const SafeTensorsHeader header = read_safetensors_header(path);
  EXPECT_EQ(header.data_start % 8, 0);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);

  const SafeTensors loaded = load_safetensors(path);
  EXPECT_EQ(loaded.metadata, metadata);
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(loaded.tensors[i].first, tensors[i].first);  // save order is data order
    EXPECT_TRUE(bitwise_equal(loaded.tensors[i].second, tensors[i].second.contiguous())) << tensors[i].first;
  }
  ASSERT_NE(loaded.find("transposed"), nullptr);
  EXPECT_TRUE(at::equal(*loaded.find("transposed"), at::arange(12, at::kFloat).view({3, 4}).t()));
  EXPECT_EQ(loaded.find("absent"), nullptr);
}

TEST(SafeTensors, WritesTheReferenceLayout) {
  TempDir dir;
  const std::string path = dir / "one.safetensors";
  save_safetensors(path, {{"w", at::tensor({1.0f, 2.0f}, at::kFloat)}});
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  ASSERT_EQ(bytes.size(), 8 + n + 8);
  std::string header = bytes.substr(8, n);
  while (!header.empty() && header.back() == ' ') header.pop_back();
  EXPECT_EQ(header, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})");
  const float expected[2] = {1.0f, 2.0f};
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, expected, 8), 0);
}

TEST(SafeTensors, FailedSaveKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir / "keep.safetensors";
  save_safetensors(path, {{"a", at::ones({2})}});
  const std::string before = read_bytes(path);

  std::string error = error_of([&] {
    save_safetensors(path, {{"a", at::ones({2})}, {"z", at::ones({2}, at::kComplexFloat)}});
  });
  EXPECT_NE(error.find("tensor 'z'"), std::string::npos) << error;
  error = error_of([&] { save_safetensors(path, {{"a", at::ones({2})}, {"a", at::ones({1})}}); });
  EXPECT_NE(error.find("'a'"), std::string::npos) << error;
  EXPECT_NE(error.find("twice"), std::string::npos) << error;
  error = error_of([&] { save_safetensors(path, {{"__metadata__", at::ones({1})}}); });
  EXPECT_NE(error.find("reserved"), std::string::npos) << error;

  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

// Written a tensor at a time, the file is the one written at once; a tensor that comes
// other than its header entry said is refused by name and leaves the old file.
TEST(SafeTensors, WritesATensorAtATimeAndReadsOnlyTheWantedOnes) {
  TempDir dir;
  const std::string whole = dir / "whole.safetensors", parts = dir / "parts.safetensors";
  const std::vector<std::pair<std::string, at::Tensor>> tensors{
      {"a", at::arange(6, at::kFloat).reshape({2, 3})}, {"b", at::arange(4)}, {"c", at::ones({3}, at::kBFloat16)}};
  save_safetensors(whole, tensors, {{"k", "v"}});
  std::vector<remat::model::TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  std::vector<size_t> asked;
  save_safetensors(parts, specs,
                   [&](size_t i) {
                     asked.push_back(i);
                     return tensors[i].second.t().contiguous().t();  // strided: written in row order all the same
                   },
                   {{"k", "v"}});
  EXPECT_EQ(asked, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(read_bytes(parts), read_bytes(whole));

  const std::string error = error_of(
      [&] { save_safetensors(parts, specs, [&](size_t i) { return i == 1 ? at::arange(5) : tensors[i].second; }); });
  EXPECT_NE(error.find("tensor 'b'"), std::string::npos) << error;
  EXPECT_NE(error.find("[5]"), std::string::npos) << error;
  EXPECT_EQ(read_bytes(parts), read_bytes(whole));

  const auto some = load_safetensors(whole, [](const std::string& name) { return name != "b"; });
  ASSERT_EQ(some.tensors.size(), 2u);
  EXPECT_EQ(some.tensors[0].first, "a");
  EXPECT_TRUE(some.tensors[0].second.equal(tensors[0].second));
  EXPECT_EQ(some.tensors[1].first, "c");
  EXPECT_EQ(some.metadata.at("k"), "v");
}

// Each corruption, written by hand, must be refused with the file and tensor named.
TEST(SafeTensors, RefusesCorruptFiles) {
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  auto error_for = [&](const std::string& bytes) {
    write_bytes(path, bytes);
    const std::string header_error = error_of([&] { read_safetensors_header(path); });
    const std::string load_error = error_of([&] { load_safetensors(path); });
    EXPECT_EQ(header_error, load_error);
    EXPECT_NE(load_error.find(path), std::string::npos) << load_error;
    return load_error;
  };
  auto expect_has = [](const std::string& error, const std::string& part) {
    EXPECT_NE(error.find(part), std::string::npos) << "'" << part << "' not in: " << error;
  };
  const std::string f32x2(8, '\0');

  // Sanity: the hand-made baseline is valid.
  write_bytes(path, raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2));
  EXPECT_EQ(load_safetensors(path).tensors.size(), 1u);

  expect_has(error_for(std::string("\x05\x00\x00", 3)), "has 3 bytes, fewer than the 8-byte header length");
  expect_has(error_for(raw_file("{}", "").substr(0, 8) + "{"), "the header length is 2 bytes but only 1 follow it");
  expect_has(error_for(raw_file("{\"a\": [", "")), "not valid JSON");
  expect_has(error_for(raw_file("[1, 2]", "")), "not a JSON object");
  // Found by fuzz/safetensors.cpp: a number past a double's range escaped as the JSON
  // library's own exception, naming neither the file nor the problem.
  expect_has(error_for(raw_file(R"({"a":{"dtype":"I32","shape":[2305843009213e93952,4],"data_offsets":[0,0]}})", "")),
             "the header holds a number too large to read ([json.exception.out_of_range.406] number overflow parsing "
             "'2305843009213e93952'); shapes and data_offsets are whole numbers no larger than the file");
  expect_has(error_for(raw_file(R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", "xx")),
             "tensor 'a' has dtype \"F8\"");
  expect_has(error_for(raw_file(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", std::string(20, '\0'))),
             "tensor 'w' has shape [2, 3] of F32 (24 bytes) but data_offsets [0, 20] span 20 bytes");
  expect_has(error_for(raw_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2)),
             "tensor 'w' has a shape entry");
  expect_has(error_for(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", f32x2)),
             "tensor 'w' has data_offsets [8, 0] that end before they begin");
  expect_has(error_for(raw_file(R"({"w":{"dtype":"F32","shape":[2]}})", f32x2)), "tensor 'w' has no data_offsets");
  // Truncated: the last tensor runs past the end of the file.
  expect_has(error_for(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                std::string(12, '\0'))),
             "tensor 'b' has data_offsets [8, 16] beyond the 12-byte data section");
  expect_has(error_for(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                std::string(12, '\0'))),
             "tensor 'b' bytes [4, 12) overlap tensor 'a' bytes [0, 8)");
  expect_has(error_for(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
                                std::string(20, '\0'))),
             "tensor 'b' starts at data byte 12 but the data before it ends at byte 8");
  expect_has(error_for(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(10, '\0'))),
             "the data section has 10 bytes but the tensors cover 8 (the last is 'a')");
  expect_has(error_for(raw_file(R"({"a":{"dtype":"U8","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", f32x2)),
             "tensor 'a' has shape");
  expect_has(
      error_for(raw_file(R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2)),
      "__metadata__ entry 'k' is not a string");
  // A name given twice was read as its last entry; a name with a control character reached
  // the terminal and the listings raw.
  expect_has(error_for(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                f32x2)),
             "the header names tensor 'a' twice");
  expect_has(error_for(raw_file(R"({"a\u001b[2J\u0000":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2)),
             "the tensor name 'a\\x1b[2J\\x00' holds a control character");
  // Only reading the data can see a bad BOOL byte.
  write_bytes(path, raw_file(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", std::string("\x01\x02", 2)));
  expect_has(error_of([&] { load_safetensors(path); }), "tensor 'm' of dtype BOOL holds byte 2 at element 1");

  const std::string missing = error_of([&] { load_safetensors(dir / "missing.safetensors"); });
  expect_has(missing, "missing.safetensors");
}

// A crafted 100 MB header (the format's own limit) is refused from its length alone,
// before a byte of it is read; a FIFO in place of the file is refused instead of waiting
// for a writer.
TEST(SafeTensors, RefusesHugeHeadersAndFilesThatAreNotRegular) {
  TempDir dir;
  const std::string path = dir / "huge.safetensors";
  const uint64_t header = 100'000'000;
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>(header >> (8 * i));
  write_bytes(path, prefix);
  fs::resize_file(path, 8 + header);  // sparse: no disk, and no memory unless read
  EXPECT_EQ(error_of([&] { load_safetensors(path); }),
            "The safetensors file " + path +
                " is invalid: the header length 100000000 bytes is more than the 8 MiB "
                "remat reads (over 50,000 tensors' worth); it is not a model file remat can load.");

  const std::string fifo = dir / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { load_safetensors(fifo); }),
            "Cannot read the safetensors file " + fifo +
                ": it is not a regular file (a directory, FIFO or device); pass a .safetensors file.");
}

}  // namespace
