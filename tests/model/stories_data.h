#pragma once
// stories260K as the tests use it (shared/models/stories260K/README.md's setup): the model, the
// first 40,000 characters of its text encoded without BOS, and window w = BOS + ids [511 w, 511 (w + 1)).
// The data lives outside the repo (kvq::model::stories260k_dir(): ../shared beside the source tree, or
// $KVQ_SHARED_DIR); a test that reads it starts with KVQ_REQUIRE_STORIES260K() so that a clone without it
// skips, saying where it looked, instead of failing or crashing on an empty file.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/model/model.h"

namespace kvq::model::testing {

inline std::string stories_dir() { return kvq::model::stories260k_dir(); }

// The checkpoint, its tokenizer and its text are all there.
inline bool stories_available() {
  struct stat st {};
  for (const char* f : {"/stories260K.bin", "/tok512.bin", "/tinystories_valid_head.txt"})
    if (::stat((stories_dir() + f).c_str(), &st) != 0) return false;
  return true;
}

}  // namespace kvq::model::testing

// In a test body, SetUp or SetUpTestSuite (gtest skips the suite's tests from there).
#define KVQ_REQUIRE_STORIES260K()                                                                     \
  do {                                                                                                \
    if (!::kvq::model::testing::stories_available())                                                  \
      GTEST_SKIP() << "stories260K not found in " << ::kvq::model::testing::stories_dir()             \
                   << " (the project's shared data: put shared/ beside the clone or set KVQ_SHARED_DIR)"; \
  } while (0)

namespace kvq::model::testing {

inline std::vector<int32_t> stories_text_ids(const Model& m) {
  std::ifstream f(stories_dir() + "/tinystories_valid_head.txt", std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  return m.tokenizer().encode(std::string_view(text).substr(0, 40000), false);
}

inline std::vector<int32_t> stories_window(const std::vector<int32_t>& ids, int w) {
  std::vector<int32_t> v = {1};
  v.insert(v.end(), ids.begin() + 511 * w, ids.begin() + 511 * (w + 1));
  return v;
}

}  // namespace kvq::model::testing
