#include "util/atomic_file.h"

#include "util/temp_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <stdexcept>

namespace remat::util {

namespace {

std::string errno_text() { return std::strerror(errno); }

// The temporary paths of live AtomicFiles, for remove_open_temp_files: a slot is claimed,
// then its path written, then marked ready; a signal handler reads only ready slots.
constexpr int kTempSlots = 16;
constexpr size_t kTempPathBytes = 4096;
char g_temp_paths[kTempSlots][kTempPathBytes];
std::atomic<bool> g_temp_claimed[kTempSlots];
std::atomic<bool> g_temp_ready[kTempSlots];

void register_temp(const std::string& path) {
  if (path.size() >= kTempPathBytes) return;
  for (int i = 0; i < kTempSlots; ++i) {
    bool free = false;
    if (g_temp_claimed[i].compare_exchange_strong(free, true)) {
      std::memcpy(g_temp_paths[i], path.c_str(), path.size() + 1);
      g_temp_ready[i].store(true);
      return;
    }
  }
}

// A temporary path names one live AtomicFile (it holds this process's pid).
void unregister_temp(const std::string& path) {
  for (int i = 0; i < kTempSlots; ++i) {
    if (g_temp_ready[i].load() && path == g_temp_paths[i]) {
      g_temp_ready[i].store(false);
      g_temp_claimed[i].store(false);
      return;
    }
  }
}

}  // namespace

void remove_open_temp_files() {
  for (int i = 0; i < kTempSlots; ++i) {
    if (g_temp_ready[i].load()) ::unlink(g_temp_paths[i]);
  }
}

void remove_stale_temp_files(const std::string& dir, const std::vector<std::string>& bases) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    for (const std::string& base : bases) {
      if (!is_temp_name_of(name, base)) continue;
      const long pid = std::strtol(name.c_str() + base.size() + 5, nullptr, 10);
      // A pid that runs may be another process writing that file now.
      if (pid > 0 && pid <= std::numeric_limits<pid_t>::max() && ::kill(static_cast<pid_t>(pid), 0) != 0 &&
          errno == ESRCH) {
        std::filesystem::remove(e.path(), ec);
      }
    }
  }
}

std::string temp_path_of(const std::string& path) { return path + ".tmp." + std::to_string(::getpid()); }

bool is_temp_name_of(std::string_view name, std::string_view base) {
  const std::string_view infix = ".tmp.";
  if (name.size() <= base.size() + infix.size() || name.substr(0, base.size()) != base ||
      name.substr(base.size(), infix.size()) != infix) {
    return false;
  }
  const std::string_view pid = name.substr(base.size() + infix.size());
  return pid.size() <= 10 && pid.find_first_not_of("0123456789") == std::string_view::npos;
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), temp_path_(temp_path_of(path_)) {
  register_temp(temp_path_);
  file_ = std::fopen(temp_path_.c_str(), "w+b");
  if (file_ == nullptr) {
    unregister_temp(temp_path_);
    throw std::runtime_error("Cannot create " + temp_path_ + ": " + errno_text() + ".");
  }
}

AtomicFile::~AtomicFile() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::remove(temp_path_.c_str());
    unregister_temp(temp_path_);
  }
}

void AtomicFile::write(const void* data, size_t size) {
  if (file_ == nullptr) throw std::logic_error("AtomicFile::write after commit");
  if (size != 0 && std::fwrite(data, 1, size, file_) != size) {
    throw std::runtime_error("Cannot write " + temp_path_ + ": " + errno_text() + ".");
  }
}

void AtomicFile::read_back(int64_t offset, void* data, size_t size) {
  if (file_ == nullptr) throw std::logic_error("AtomicFile::read_back after commit");
  if (std::fflush(file_) != 0) throw std::runtime_error("Cannot write " + temp_path_ + ": " + errno_text() + ".");
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(::fileno(file_), static_cast<char*>(data) + done, size - done,
                              static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw std::runtime_error("Cannot read back " + temp_path_ + ": " + (n < 0 ? errno_text() : "it is shorter") +
                               ".");
    }
    done += static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  if (file_ == nullptr) throw std::logic_error("AtomicFile::commit twice");
  // fsync before rename: after a crash the new name holds either the old or the whole
  // new content, never a prefix of it.
  const bool flushed = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const std::string flush_error = flushed ? "" : errno_text();
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!flushed || !closed) {
    std::remove(temp_path_.c_str());
    unregister_temp(temp_path_);
    throw std::runtime_error("Cannot write " + temp_path_ + ": " + (flushed ? errno_text() : flush_error) + ".");
  }
  const bool renamed = std::rename(temp_path_.c_str(), path_.c_str()) == 0;
  unregister_temp(temp_path_);
  if (!renamed) {
    const std::string error = errno_text();
    std::remove(temp_path_.c_str());
    throw std::runtime_error("Cannot rename " + temp_path_ + " to " + path_ + ": " + error + ".");
  }
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  const bool ok = fd >= 0 && ::fsync(fd) == 0;
  const std::string error = ok ? "" : errno_text();
  if (fd >= 0) ::close(fd);
  if (!ok) throw std::runtime_error("Cannot flush the directory " + dir + " to disk: " + error + ".");
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
}

namespace {

std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "not a regular file";
}

std::string not_regular(const std::string& what, const std::string& path, mode_t mode) {
  return "Cannot read " + what + " " + path + ": it is " + kind_of(mode) +
         ", not a regular file; remat reads only regular files (a FIFO or device could make it wait or read for "
         "ever): give the path of a file.";
}

// A descriptor of the regular file `path`, opened for reading, and its size.
// O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting; fstat then
// refuses it, and the descriptor that is checked is the one read.
int open_regular(const std::string& path, const std::string& what, int64_t& size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("Cannot open " + what + " " + path + ": " + errno_text() + ".");
  struct stat st {};
  std::string problem;
  if (::fstat(fd, &st) != 0) {
    problem = "Cannot read " + what + " " + path + ": " + errno_text() + ".";
  } else if (!S_ISREG(st.st_mode)) {
    problem = not_regular(what, path, st.st_mode);
  }
  if (!problem.empty()) {
    ::close(fd);
    throw std::runtime_error(problem);
  }
  size = static_cast<int64_t>(st.st_size);
  return fd;
}

}  // namespace

std::string read_file(const std::string& path, const std::string& what, int64_t max_bytes) {
  int64_t size = 0;
  const int fd = open_regular(path, what, size);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  if (size > max_bytes) {
    throw std::runtime_error("Cannot read " + what + " " + path + ": it holds " + std::to_string(size) +
                             " bytes, more than the " + std::to_string(max_bytes) + " such a file can hold.");
  }
  std::string content;
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error("Cannot read " + what + " " + path + ": " + errno_text() + ".");
    if (n == 0) break;
    if (static_cast<int64_t>(content.size()) + n > max_bytes) {
      throw std::runtime_error("Cannot read " + what + " " + path + ": it grew past the " + std::to_string(max_bytes) +
                               " bytes such a file can hold while being read.");
    }
    content.append(chunk, static_cast<size_t>(n));
  }
  return content;
}

MappedFile::MappedFile(const std::string& path, const std::string& what) {
  const int fd = open_regular(path, what, size_);
  // The mapping outlives the descriptor; an empty file has nothing to map.
  void* at = size_ == 0 ? nullptr : ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
  const std::string reason = at == MAP_FAILED ? errno_text() : "";
  ::close(fd);
  if (at == MAP_FAILED) throw std::runtime_error("Cannot map " + what + " " + path + " into memory: " + reason + ".");
  data_ = static_cast<const uint8_t*>(at);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
}

void check_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw std::runtime_error(not_regular(what, path, st.st_mode));
}

AppendFile::AppendFile(std::string path, bool truncate) : path_(std::move(path)) {
  // O_NONBLOCK for the open only: a FIFO without a reader fails at once (ENXIO) instead of
  // waiting, and one with a reader is refused by the check below.
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NONBLOCK | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
  if (fd_ < 0) {
    const std::string error = errno_text();
    struct stat st {};
    if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
      throw std::runtime_error("Cannot write " + path_ + ": it is " + kind_of(st.st_mode) +
                               ", not a regular file; remove it.");
    }
    throw std::runtime_error("Cannot open " + path_ + " for writing: " + error + ".");
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) || ::fcntl(fd_, F_SETFL, O_WRONLY | O_APPEND) != 0) {
    const std::string kind = kind_of(st.st_mode);
    ::close(fd_);
    throw std::runtime_error("Cannot write " + path_ + ": it is " + kind + ", not a regular file; remove it.");
  }
}

AppendFile::~AppendFile() { ::close(fd_); }

void AppendFile::append(std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    // write() returning 0 for a non-empty buffer is a full device as well.
    if (n <= 0)
      throw std::runtime_error("Cannot write " + path_ + ": " + (n < 0 ? errno_text() : "nothing was written") + ".");
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

void check_new_file(const std::string& path, const std::string& what, const std::string& setting) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  std::string why;
  if (!p.has_filename()) {
    why = "it names no file";
  } else if (!fs::is_directory(dir, ec)) {
    why = "the directory " + dir.string() + " does not exist";
  } else if (fs::is_directory(p, ec)) {
    why = "it is a directory";
  } else if (::access(dir.c_str(), W_OK) != 0) {
    why = "the directory " + dir.string() + " is not writable (" + std::strerror(errno) + ")";
  } else if (fs::exists(p, ec)) {
    why = "a file is there already, and " + what + " never replaces one";
  } else {
    return;
  }
  throw std::invalid_argument("Cannot write " + what + " to '" + path + "' (" + setting + "): " + why +
                              "; give a new file path in an existing, writable directory.");
}
}  // namespace remat::util
