#pragma once
// stories260K as the tests use it (shared/models/stories260K/README.md's setup): the model, the
// first 40,000 characters of its text encoded without BOS, and window w = BOS + ids [511 w, 511 (w + 1)).
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/model/model.h"

namespace kvq::model::testing {

inline std::string stories_dir() { return std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K"; }

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
