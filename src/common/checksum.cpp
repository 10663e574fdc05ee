#include "kvq/common/checksum.h"

#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "kvq/common/file_io.h"

namespace kvq {
namespace {

// "size mtime_ns sha256" of the file as it is now (the sha part left empty here).
Result<std::string> identity(const std::string& path, std::string_view what) {
  auto f = InputFile::open(path, what);
  if (!f.is_ok()) return f.status();
  struct stat st {};
  if (::fstat(f.value().fd(), &st) != 0) return invalid_argument("cannot stat " + std::string(what) + " '" + path + "'");
  const int64_t ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return std::to_string(static_cast<uint64_t>(st.st_size)) + " " + std::to_string(ns);
}

}  // namespace

Result<std::string> sha256_file(const std::string& path, std::string_view what) {
  auto f = InputFile::open(path, what);
  if (!f.is_ok()) return f.status();
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) return internal_error("OpenSSL SHA-256 init failed");
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = ::read(f.value().fd(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return invalid_argument("error reading " + std::string(what) + " '" + path + "': " + std::strerror(errno));
    if (n == 0) break;
    if (EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n)) != 1) return internal_error("OpenSSL SHA-256 update failed");
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  if (EVP_DigestFinal_ex(ctx.get(), md, &len) != 1) return internal_error("OpenSSL SHA-256 final failed");
  static const char* const kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned i = 0; i < len; ++i) {
    hex += kHex[md[i] >> 4];
    hex += kHex[md[i] & 15];
  }
  return hex;
}

Status verify_file_sha256(const std::string& path, uint64_t expected_size, std::string_view expected_sha256,
                          const std::string& stamp_path, std::string_view remedy) {
  const std::string what = "model file";
  auto id = identity(path, what);
  if (!id.is_ok()) return id.status();
  const std::string size_str = std::to_string(expected_size);
  if (id.value().compare(0, size_str.size() + 1, size_str + " ") != 0)
    return corrupt_input("model file '" + path + "' has the wrong size (" + id.value().substr(0, id.value().find(' ')) +
                         " bytes, expected " + size_str + "); " + std::string(remedy));
  const std::string stamp = id.value() + " " + std::string(expected_sha256) + "\n";
  auto old = read_file(stamp_path, 4096, "checksum stamp");
  if (old.is_ok() && old.value() == stamp) return Status::ok();
  auto got = sha256_file(path, what);
  if (!got.is_ok()) return got.status();
  if (got.value() != expected_sha256)
    return corrupt_input("model file '" + path + "' fails its sha256 check (" + got.value() + ", expected " +
                         std::string(expected_sha256) + "); " + std::string(remedy));
  (void)write_file_atomic(stamp_path, stamp, "checksum stamp");  // best effort: next load hashes again
  return Status::ok();
}

}  // namespace kvq
