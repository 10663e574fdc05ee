#include "kvq/common/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

namespace kvq {
namespace {

std::string quoted(std::string_view what, const std::string& path) {
  return std::string(what) + " '" + path + "'";
}

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISREG(m)) return "";
  return "a special file";
}

Status not_regular(std::string_view what, const std::string& path, mode_t m) {
  return invalid_argument(quoted(what, path) + " is " + kind_of(m) + ", not a regular file");
}

Status open_error(std::string_view what, const std::string& path, int e) {
  if (e == ENOENT) return Status(StatusCode::kNotFound, quoted(what, path) + " does not exist");
  return invalid_argument("cannot open " + quoted(what, path) + ": " + std::strerror(e));
}

// Reads exactly n bytes from the start of fd into out.
Status read_bytes(int fd, uint64_t n, std::string* out, std::string_view what, const std::string& path) {
  out->resize(n);
  uint64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, out->data() + got, n - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return invalid_argument("error reading " + quoted(what, path) + ": " + std::strerror(errno));
    if (r == 0)
      return corrupt_input(quoted(what, path) + " shrank while being read (" + std::to_string(got) + " of " +
                           std::to_string(n) + " bytes)");
    got += static_cast<uint64_t>(r);
  }
  return Status::ok();
}

std::string dir_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Creates a fresh temporary file beside `path` (mode 0666 less the umask, like any new file).
Result<std::pair<int, std::string>> create_temp_beside(const std::string& path, std::string_view what) {
  static std::atomic<unsigned> counter{0};
  const std::string stem = dir_of(path) + "/." + base_of(path) + ".tmp-" + std::to_string(::getpid()) + "-";
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string tmp = stem + std::to_string(counter.fetch_add(1));
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return std::make_pair(fd, tmp);
    if (errno != EEXIST)
      return invalid_argument("cannot write " + quoted(what, path) + ": cannot create a file in '" + dir_of(path) +
                              "': " + std::strerror(errno));
  }
  return invalid_argument("cannot write " + quoted(what, path) + ": no free temporary name in '" + dir_of(path) + "'");
}

Status check_target(const std::string& path, std::string_view what) {
  if (path.empty()) return invalid_argument(std::string(what) + ": empty path");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return invalid_argument("cannot write " + quoted(what, path) + ": it is " + kind_of(st.st_mode));
  const std::string dir = dir_of(path);
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0)
    return Status(StatusCode::kNotFound, "cannot write " + quoted(what, path) + ": folder '" + dir + "' does not exist");
  if (!S_ISDIR(ds.st_mode))
    return invalid_argument("cannot write " + quoted(what, path) + ": '" + dir + "' is not a folder");
  return Status::ok();
}

}  // namespace

InputFile& InputFile::operator=(InputFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    size_ = o.size_;
    o.fd_ = -1;
  }
  return *this;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

Result<InputFile> InputFile::open(const std::string& path, std::string_view what) {
  if (path.empty()) return invalid_argument(std::string(what) + ": empty path");
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below anyway.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    int e = errno;
    struct stat st {};
    // A path that exists but cannot be opened (a socket, say) is described by its kind.
    if (e != ENOENT && ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return not_regular(what, path, st.st_mode);
    return open_error(what, path, e);
  }
  InputFile f;
  f.fd_ = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return invalid_argument("cannot stat " + quoted(what, path) + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return not_regular(what, path, st.st_mode);
  // Regular files never block; clear the flag so reads behave normally.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  f.size_ = static_cast<uint64_t>(st.st_size);
  return f;
}

std::string describe_non_regular(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return kind_of(st.st_mode);
}

Result<std::string> read_file(const std::string& path, uint64_t max_bytes, std::string_view what) {
  auto f = InputFile::open(path, what);
  if (!f.is_ok()) return f.status();
  const uint64_t size = f.value().size();
  if (size > max_bytes)
    return invalid_argument(quoted(what, path) + " is " + std::to_string(size) + " bytes; kvq reads at most " +
                            std::to_string(max_bytes));
  std::string out;
  KVQ_RETURN_IF_ERROR(read_bytes(f.value().fd(), size, &out, what, path));
  return out;
}

Result<FilePrefix> read_file_prefix(const std::string& path, uint64_t max_bytes, std::string_view what) {
  auto f = InputFile::open(path, what);
  if (!f.is_ok()) return f.status();
  FilePrefix p;
  p.file_size = f.value().size();
  KVQ_RETURN_IF_ERROR(read_bytes(f.value().fd(), std::min(p.file_size, max_bytes), &p.bytes, what, path));
  return p;
}

Status write_file_atomic(const std::string& path, std::string_view bytes, std::string_view what) {
  KVQ_RETURN_IF_ERROR(check_target(path, what));
  auto tmp = create_temp_beside(path, what);
  if (!tmp.is_ok()) return tmp.status();
  auto [fd, tmp_path] = tmp.value();
  auto fail = [&, fd = fd, tmp_path = tmp_path](const std::string& why) {
    ::close(fd);
    ::unlink(tmp_path.c_str());
    return invalid_argument("cannot write " + quoted(what, path) + ": " + why);
  };
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return fail(std::strerror(errno));
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) return fail(std::string("flushing to disk failed: ") + std::strerror(errno));
  if (::close(fd) != 0) {
    ::unlink(tmp_path.c_str());
    return invalid_argument("cannot write " + quoted(what, path) + ": " + std::strerror(errno));
  }
  if (::rename(tmp_path.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp_path.c_str());
    return invalid_argument("cannot write " + quoted(what, path) + ": rename failed: " + std::strerror(e));
  }
  return Status::ok();
}

Status check_writable(const std::string& path, std::string_view what) {
  KVQ_RETURN_IF_ERROR(check_target(path, what));
  auto tmp = create_temp_beside(path, what);
  if (!tmp.is_ok()) return tmp.status();
  ::close(tmp.value().first);
  ::unlink(tmp.value().second.c_str());
  return Status::ok();
}

}  // namespace kvq
