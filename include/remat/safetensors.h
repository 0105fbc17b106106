// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
//
//   bytes 0..7      N, the header length, unsigned 64-bit little-endian
//   bytes 8..8+N    a JSON object: {"<name>": {"dtype": "F32", "shape": [2, 3],
//                   "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}
//                   (optional metadata, strings only), padded with spaces
//   the rest        the data section; each tensor's bytes are [begin, end) of it,
//                   row-major, little-endian
//
// Supported dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL.
//
// Readers validate the whole header against the file before any tensor is read: the
// length prefix, the JSON, every dtype, shape and offset pair, and that the tensors tile
// the data section exactly (no overlap, no gap, nothing past the end, nothing left over).
// Every error is a std::runtime_error whose one-sentence message names the file and, where
// one is at fault, the tensor. Nothing is returned from a file that fails a check.
// (Checking names and shapes against a model is the model loader's job.)
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace remat::model {

/// One tensor's header entry.
struct SafeTensorInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets into the data section: [begin, end)
  int64_t end = 0;
};

/// A validated header.
struct SafeTensorsHeader {
  std::vector<SafeTensorInfo> tensors;          // in data order (ascending offsets)
  std::map<std::string, std::string> metadata;  // "__metadata__", empty if absent
  int64_t data_start = 0;                       // file offset of the data section (8 + N)
};

/// A loaded file. The tensors are contiguous CPU tensors owning their memory.
struct SafeTensors {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  /// The tensor called `name`, or nullptr.
  const at::Tensor* find(const std::string& name) const;
};

/// Writes `tensors` (in the given order) and `metadata` to `path` atomically: a temporary
/// file in the same directory, flushed, then renamed over `path`. Tensors may live on any
/// device and have any strides; a contiguous CPU copy is written where needed. Names must
/// be unique, non-empty and not "__metadata__". The header is padded with spaces to a
/// multiple of 8 bytes so the data section is 8-byte aligned.
///
/// `checksum`: the file ends in one more tensor, kChecksumTensor (U8, 64 bytes), the
/// SHA-256 in hex of every byte before it (length prefix, header with its metadata, the
/// other tensors), so that a reader can tell a whole file from a damaged one
/// (verify_safetensors_checksum). It is still a plain safetensors file.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {}, bool checksum = false);

/// A tensor of a file written a tensor at a time: what its header entry says.
struct TensorSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
};

/// Writes the tensors `specs` describe, `next(i)` giving tensor i (of that dtype and shape,
/// on any device) when its bytes' turn comes, so that a writer of tensors gathered from
/// elsewhere holds one at a time; atomically, with the checks and layout of the overload
/// above, which writes through this. Throws naming the tensor when `next` gives another
/// dtype or shape than its spec, and nothing is left at `path`.
void save_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                      const std::function<at::Tensor(size_t)>& next,
                      const std::map<std::string, std::string>& metadata = {}, bool checksum = false);

/// The name of the checksum tensor save_safetensors appends when asked.
inline constexpr const char* kChecksumTensor = "remat.sha256";

/// What verify_safetensors_checksum found.
enum class Checksum {
  absent,   ///< the file has no checksum tensor (written without one)
  matches,  ///< every byte before the checksum is as written
  differs,  ///< some byte changed since the file was written
};

/// Reads the whole file (its header validated as read_safetensors_header does, which
/// throws for a malformed one) and checks its checksum tensor, if it has one.
Checksum verify_safetensors_checksum(const std::string& path);

/// Reads and validates the header only (cheap: no tensor data is read).
SafeTensorsHeader read_safetensors_header(const std::string& path);

/// Reads and validates the whole file; with `wanted`, only the tensors whose names it
/// accepts are read (the header is validated whole), in file order.
SafeTensors load_safetensors(const std::string& path, const std::function<bool(const std::string&)>& wanted = nullptr);

/// The files a Hugging Face model.safetensors.index.json spreads a model over: its
/// weight_map's shard names, each once in order of first mention, as paths beside the index.
/// Refused with a sentence naming the index where it is not such a map, or a shard is not a
/// file name in the index's folder.
std::vector<std::string> safetensors_index_files(const std::string& index_path);

/// "F32" for at::kFloat, etc.; throws for a dtype the format cannot hold.
const char* safetensors_dtype_name(at::ScalarType dtype);

}  // namespace remat::model
