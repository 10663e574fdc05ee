#pragma once
// File checksums (SHA-256 through OpenSSL's libcrypto) and a cheap re-verification stamp.
#include <cstdint>
#include <string>
#include <string_view>

#include "kvq/common/status.h"

namespace kvq {

// Lower-case hex SHA-256 of a regular file's contents (streamed, constant memory).
Result<std::string> sha256_file(const std::string& path, std::string_view what);

// Verifies that `path` is `expected_size` bytes with SHA-256 `expected_sha256` (lower-case hex).
// Hashing costs ~0.3 s per 100 MB, so a verified file gets a stamp, `stamp_path`, recording its
// size, modification time (ns) and hash; while the file keeps that size and mtime the stamp is
// trusted and nothing is hashed. A wrong size is refused without hashing. A stamp that cannot be
// written (read-only folder) only means the next call hashes again. kCorruptInput on mismatch,
// naming the file, both hashes and `remedy`.
Status verify_file_sha256(const std::string& path, uint64_t expected_size, std::string_view expected_sha256,
                          const std::string& stamp_path, std::string_view remedy);

}  // namespace kvq
