// Whole-file writes that never leave a half-written file under the final name.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace remat::util {

/// Writes go to "<path>.tmp.<pid>" in the same directory; commit() flushes them to disk
/// and renames the file over `path`. Destroyed without commit() (an error on the way),
/// it removes the temporary file and `path` keeps its old content, if any.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  void commit();

 private:
  std::string path_;
  std::string temp_path_;
  std::FILE* file_ = nullptr;
};

/// Flushes `dir`'s entries to disk, so that a rename into it survives a crash.
void sync_directory(const std::string& dir);

/// AtomicFile in one call.
void write_file_atomically(const std::string& path, std::string_view bytes);

/// The whole content of `path`; `what` names the file in the error ("the tokenizer model").
std::string read_file(const std::string& path, const std::string& what = "file");

}  // namespace remat::util
