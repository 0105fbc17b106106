// Files as remat writes and reads them: whole-file writes that never leave a half-written
// file under the final name, appends that never lose a record silently, and reads (whole
// or mapped) that refuse what is not a regular file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <cstdio>
#include <string>
#include <string_view>

namespace remat::util {

/// Writes go to temp_path_of(path), "<path>.tmp.<pid>" in the same directory; commit() flushes them to disk
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
  /// Reads `size` bytes at `offset` of what was written so far: a file never committed is
  /// scratch space that no signal or error leaves behind.
  void read_back(int64_t offset, void* data, size_t size);
  void commit();

 private:
  std::string path_;
  std::string temp_path_;
  std::FILE* file_ = nullptr;
};

/// "<path>.tmp.<pid of this process>": where AtomicFile writes before the rename.
std::string temp_path_of(const std::string& path);
/// Whether the file name `name` is one AtomicFile wrote for a file named `base` (in the same
/// directory): base + ".tmp." + a process id, nothing else.
bool is_temp_name_of(std::string_view name, std::string_view base);

/// Flushes `dir`'s entries to disk, so that a rename into it survives a crash.
void sync_directory(const std::string& dir);

/// AtomicFile in one call.
void write_file_atomically(const std::string& path, std::string_view bytes);

/// The whole content of `path`; `what` names the file in the error ("the tokenizer model").
/// A path that is not a regular file (a FIFO, device, socket or directory) is refused
/// without waiting on it, and so is a file larger than `max_bytes`.
std::string read_file(const std::string& path, const std::string& what = "file",
                      int64_t max_bytes = std::numeric_limits<int64_t>::max());

/// A regular file mapped read-only into memory, for files read in pieces far larger than a
/// read should copy (a corpus's token ids). Its pages are the kernel's page cache, loaded
/// as they are touched and dropped under memory pressure. A file renamed over `path`
/// (AtomicFile) leaves the mapping on the old content; one truncated in place would make a
/// read past its new end fault, so remat never writes a file in place.
class MappedFile {
 public:
  /// Maps `path`, refused as read_file refuses it; `what` names it in the errors.
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }  ///< null for an empty file
  int64_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

/// Throws a sentence naming `what` and `path` when `path` exists and is not a regular file
/// (opening a FIFO waits for a writer for ever), for files a library opens by name.
void check_regular_file(const std::string& path, const std::string& what);

/// A file appended to a record at a time (a run's metrics): each append() is written whole
/// or throws a sentence naming the file and the system's reason (a full disk), so that a
/// lost record is never silent. Refuses a path that is not a regular file.
class AppendFile {
 public:
  /// Opens `path` for appending, creating it; `truncate` empties it first.
  AppendFile(std::string path, bool truncate);
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  void append(std::string_view bytes);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

/// Throws std::invalid_argument, a sentence naming `path`, `what` is written there and the
/// `setting` that named it, unless a new file can be written there (its directory exists
/// and is writable, and nothing is there yet: an earlier one is never replaced); run
/// before the work so a bad path costs nothing.
void check_new_file(const std::string& path, const std::string& what, const std::string& setting);

}  // namespace remat::util
