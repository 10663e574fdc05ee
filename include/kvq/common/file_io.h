#pragma once
// File input and output with the checks every loader and writer needs, in one place:
// - inputs must be regular files (a directory, FIFO, socket or device is refused by name, and a
//   FIFO is never waited on), and their size is capped before anything is allocated;
// - outputs are written atomically (a temporary file in the same directory, then rename), so a
//   failed or interrupted run leaves the old file or none, never a truncated one, and a tool can
//   check that an output path is writable before a long run starts.
// Messages name `what` (e.g. "tokenizer file") and the path.
#include <cstdint>
#include <string>
#include <string_view>

#include "kvq/common/status.h"

namespace kvq {

// An open, read-only regular file. Closes on destruction.
class InputFile {
 public:
  // kNotFound when absent; kInvalidArgument for a non-regular file or a read permission error.
  static Result<InputFile> open(const std::string& path, std::string_view what);
  InputFile() = default;
  InputFile(InputFile&& o) noexcept : fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }
  InputFile& operator=(InputFile&& o) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();
  int fd() const { return fd_; }
  uint64_t size() const { return size_; }

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Kind of a path for messages: "a directory", "a FIFO (named pipe)", "a character device", ...;
// empty for a regular file or a path that does not exist.
std::string describe_non_regular(const std::string& path);

// Reads a whole regular file. A file larger than `max_bytes` is refused (kInvalidArgument:
// "<what> '<path>' is N bytes; kvq reads at most M").
Result<std::string> read_file(const std::string& path, uint64_t max_bytes, std::string_view what);

// Reads at most the first `max_bytes` bytes of a regular file (no refusal for size).
struct FilePrefix {
  std::string bytes;
  uint64_t file_size = 0;
  bool truncated() const { return bytes.size() < file_size; }
};
Result<FilePrefix> read_file_prefix(const std::string& path, uint64_t max_bytes, std::string_view what);

// Replaces `path` with `bytes` atomically: writes `.<name>.tmp-*` beside it, flushes it to disk,
// renames it over `path`. On any error the temporary file is removed and `path` is untouched.
Status write_file_atomic(const std::string& path, std::string_view bytes, std::string_view what);

// Whether write_file_atomic(path, ...) can succeed, checked now (before a long run): the path is
// not a directory or other non-regular file, and its directory exists and accepts a new file
// (probed by creating and removing a temporary file, which also catches read-only filesystems).
Status check_writable(const std::string& path, std::string_view what);

}  // namespace kvq
