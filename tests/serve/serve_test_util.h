#pragma once
// Shared fixtures of the serving tests: stories260K, prompts cut from its TinyStories text, and
// the reference "same prompt run alone" (Runner + model::generate).
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "kvq/backend/backend.h"
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::serve::testing {

using model::testing::stories_dir;

inline const model::Model& stories() {
  static std::unique_ptr<model::Model> m = [] {
    auto r = model::Model::load(stories_dir() + "/stories260K.bin");
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    return r.is_ok() ? std::move(r).value() : nullptr;
  }();
  return *m;
}

inline const std::string& stories_text() {
  static std::string t = [] {
    std::ifstream f(stories_dir() + "/tinystories_valid_head.txt", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }();
  return t;
}

// Prompt i: BOS + `len` ids of the text starting at a position that depends on i.
inline std::vector<int32_t> prompt_ids(int i, int len) {
  static std::vector<int32_t> ids = stories().tokenizer().encode(std::string_view(stories_text()).substr(0, 60000), false);
  std::vector<int32_t> p = {stories().tokenizer().bos_id()};
  const size_t start = (static_cast<size_t>(i) * 997) % (ids.size() - static_cast<size_t>(len) - 1);
  p.insert(p.end(), ids.begin() + static_cast<long>(start), ids.begin() + static_cast<long>(start) + len);
  return p;
}

inline QuantSpec spec(Format f, int sink) {
  QuantSpec s;
  s.format = f;
  s.granularity = ScaleGranularity::kPerTokenHead;
  s.block_size = 16;
  s.sink_tokens = sink;
  return s;
}

// The same prompt run alone: one sequence, model::generate.
inline std::vector<int32_t> run_alone(const QuantSpec& s, const std::vector<int32_t>& prompt, int max_new,
                                      float temperature = 0.f, float top_p = 1.f, uint64_t seed = 0) {
  auto r = model::Runner::create(stories(), s, stories().config().max_seq_len);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  model::SamplingOptions so;
  so.temperature = temperature;
  so.top_p = top_p;
  so.seed = seed;
  so.max_new_tokens = max_new;
  auto g = model::generate(*r.value(), prompt, so);
  EXPECT_TRUE(g.is_ok()) << g.status().to_string();
  return g.is_ok() ? g.value() : std::vector<int32_t>{};
}

}  // namespace kvq::serve::testing
