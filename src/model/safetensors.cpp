#include "remat/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "util/atomic_file.h"
#include "util/sha256.h"
#include "util/utf8.h"

#include <fmt/format.h>

namespace remat::model {

namespace {

using nlohmann::json;
using ordered_json = nlohmann::ordered_json;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian and copied from memory as is");

// The format allows 100 MB of header, but parsing that much JSON takes gigabytes; a
// model's header needs about 150 bytes per tensor, so 8 MiB holds over 50,000 tensors.
constexpr uint64_t kMaxHeaderBytes = uint64_t{8} << 20;

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
    {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},  {at::kByte, "U8"},       {at::kBool, "BOOL"},
};

[[noreturn]] void invalid(const std::string& path, const std::string& reason) {
  throw std::runtime_error("The safetensors file " + path + " is invalid: " + reason + ".");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

File open_for_reading(const std::string& path, int64_t& size) {
  // Opening a FIFO would wait for a writer for ever.
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
    throw std::runtime_error("Cannot read the safetensors file " + path +
                             ": it is not a regular file (a directory, FIFO or device); pass a .safetensors file.");
  }
  File file(std::fopen(path.c_str(), "rb"));
  if (!file) {
    throw std::runtime_error("Cannot open the safetensors file " + path + ": " + std::strerror(errno) + ".");
  }
  if (std::fseek(file.get(), 0, SEEK_END) != 0 || (size = std::ftell(file.get())) < 0 ||
      std::fseek(file.get(), 0, SEEK_SET) != 0) {
    throw std::runtime_error("Cannot read the safetensors file " + path + " (not a regular file?).");
  }
  return file;
}

void read_exactly(std::FILE* file, const std::string& path, int64_t offset, void* out, int64_t bytes,
                  const std::string& what) {
  if (bytes == 0) return;
  if (std::fseek(file, offset, SEEK_SET) != 0 ||
      std::fread(out, 1, static_cast<size_t>(bytes), file) != static_cast<size_t>(bytes)) {
    throw std::runtime_error("Cannot read " + what + " from the safetensors file " + path +
                             " (changed while reading?).");
  }
}

// Parses one header entry; throws (via invalid) naming the tensor.
SafeTensorInfo parse_entry(const std::string& path, const std::string& name, const json& entry, int64_t data_bytes) {
  const std::string who = "tensor '" + util::printable(name) + "'";
  if (!entry.is_object()) invalid(path, who + " is not described by a JSON object");
  SafeTensorInfo info;
  info.name = name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) invalid(path, who + " has no dtype string");
  const auto dtype = dtype_it->get<std::string>();
  const auto known =
      std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeName& d) { return dtype == d.name; });
  if (known == std::end(kDtypes)) {
    invalid(path, who + " has dtype \"" + util::printable(dtype) +
                      "\", not one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL");
  }
  info.dtype = known->dtype;

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) invalid(path, who + " has no shape array");
  // Element count in bytes, with overflow checked: a hostile shape must not wrap around.
  const auto item = static_cast<int64_t>(c10::elementSize(info.dtype));
  int64_t nbytes = item;
  for (const json& d : *shape_it) {
    if (!d.is_number_unsigned())
      invalid(path, who + " has a shape entry that is not a non-negative integer: " + d.dump());
    const uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      invalid(path, who + " has an impossible dimension " + std::to_string(dim));
    }
    info.shape.push_back(static_cast<int64_t>(dim));
    if (dim != 0 && nbytes > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(dim)) {
      invalid(path, who + " has shape " + shape_string(info.shape) + "..., too large for any file");
    }
    nbytes *= static_cast<int64_t>(dim);
  }

  const auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
    invalid(path, who + " has no data_offsets pair of non-negative integers");
  }
  const uint64_t begin = (*offsets_it)[0].get<uint64_t>(), end = (*offsets_it)[1].get<uint64_t>();
  if (end < begin) {
    invalid(path, who + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                      "] that end before they begin");
  }
  if (end > static_cast<uint64_t>(data_bytes)) {
    invalid(path, who + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] beyond the " +
                      std::to_string(data_bytes) + "-byte data section (is the file truncated?)");
  }
  info.begin = static_cast<int64_t>(begin);
  info.end = static_cast<int64_t>(end);
  if (info.end - info.begin != nbytes) {
    invalid(path, who + " has shape " + shape_string(info.shape) + " of " + dtype + " (" + std::to_string(nbytes) +
                      " bytes) but data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] span " +
                      std::to_string(end - begin) + " bytes");
  }
  return info;
}

// The header's JSON object; refuses, naming `path`, what is not one or names a tensor twice
// (nlohmann keeps the last of two equal keys).
json parse_header(const std::string& path, const std::string& text) {
  json header;
  std::set<std::string> names;
  std::string twice;
  const json::parser_callback_t note_names = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && !names.insert(parsed.get<std::string>()).second &&
        twice.empty()) {
      twice = parsed.get<std::string>();
    }
    return true;
  };
  try {
    header = json::parse(text, note_names);
  } catch (const json::parse_error& e) {
    invalid(path, std::string("the header is not valid JSON (") + e.what() + ")");
  } catch (const json::out_of_range& e) {
    // Valid JSON, but a number past a double's range (2e400) is refused by the parser with
    // an error of its own, which named neither the file nor the problem.
    invalid(path, std::string("the header holds a number too large to read (") + e.what() +
                      "); shapes and data_offsets are whole numbers no larger than the file");
  }
  if (!header.is_object()) invalid(path, "the header is not a JSON object");
  if (!twice.empty()) invalid(path, "the header names tensor '" + util::printable(twice) + "' twice");
  return header;
}

SafeTensorsHeader read_header(std::FILE* file, const std::string& path, int64_t file_size) {
  if (file_size < 8) {
    invalid(path, "it has " + std::to_string(file_size) + " bytes, fewer than the 8-byte header length");
  }
  unsigned char prefix[8];
  read_exactly(file, path, 0, prefix, 8, "the header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | prefix[i];
  if (header_bytes > static_cast<uint64_t>(file_size - 8)) {
    invalid(path, "the header length is " + std::to_string(header_bytes) + " bytes but only " +
                      std::to_string(file_size - 8) + " follow it");
  }
  if (header_bytes > kMaxHeaderBytes) {
    invalid(path, "the header length " + std::to_string(header_bytes) +
                      " bytes is more than the 8 MiB remat reads (over 50,000 tensors' worth); it is not a model "
                      "file remat can load");
  }
  std::string text(header_bytes, '\0');
  read_exactly(file, path, 8, text.data(), static_cast<int64_t>(header_bytes), "the header");

  const json header = parse_header(path, text);

  SafeTensorsHeader result;
  result.data_start = 8 + static_cast<int64_t>(header_bytes);
  const int64_t data_bytes = file_size - result.data_start;
  for (const auto& [key, value] : header.items()) {
    // Names are printed in messages and listings as they are.
    if (util::find_control(key) != std::string::npos) {
      invalid(path, "the tensor name '" + util::printable(key) + "' holds a control character");
    }
    if (key == "__metadata__") {
      if (!value.is_object()) invalid(path, "__metadata__ is not a JSON object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) invalid(path, "__metadata__ entry '" + util::printable(k) + "' is not a string");
        result.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    result.tensors.push_back(parse_entry(path, key, value, data_bytes));
  }

  // The tensors must tile the data section: sorted by offset, each starts where the
  // previous one ended, and the last ends at the end of the file.
  std::sort(result.tensors.begin(), result.tensors.end(), [](const SafeTensorInfo& a, const SafeTensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t covered = 0;
  const SafeTensorInfo* previous = nullptr;
  for (const SafeTensorInfo& t : result.tensors) {
    if (t.begin < covered) {
      invalid(path, "tensor '" + t.name + "' bytes [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                        ") overlap tensor '" + previous->name + "' bytes [" + std::to_string(previous->begin) + ", " +
                        std::to_string(previous->end) + ")");
    }
    if (t.begin > covered) {
      invalid(path, "tensor '" + t.name + "' starts at data byte " + std::to_string(t.begin) +
                        " but the data before it ends at byte " + std::to_string(covered) + " (a gap)");
    }
    covered = t.end;
    previous = &t;
  }
  if (covered != data_bytes) {
    invalid(path, "the data section has " + std::to_string(data_bytes) + " bytes but the tensors cover " +
                      std::to_string(covered) + (previous ? " (the last is '" + previous->name + "')" : std::string()));
  }
  return result;
}

}  // namespace

const char* safetensors_dtype_name(at::ScalarType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  throw std::runtime_error(std::string("The dtype ") + c10::toString(dtype) +
                           " cannot be stored in safetensors by remat.");
}

const at::Tensor* SafeTensors::find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

void save_safetensors(const std::string& path, const std::vector<TensorSpec>& given,
                      const std::function<at::Tensor(size_t)>& next, const std::map<std::string, std::string>& metadata,
                      bool checksum) {
  std::vector<TensorSpec> specs = given;
  // Last in the data section, so that its digest can cover every byte before it.
  if (checksum) specs.push_back({kChecksumTensor, at::kByte, {64}});
  std::set<std::string> names;
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const TensorSpec& spec : specs) {
    const std::string who = "tensor '" + spec.name + "' for " + path;
    if (spec.name.empty() || spec.name == "__metadata__") {
      throw std::runtime_error("Cannot save a tensor named '" + spec.name + "' to " + path +
                               ": the name is reserved or empty.");
    }
    if (!names.insert(spec.name).second) {
      throw std::runtime_error("Cannot save " + who + ": the name occurs twice.");
    }
    const char* dtype = nullptr;
    try {
      dtype = safetensors_dtype_name(spec.dtype);
    } catch (const std::runtime_error&) {
      throw std::runtime_error("Cannot save " + who + ": its dtype " + c10::toString(spec.dtype) +
                               " has no safetensors name.");
    }
    const int64_t nbytes = c10::multiply_integers(spec.sizes) * static_cast<int64_t>(c10::elementSize(spec.dtype));
    header[spec.name] = {{"dtype", dtype}, {"shape", spec.sizes}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }

  std::string text = header.dump();
  text.append((8 - (text.size() % 8)) % 8, ' ');  // data section 8-byte aligned
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(uint64_t{text.size()} >> (8 * i));

  util::AtomicFile file(path);
  util::Sha256 digest;
  const auto write = [&](const void* data, size_t size) {
    file.write(data, size);
    if (checksum) digest.update(data, size);
  };
  write(prefix, 8);
  write(text.data(), text.size());
  for (size_t i = 0; i < given.size(); ++i) {
    const at::Tensor tensor = next(i);
    if (!tensor.defined() || tensor.layout() != at::kStrided || tensor.scalar_type() != specs[i].dtype ||
        tensor.sizes() != at::IntArrayRef(specs[i].sizes)) {
      throw std::runtime_error("Cannot save tensor '" + specs[i].name + "' for " + path + ": it came as " +
                               (tensor.defined()
                                    ? std::string(c10::toString(tensor.scalar_type())) + " " + c10::str(tensor.sizes())
                                    : std::string("nothing")) +
                               " where its header entry says " + std::string(c10::toString(specs[i].dtype)) + " " +
                               c10::str(at::IntArrayRef(specs[i].sizes)) + ".");
    }
    // resolve_*: a lazily negated/conjugated view must be written with its logical values.
    const at::Tensor cpu = tensor.resolve_conj().resolve_neg().to(at::kCPU).contiguous();
    write(cpu.data_ptr(), cpu.nbytes());
  }
  if (checksum) file.write(digest.hex_digest());
  file.commit();
}

Checksum verify_safetensors_checksum(const std::string& path) {
  int64_t size = 0;
  File file = open_for_reading(path, size);
  const SafeTensorsHeader header = read_header(file.get(), path, size);
  if (header.tensors.empty()) return Checksum::absent;
  const SafeTensorInfo& last = header.tensors.back();
  if (last.name != kChecksumTensor || last.dtype != at::kByte || last.end - last.begin != 64) return Checksum::absent;
  util::Sha256 digest;
  std::vector<char> chunk(size_t{1} << 20);
  const int64_t covered = header.data_start + last.begin;
  for (int64_t at = 0; at < covered;) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), covered - at);
    read_exactly(file.get(), path, at, chunk.data(), n, "the data");
    digest.update(chunk.data(), static_cast<size_t>(n));
    at += n;
  }
  std::string recorded(64, '\0');
  read_exactly(file.get(), path, covered, recorded.data(), 64, "the checksum");
  return recorded == digest.hex_digest() ? Checksum::matches : Checksum::differs;
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata, bool checksum) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined() || tensor.layout() != at::kStrided) {
      throw std::runtime_error("Cannot save tensor '" + name + "' for " + path +
                               ": it is undefined or not a dense tensor.");
    }
    specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  save_safetensors(
      path, specs, [&](size_t i) { return tensors[i].second; }, metadata, checksum);
}

SafeTensorsHeader read_safetensors_header(const std::string& path) {
  int64_t size = 0;
  File file = open_for_reading(path, size);
  return read_header(file.get(), path, size);
}

std::vector<std::string> safetensors_index_files(const std::string& index_path) {
  // Llama 3.1 405B's index is about 100 KB; far more is not an index.
  constexpr int64_t kMaxIndexBytes = int64_t{16} << 20;
  const auto refuse = [&](const std::string& why) {
    throw std::runtime_error(
        fmt::format("The safetensors index {} {}; it should map each tensor's name to the file "
                    "beside it that holds it, as transformers' save_pretrained writes it.",
                    util::printable(index_path), why));
  };
  ordered_json j;
  try {
    j = ordered_json::parse(util::read_file(index_path, "the safetensors index", kMaxIndexBytes));
  } catch (const json::exception& e) {
    refuse(fmt::format("is not JSON ({})", util::printable(e.what())));
  }
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object()) {
    refuse("has no \"weight_map\" object");
  }
  const std::filesystem::path folder = std::filesystem::path(index_path).parent_path();
  std::vector<std::string> files;
  std::set<std::string> seen;
  for (const auto& [name, shard] : j.at("weight_map").items()) {
    const std::string file = shard.is_string() ? shard.get<std::string>() : "";
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos) {
      refuse(fmt::format("places '{}' in {}, which is not a file name", util::printable(name),
                         util::printable(shard.dump())));
    }
    if (seen.insert(file).second) files.push_back((folder / file).string());
  }
  if (files.empty()) refuse("names no tensors");
  return files;
}

SafeTensors load_safetensors(const std::string& path, const std::function<bool(const std::string&)>& wanted) {
  int64_t size = 0;
  File file = open_for_reading(path, size);
  SafeTensorsHeader header = read_header(file.get(), path, size);
  SafeTensors result;
  result.metadata = std::move(header.metadata);
  for (const SafeTensorInfo& info : header.tensors) {
    if (wanted && !wanted(info.name)) continue;
    at::Tensor t = at::empty(info.shape, at::TensorOptions().dtype(info.dtype));
    read_exactly(file.get(), path, header.data_start + info.begin, t.data_ptr(), info.end - info.begin,
                 "tensor '" + info.name + "'");
    if (info.dtype == at::kBool) {
      // Any byte but 0 and 1 in a bool tensor is undefined behaviour once used.
      const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
      for (int64_t i = 0; i < t.numel(); ++i) {
        if (bytes[i] > 1) {
          invalid(path, "tensor '" + info.name + "' of dtype BOOL holds byte " + std::to_string(bytes[i]) +
                            " at element " + std::to_string(i));
        }
      }
    }
    result.tensors.emplace_back(info.name, std::move(t));
  }
  return result;
}

}  // namespace remat::model
