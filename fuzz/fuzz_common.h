#pragma once
// Shared by the fuzz targets: an input written to a per-process scratch file, for APIs that take
// a path (the model loaders and the text reader read files, and their file checks are under test).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvq::fuzz {

inline std::string scratch_path(const char* tag) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir && *dir ? dir : "/tmp") + "/kvq-fuzz-" + tag + "-" + std::to_string(::getpid());
}

inline bool write_scratch(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  bool ok = size == 0 || std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok;
}

// The status of a refusal must carry a message (it is what the user sees).
#define KVQ_FUZZ_CHECK(cond)                                                  \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

}  // namespace kvq::fuzz
