#include "util/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace remat::util {

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

AtomicFile::AtomicFile(std::string path)
    : path_(std::move(path)), temp_path_(path_ + ".tmp." + std::to_string(::getpid())) {
  file_ = std::fopen(temp_path_.c_str(), "wb");
  if (file_ == nullptr) {
    throw std::runtime_error("Cannot create " + temp_path_ + ": " + errno_text() + ".");
  }
}

AtomicFile::~AtomicFile() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::remove(temp_path_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t size) {
  if (file_ == nullptr) throw std::logic_error("AtomicFile::write after commit");
  if (size != 0 && std::fwrite(data, 1, size, file_) != size) {
    throw std::runtime_error("Cannot write " + temp_path_ + ": " + errno_text() + ".");
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
    throw std::runtime_error("Cannot write " + temp_path_ + ": " +
                             (flushed ? errno_text() : flush_error) + ".");
  }
  if (std::rename(temp_path_.c_str(), path_.c_str()) != 0) {
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

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("Cannot open " + what + " " + path + ": " + errno_text() + ".");
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) throw std::runtime_error("Cannot read " + what + " " + path + ".");
  return std::move(content).str();
}

}  // namespace remat::util
