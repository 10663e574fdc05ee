// stories260K end to end: loader, tokenizer, forward over the paged cache, generation. Reference
// values come from /work/shared/models/stories260K/README.md (an independent float64 numpy
// implementation, and llama2.c's published greedy sample).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>

#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::model {
namespace {

using testing::stories_dir;

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

QuantSpec spec_of(Format f, int sink = 0, ScaleGranularity g = ScaleGranularity::kPerTokenHead) {
  QuantSpec s;
  s.format = f;
  s.granularity = g;
  s.sink_tokens = sink;
  s.block_size = 16;
  return s;
}

class Stories : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    KVQ_REQUIRE_STORIES260K();  // else the suite's setup fails the binary (SetUp skips each test)
    auto m = Model::load(stories_dir() + "/stories260K.bin");
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    model_ = std::move(m).value().release();
    text_ = new std::string(read_text(stories_dir() + "/tinystories_valid_head.txt"));
  }
  void SetUp() override { KVQ_REQUIRE_STORIES260K(); }
  static void TearDownTestSuite() {
    delete model_;
    delete text_;
  }

  // Mean NLL over windows [0, n_windows) of the README setup: the first 40,000 characters encoded
  // without BOS, windows of 511 ids, each prefixed by BOS and run from an empty cache.
  static double window_nll(const QuantSpec& spec, int n_windows, int chunked_decode_tail = 0) {
    auto ids = model_->tokenizer().encode(std::string_view(*text_).substr(0, 40000), false);
    auto runner = Runner::create(*model_, spec, 512);
    EXPECT_TRUE(runner.is_ok()) << runner.status().to_string();
    const int V = model_->config().vocab_size;
    double total = 0;
    long count = 0;
    std::vector<float> logits(512 * static_cast<size_t>(V));
    for (int w = 0; w < n_windows; ++w) {
      std::vector<int32_t> win = {1};
      win.insert(win.end(), ids.begin() + 511 * w, ids.begin() + 511 * (w + 1));
      EXPECT_TRUE(runner.value()->reset().is_ok());
      // Optionally feed the tail one token at a time to exercise the decode path.
      const int n = static_cast<int>(win.size()), head = n - chunked_decode_tail;
      EXPECT_TRUE(runner.value()->forward(win.data(), head, logits.data()).is_ok());
      for (int t = head; t < n; ++t)
        EXPECT_TRUE(runner.value()->forward(&win[t], 1, logits.data() + static_cast<size_t>(t) * V).is_ok());
      for (int t = 0; t + 1 < n; ++t) {
        const float* l = logits.data() + static_cast<size_t>(t) * V;
        double mx = l[0];
        for (int i = 1; i < V; ++i) mx = std::max(mx, static_cast<double>(l[i]));
        double s = 0;
        for (int i = 0; i < V; ++i) s += std::exp(l[i] - mx);
        total += mx + std::log(s) - l[win[t + 1]];
        ++count;
      }
    }
    return total / count;
  }

  static Model* model_;
  static std::string* text_;
};
Model* Stories::model_ = nullptr;
std::string* Stories::text_ = nullptr;

TEST_F(Stories, ConfigFromHeader) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.rope_half_split);
}

TEST_F(Stories, EncodeMatchesReference) {
  auto ids = model_->tokenizer().encode(std::string_view(*text_).substr(0, 200), true);
  ASSERT_EQ(ids.size(), 108u);
  std::vector<int32_t> head(ids.begin(), ids.begin() + 12);
  EXPECT_EQ(head, (std::vector<int32_t>{1, 301, 427, 309, 426, 301, 427, 309, 394, 265, 262, 415}));
  EXPECT_EQ(model_->tokenizer().decode(ids), text_->substr(0, 200));
}

TEST_F(Stories, NllWindow0MatchesReference) {
  double nll = window_nll(spec_of(Format::kBf16), 1);
  std::printf("stories260K window 0, bf16 cache: mean NLL %.5f (reference 1.31121)\n", nll);
  EXPECT_NEAR(nll, 1.31121, 1e-3);
}

// bf16 rounding of K/V alone moves window 0 by about +9e-4; with an fp16 cache (10 mantissa bits)
// the forward pass itself must agree with the float64 reference much more tightly.
TEST_F(Stories, NllWindow0Fp16CacheIsTight) {
  double nll = window_nll(spec_of(Format::kFp16), 1);
  std::printf("stories260K window 0, fp16 cache: mean NLL %.5f (reference 1.31121)\n", nll);
  EXPECT_NEAR(nll, 1.31121, 2e-4);
}

TEST_F(Stories, NllWindows0To7MatchReference) {
  double nll = window_nll(spec_of(Format::kBf16), 8);
  std::printf("stories260K windows 0-7, bf16 cache: mean NLL %.5f (reference 1.38709)\n", nll);
  EXPECT_NEAR(nll, 1.38709, 1e-3);
}

TEST_F(Stories, DecodePathMatchesPrefill) {
  // The last 40 tokens of window 0 go through decode (n == 1) instead of prefill.
  EXPECT_NEAR(window_nll(spec_of(Format::kBf16), 1, 40), 1.31121, 1e-3);
}

TEST_F(Stories, QuantizedCachesStayClose) {
  const double base = window_nll(spec_of(Format::kBf16), 2);
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8}) {
    double d = window_nll(spec_of(f), 2) - base;
    std::printf("stories260K windows 0-1, %s cache (no sink): delta NLL %+.5f\n", format_name(f), d);
    // head_dim 8 makes per-token scales coarse; still, 8-bit caches must not move the NLL far.
    EXPECT_LT(std::fabs(d), 0.05) << format_name(f);
  }
  // With a sink covering the whole window the quantized cache is never used: identical to bf16.
  EXPECT_NEAR(window_nll(spec_of(Format::kInt8, 512), 2), base, 1e-9);
}

TEST_F(Stories, GreedyFromBosMatchesReference) {
  auto runner = Runner::create(*model_, spec_of(Format::kBf16), 512);
  ASSERT_TRUE(runner.is_ok()) << runner.status().to_string();
  SamplingOptions opts;
  opts.max_new_tokens = 200;
  auto out = generate(*runner.value(), {1}, opts);
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  std::vector<int32_t> head(out.value().begin(), out.value().begin() + 24);
  EXPECT_EQ(head, (std::vector<int32_t>{403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338,
                                        401, 396, 267, 337, 410, 408, 419, 292}));
  std::string text = model_->tokenizer().decode(out.value());
  const std::string published =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she "
      "saw a big, red ball. She wanted to play with it, but it was too high.";
  EXPECT_EQ(text.substr(0, published.size()), published);
}

TEST_F(Stories, SamplingIsSeededAndDeterministic) {
  auto runner = Runner::create(*model_, spec_of(Format::kInt8, 4), 256);
  ASSERT_TRUE(runner.is_ok());
  SamplingOptions opts;
  opts.temperature = 0.9f;
  opts.top_p = 0.9f;
  opts.max_new_tokens = 64;
  opts.seed = 42;
  auto a = generate(*runner.value(), {1}, opts);
  ASSERT_TRUE(runner.value()->reset().is_ok());
  auto b = generate(*runner.value(), {1}, opts);
  ASSERT_TRUE(runner.value()->reset().is_ok());
  opts.seed = 43;
  auto c = generate(*runner.value(), {1}, opts);
  ASSERT_TRUE(a.is_ok() && b.is_ok() && c.is_ok());
  EXPECT_EQ(a.value(), b.value());
  EXPECT_NE(a.value(), c.value());
}

TEST_F(Stories, RunnerRejectsBadInput) {
  auto runner = Runner::create(*model_, spec_of(Format::kBf16), 32);
  ASSERT_TRUE(runner.is_ok());
  int32_t bad = 512;
  EXPECT_EQ(runner.value()->forward(&bad, 1, nullptr).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> many(33, 5);
  EXPECT_EQ(runner.value()->forward(many.data(), 33, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(runner.value()->position(), 0);
  EXPECT_TRUE(runner.value()->forward(many.data(), 32, nullptr).is_ok());
  EXPECT_EQ(runner.value()->position(), 32);
  EXPECT_EQ(runner.value()->forward(many.data(), 1, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Runner::create(*model_, spec_of(Format::kBf16), 513).status().code(), StatusCode::kInvalidArgument);
}

TEST(ModelPaths, AliasesResolveOrExplain) {
  KVQ_REQUIRE_STORIES260K();
  auto s = resolve_model_path("stories260K");
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_NE(s.value().find("stories260K.bin"), std::string::npos);
  const char* old = std::getenv("KVQ_CACHE_DIR");
  std::string saved = old ? old : "";
  setenv("KVQ_CACHE_DIR", "/nonexistent/kvq-cache", 1);
  EXPECT_EQ(cache_dir(), "/nonexistent/kvq-cache");
  auto m = resolve_model_path("smollm2");
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("kvq pull smollm2"), std::string::npos) << m.status().to_string();
  if (old) setenv("KVQ_CACHE_DIR", saved.c_str(), 1); else unsetenv("KVQ_CACHE_DIR");
  EXPECT_EQ(resolve_model_path("/nonexistent/x.gguf").status().code(), StatusCode::kNotFound);
}

// The shared data is found at run time: $KVQ_SHARED_DIR first, else ../shared beside the source tree;
// a missing checkpoint is kNotFound with the variable named, so a user knows what to set.
TEST(ModelPaths, SharedDataFollowsKvqSharedDir) {
  const char* old = std::getenv("KVQ_SHARED_DIR");
  const std::string saved = old ? old : "";
  unsetenv("KVQ_SHARED_DIR");
  EXPECT_EQ(shared_dir(), std::string(KVQ_SOURCE_DIR) + "/../shared");
  setenv("KVQ_SHARED_DIR", "/nonexistent/kvq-shared", 1);
  EXPECT_EQ(shared_dir(), "/nonexistent/kvq-shared");
  EXPECT_EQ(stories260k_dir(), "/nonexistent/kvq-shared/models/stories260K");
  auto s = resolve_model_path("stories260K");
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("/nonexistent/kvq-shared/models/stories260K/stories260K.bin"), std::string::npos)
      << s.status().to_string();
  EXPECT_NE(s.status().message().find("KVQ_SHARED_DIR"), std::string::npos) << s.status().to_string();
  setenv("KVQ_SHARED_DIR", "", 1);  // empty counts as unset
  EXPECT_EQ(shared_dir(), std::string(KVQ_SOURCE_DIR) + "/../shared");
  if (old) setenv("KVQ_SHARED_DIR", saved.c_str(), 1); else unsetenv("KVQ_SHARED_DIR");
}

}  // namespace
}  // namespace kvq::model
