// PagedKvCache: validation, token placement, per-granularity scales, sink, fork/COW, shared prefixes,
// exhaustion.
#include "kvq/cache/paged_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cache/cache_test_util.h"

namespace kvq::cache {
namespace {

using testing::allowed_error;
using testing::make_config;
using testing::random_rows;
using testing::Shadow;

constexpr auto kTensor = ScaleGranularity::kPerTensor;
constexpr auto kToken = ScaleGranularity::kPerTokenHead;
constexpr auto kBlock = ScaleGranularity::kPerBlockHead;

std::unique_ptr<PagedKvCache> make(const CacheConfig& c) {
  auto r = PagedKvCache::create(c);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(r.value()) : nullptr;
}

TEST(PagedKvCacheCreate, RejectsBadShapesWithClearErrors) {
  struct Case {
    CacheConfig c;
    StatusCode code;
    const char* mentions;
  };
  auto base = [] { return make_config(Format::kInt8, kToken, 16, 2, 2, 64, 8, 0, 0); };
  std::vector<Case> cases;
  auto add = [&](auto edit, StatusCode code, const char* m) {
    CacheConfig c = base();
    edit(c);
    cases.push_back({c, code, m});
  };
  add([](CacheConfig& c) { c.num_layers = 0; }, StatusCode::kInvalidArgument, "num_layers");
  add([](CacheConfig& c) { c.num_kv_heads = 0; }, StatusCode::kInvalidArgument, "num_kv_heads");
  for (int d : {0, 4, 12, 60, 100, 264, 512, -8}) {
    add([d](CacheConfig& c) { c.head_dim = d; }, StatusCode::kInvalidArgument, "head_dim");
  }
  for (int bs : {0, 8, 24, 64}) {
    add([bs](CacheConfig& c) { c.spec.block_size = bs; }, StatusCode::kInvalidArgument, "16, 32");
  }
  add([](CacheConfig& c) { c.spec.scale_dtype = static_cast<ScaleDtype>(7); }, StatusCode::kInvalidArgument, "scale dtype");
  add([](CacheConfig& c) { c.num_pages = 0; }, StatusCode::kInvalidArgument, "num_pages");
  add([](CacheConfig& c) { c.num_sink_pages = -1; }, StatusCode::kInvalidArgument, "num_sink_pages");
  add([](CacheConfig& c) { c.spec.sink_tokens = -5; }, StatusCode::kInvalidArgument, "sink_tokens");
  // 20 sink tokens at block 16 need 2 sink pages per sequence.
  add([](CacheConfig& c) { c.spec.sink_tokens = 20; c.num_sink_pages = 1; }, StatusCode::kInvalidArgument, "2 sink pages");
  add([](CacheConfig& c) { c.spec.sink_tokens = 256; }, StatusCode::kInvalidArgument, "--kv-sink-tokens 0");
  add([](CacheConfig& c) { c.num_pages = 1 << 30; c.num_kv_heads = 1 << 20; }, StatusCode::kOutOfMemory, "GiB");
  for (const Case& c : cases) {
    auto r = PagedKvCache::create(c.c);
    ASSERT_FALSE(r.is_ok()) << c.mentions;
    EXPECT_EQ(r.status().code(), c.code) << r.status().to_string();
    EXPECT_NE(r.status().message().find(c.mentions), std::string::npos) << r.status().message();
  }
}

TEST(PagedKvCacheCreate, AcceptsTheSupportedRange) {
  for (int d : {8, 64, 128, 256}) {
    EXPECT_TRUE(PagedKvCache::create(make_config(Format::kFp8E4m3, kToken, 32, 1, 1, d, 1, 0, 0)).is_ok()) << d;
  }
  // Sink pages without a default sink: sequences may still ask for one explicitly.
  auto c = make(make_config(Format::kInt8, kBlock, 16, 1, 1, 8, 2, 3, 0));
  ASSERT_TRUE(c);
  EXPECT_EQ(c->sink_capacity(c->add_sequence().value()), 0);
  EXPECT_EQ(c->sink_capacity(c->add_sequence(40).value()), 40);
  Result<SeqId> too_big = c->add_sequence(49);  // 3 sink pages hold 48 tokens
  ASSERT_FALSE(too_big.is_ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
}

TEST(PagedKvCachePlanes, AlignedSizedAndViewed) {
  for (auto [f, g] : {std::pair{Format::kFp8E4m3, kToken}, {Format::kInt8, kBlock}, {Format::kFp8E4m3Fnuz, kTensor},
                      {Format::kBf16, kToken}, {Format::kInt4, kToken}}) {
    auto c = make(make_config(f, g, 16, 3, 3, 24, 7, 5, 16));
    ASSERT_TRUE(c);
    const CacheGeometry& geo = c->geometry();
    for (int l = 0; l < 3; ++l) {
      const auto& p = c->planes(l);
      EXPECT_EQ(p.k_codes.size(), geo.code_plane_bytes());
      EXPECT_EQ(p.v_scales.size() * 4, geo.scale_plane_bytes());
      EXPECT_EQ(p.k_sink.size() * 2, geo.sink_plane_bytes());
      for (const void* ptr : {static_cast<const void*>(p.k_codes.data()), static_cast<const void*>(p.v_codes.data()),
                              static_cast<const void*>(p.k_sink.data()), static_cast<const void*>(p.v_sink.data())}) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(ptr) % kPlaneAlignment, 0u);
      }
      if (geo.has_scales()) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(p.k_scales.data()) % kPlaneAlignment, 0u);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(p.v_scales.data()) % kPlaneAlignment, 0u);
      }
      LayerView v = c->layer_view(l);
      EXPECT_EQ(v.k_codes, p.k_codes.data());
      EXPECT_EQ(v.k_scales != nullptr, geo.has_scales());
      EXPECT_NE(v.v_sink, nullptr);
    }
    EXPECT_EQ(c->layer_view(3).k_codes, nullptr);
    const MemoryReport m = c->memory_report();
    EXPECT_EQ(m.code_bytes, 3 * 2 * geo.code_plane_bytes());
    EXPECT_EQ(m.scale_bytes, 3 * 2 * geo.scale_plane_bytes());
    EXPECT_EQ(m.sink_bytes, 3 * 2 * geo.sink_plane_bytes());
    EXPECT_EQ(m.pages_used, 0);
  }
  auto nosink = make(make_config(Format::kInt8, kToken, 16, 1, 1, 8, 1, 0, 0));
  EXPECT_EQ(nosink->layer_view(0).k_sink, nullptr);
}

// Where token t lands (layout.h): the sink while t < sink capacity, then quantized pages.
TEST(PagedKvCacheLayout, TokensLandWhereLayoutSays) {
  const int heads = 2, dim = 8, bs = 16;
  auto c = make(make_config(Format::kInt8, kToken, bs, 1, heads, dim, 8, 4, 20));
  ASSERT_TRUE(c);
  const SeqId s = c->add_sequence().value();
  ASSERT_TRUE(c->extend(s, 50).is_ok());
  EXPECT_EQ(c->sink_len(s), 20);
  EXPECT_EQ(c->sink_table(s).size(), 2u);   // 20 sink tokens
  EXPECT_EQ(c->block_table(s).size(), 2u);  // 30 quantized tokens
  std::vector<float> k(50 * heads * dim), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i % 97) - 48.f;  // small integers: exact in the bf16 sink
    v[i] = -k[i] * 0.5f;
  }
  ASSERT_TRUE(c->write(s, 0, 0, k.data(), v.data(), 50).is_ok());
  const CacheGeometry& g = c->geometry();
  const auto& p = c->planes(0);
  // Token 17, head 1 -> sink page sink_table[1], slot 1; bf16 of small integers is exact.
  const size_t sink_off = g.elem_index(c->sink_table(s)[1], 1, 1);
  for (int i = 0; i < dim; ++i) {
    EXPECT_EQ(format::bf16_to_float(p.k_sink[sink_off + i]), k[(17 * heads + 1) * dim + i]);
  }
  // Token 20 + 16 + 3 = 39 -> block_table[1], slot 3; int8 code * per-token-head scale.
  const int32_t page = c->block_table(s)[1];
  for (int h = 0; h < heads; ++h) {
    const float scale = p.k_scales[g.scale_index(page, h, 3)];
    const float* want = &k[static_cast<size_t>((39 * heads + h) * dim)];
    EXPECT_EQ(scale, testing::finite_abs_max(want, dim) / 127.f);
    for (int i = 0; i < dim; ++i) {
      const float got = static_cast<float>(static_cast<int8_t>(p.k_codes[g.elem_index(page, h, 3) + i])) * scale;
      EXPECT_LE(std::fabs(got - want[i]), allowed_error(Format::kInt8, want[i], scale));
    }
  }
  std::vector<float> rk(heads * dim), rv(heads * dim);
  EXPECT_EQ(c->read_token(s, 0, 50, rk.data(), rv.data()).code(), StatusCode::kInvalidArgument);
}

// token_slot() gives the slot every writer uses: the sink for t < sink_len, else the main page of
// t - sink_len; nothing for an unknown sequence or an unreserved position.
TEST(PagedKvCacheLayout, TokenSlotFollowsTheTables) {
  const int bs = 16;
  auto c = make(make_config(Format::kFp8E4m3, kToken, bs, 1, 2, 8, 8, 4, 20));
  ASSERT_TRUE(c);
  const SeqId other = c->add_sequence().value();
  ASSERT_TRUE(c->extend(other, 40).is_ok());  // takes pages first, so `s` gets non-initial ones
  const SeqId s = c->add_sequence().value();
  ASSERT_TRUE(c->extend(s, 50).is_ok());
  int32_t slot = 12345;
  ASSERT_TRUE(c->token_slot(s, 17, &slot));
  EXPECT_EQ(slot, -(c->sink_table(s)[1] * bs + 1) - 1);
  ASSERT_TRUE(c->token_slot(s, 39, &slot));  // 39 - 20 = 19: block 1, slot 3
  EXPECT_EQ(slot, c->block_table(s)[1] * bs + 3);
  for (int32_t p : c->block_table(other)) EXPECT_NE(c->block_table(s)[1], p);
  slot = 777;
  EXPECT_FALSE(c->token_slot(s, 50, &slot));
  EXPECT_FALSE(c->token_slot(s, -1, &slot));
  EXPECT_FALSE(c->token_slot(99, 0, &slot));
  EXPECT_EQ(slot, 777);
}

struct FormatCase {
  Format f;
  ScaleGranularity g;
  int bs, dim;
};

void PrintTo(const FormatCase& c, std::ostream* os) {
  *os << "format " << static_cast<int>(c.f) << " " << granularity_name(c.g) << " b" << c.bs << " d" << c.dim;
}

class RoundTrip : public ::testing::TestWithParam<FormatCase> {};

// Prefill in chunks, then decode token by token, across the sink boundary; every token read back
// within its derived bound.
TEST_P(RoundTrip, EveryTokenWithinBound) {
  const FormatCase fc = GetParam();
  const int layers = 2, heads = 3;
  const CacheConfig cfg = make_config(fc.f, fc.g, fc.bs, layers, heads, fc.dim, 16, 4, 24);
  auto c = make(cfg);
  ASSERT_TRUE(c);
  Shadow shadow(cfg);
  std::mt19937 rng(static_cast<unsigned>(fc.dim * 131 + fc.bs + static_cast<int>(fc.f) * 7 + static_cast<int>(fc.g)));
  const SeqId s = c->add_sequence().value();
  shadow.add(s, 24);
  for (int n : {37, 1, 1, 5, 1, 2, 40, 1, 1}) {
    ASSERT_TRUE(c->extend(s, n).is_ok());
    shadow.extend(s, n);
    for (int l = 0; l < layers; ++l) {
      const std::vector<float> k = random_rows(rng, n, heads, fc.dim), v = random_rows(rng, n, heads, fc.dim);
      const int pos0 = c->written(s, l);
      ASSERT_TRUE(c->write(s, l, pos0, k.data(), v.data(), n).is_ok());
      shadow.write(s, l, pos0, k.data(), v.data(), n);
    }
    ASSERT_TRUE(shadow.check(*c, s));
  }
  EXPECT_EQ(c->stats().values, shadow.values);
  EXPECT_EQ(c->stats().requantized_page_heads, shadow.requantized);
  EXPECT_EQ(c->stats().nonfinite, 0u);
  if (fc.g != kTensor || !is_quantized(fc.f)) {
    EXPECT_EQ(c->stats().saturated, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, RoundTrip,
    ::testing::Values(FormatCase{Format::kFp8E4m3, kToken, 16, 64}, FormatCase{Format::kFp8E4m3, kBlock, 16, 64},
                      FormatCase{Format::kFp8E4m3, kTensor, 16, 64}, FormatCase{Format::kFp8E4m3Fnuz, kToken, 32, 128},
                      FormatCase{Format::kFp8E4m3Fnuz, kBlock, 32, 128}, FormatCase{Format::kFp8E4m3Fnuz, kTensor, 16, 8},
                      FormatCase{Format::kInt8, kToken, 16, 8}, FormatCase{Format::kInt8, kBlock, 16, 128},
                      FormatCase{Format::kInt8, kTensor, 32, 64}, FormatCase{Format::kBf16, kToken, 16, 64},
                      FormatCase{Format::kFp16, kBlock, 32, 256}, FormatCase{Format::kInt8, kBlock, 32, 256},
                      FormatCase{Format::kInt4, kToken, 16, 64}, FormatCase{Format::kInt4, kBlock, 32, 8},
                      FormatCase{Format::kInt4, kTensor, 16, 128}));

TEST(PerBlockHead, PrefillSetsTheScaleFromThePageWithoutRequantizing) {
  const int dim = 16, heads = 2;
  auto c = make(make_config(Format::kInt8, kBlock, 16, 1, heads, dim, 4, 0, 0));
  std::mt19937 rng(5);
  const std::vector<float> k = random_rows(rng, 16, heads, dim), v = random_rows(rng, 16, heads, dim);
  const SeqId s = c->add_sequence().value();
  ASSERT_TRUE(c->extend(s, 16).is_ok());
  ASSERT_TRUE(c->write(s, 0, 0, k.data(), v.data(), 16).is_ok());
  EXPECT_EQ(c->stats().requantized_page_heads, 0u);
  const int32_t page = c->block_table(s)[0];
  for (int h = 0; h < heads; ++h) {
    float amax = 0;
    for (int t = 0; t < 16; ++t) amax = std::max(amax, testing::finite_abs_max(&k[static_cast<size_t>((t * heads + h) * dim)], dim));
    EXPECT_EQ(c->planes(0).k_scales[c->geometry().scale_index(page, h, 0)], amax / 127.f);
    EXPECT_EQ(c->block_amax_plane(0, 0)[page * heads + h], amax);
  }
  EXPECT_EQ(c->block_amax_plane(1, 0), nullptr);
  EXPECT_EQ(c->block_amax_plane(0, 2), nullptr);
}

// Small values first, then one large token in head 0 of K only: exactly that page head is
// re-quantized, its old tokens still decode within two roundings at the new scale.
TEST(PerBlockHead, GrowthRequantizesOldTokens) {
  for (Format f : {Format::kInt8, Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt4}) {
    const int dim = 16, heads = 2;
    auto c = make(make_config(f, kBlock, 16, 1, heads, dim, 4, 0, 0));
    std::mt19937 rng(11);
    const SeqId s = c->add_sequence().value();
    ASSERT_TRUE(c->extend(s, 6).is_ok());
    std::vector<float> k = random_rows(rng, 5, heads, dim, -1.f, 0.f), v = random_rows(rng, 5, heads, dim, -1.f, 0.f);
    for (float& x : k) x = std::clamp(x, -1.f, 1.f);
    for (float& x : v) x = std::clamp(x, -1.f, 1.f);
    ASSERT_TRUE(c->write(s, 0, 0, k.data(), v.data(), 5).is_ok());
    const int32_t page = c->block_table(s)[0];
    const CacheGeometry& g = c->geometry();
    const float old_scale = c->planes(0).k_scales[g.scale_index(page, 0, 0)];
    const float head1_scale = c->planes(0).k_scales[g.scale_index(page, 1, 0)];
    const float v_scale = c->planes(0).v_scales[g.scale_index(page, 0, 0)];
    std::vector<float> k6(heads * dim, 0.01f), v6(heads * dim, -0.01f);
    k6[3] = -10.f;  // head 0
    ASSERT_TRUE(c->write(s, 0, 5, k6.data(), v6.data(), 1).is_ok());
    EXPECT_EQ(c->stats().requantized_page_heads, 1u) << static_cast<int>(f);
    const float new_scale = c->planes(0).k_scales[g.scale_index(page, 0, 0)];
    EXPECT_EQ(new_scale, 10.f / format_qmax(f));
    EXPECT_GT(new_scale, old_scale * 5);
    EXPECT_EQ(c->planes(0).k_scales[g.scale_index(page, 1, 0)], head1_scale);
    EXPECT_EQ(c->planes(0).v_scales[g.scale_index(page, 0, 0)], v_scale);
    std::vector<float> rk(heads * dim), rv(heads * dim);
    for (int t = 0; t < 5; ++t) {
      ASSERT_TRUE(c->read_token(s, 0, t, rk.data(), rv.data()).is_ok());
      for (int i = 0; i < dim; ++i) {
        const float x = k[static_cast<size_t>(t * heads * dim + i)];
        EXPECT_LE(std::fabs(rk[static_cast<size_t>(i)] - x), allowed_error(f, x, new_scale, 1)) << "token " << t;
      }
    }
    ASSERT_TRUE(c->read_token(s, 0, 5, rk.data(), rv.data()).is_ok());
    EXPECT_EQ(rk[3], -10.f);
  }
}

TEST(PerTensor, ScaleFixedByFirstQuantizedWriteThenSaturates) {
  const int dim = 8, heads = 2;
  for (Format f : {Format::kInt8, Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt4}) {
    auto c = make(make_config(f, kTensor, 16, 2, heads, dim, 4, 1, 4));
    const SeqId s = c->add_sequence().value();
    ASSERT_TRUE(c->extend(s, 12).is_ok());
    std::vector<float> k(12 * heads * dim), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = std::sin(static_cast<float>(i)) * 2.f;  // |k| <= 2, amax near 2
      v[i] = std::cos(static_cast<float>(i));
    }
    // Tokens 0..3 are the sink: they do not fix the scale.
    ASSERT_TRUE(c->write(s, 0, 0, k.data(), v.data(), 4).is_ok());
    EXPECT_EQ(c->planes(0).k_scales[0], 0.f);
    ASSERT_TRUE(c->write(s, 0, 4, k.data() + 4 * heads * dim, v.data() + 4 * heads * dim, 4).is_ok());
    const float ks = c->planes(0).k_scales[0];
    EXPECT_EQ(ks, testing::finite_abs_max(k.data() + 4 * heads * dim, 4 * heads * dim) / format_qmax(f));
    EXPECT_EQ(c->planes(1).k_scales[0], 0.f);  // other layers are independent
    // Four times larger values now clip at qmax * scale.
    for (size_t i = 8 * heads * dim; i < k.size(); ++i) k[i] *= 4.f;
    ASSERT_TRUE(c->write(s, 0, 8, k.data() + 8 * heads * dim, v.data() + 8 * heads * dim, 4).is_ok());
    EXPECT_EQ(c->planes(0).k_scales[0], ks);
    uint64_t expect_clipped = 0;
    for (size_t i = 8 * heads * dim; i < k.size(); ++i) expect_clipped += quant::clips(f, k[i] / ks);
    EXPECT_GT(expect_clipped, 10u);
    EXPECT_EQ(c->stats().saturated, expect_clipped);
    std::vector<float> rk(heads * dim), rv(heads * dim);
    ASSERT_TRUE(c->read_token(s, 0, 10, rk.data(), rv.data()).is_ok());
    for (int i = 0; i < heads * dim; ++i) {
      const double x = std::clamp<double>(k[static_cast<size_t>(10 * heads * dim + i)], -format_qmax(f) * ks, format_qmax(f) * ks);
      EXPECT_LE(std::fabs(rk[static_cast<size_t>(i)] - x), allowed_error(f, x, ks));
    }
  }
}

TEST(NonFinite, StoredAsZeroCountedAndLeftOutOfScales) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (auto g : {kToken, kBlock, kTensor}) {
    const int dim = 8, heads = 1;
    const CacheConfig cfg = make_config(Format::kFp8E4m3, g, 16, 1, heads, dim, 2, 1, 2);
    auto c = make(cfg);
    Shadow shadow(cfg);
    const SeqId s = c->add_sequence().value();
    shadow.add(s, 2);
    ASSERT_TRUE(c->extend(s, 4).is_ok());
    shadow.extend(s, 4);
    std::vector<float> k = {nan, 1, 2, 3, -inf, 0.5f, 0.25f, 0,   // sink token
                            1, 1, 1, 1, 1, 1, 1, 1,               // sink token
                            inf, -1.5f, 0.75f, nan, 0.1f, 0.2f, -0.3f, 0.4f,
                            0.1f, 0.1f, inf, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f};
    std::vector<float> v(k.size(), 0.5f);
    v[20] = nan;
    ASSERT_TRUE(c->write(s, 0, 0, k.data(), v.data(), 4).is_ok());
    shadow.write(s, 0, 0, k.data(), v.data(), 4);
    EXPECT_EQ(c->stats().nonfinite, 6u);
    EXPECT_EQ(shadow.nonfinite, 6u);
    EXPECT_TRUE(shadow.check(*c, s));
    std::vector<float> rk(dim), rv(dim);
    ASSERT_TRUE(c->read_token(s, 0, 2, rk.data(), rv.data()).is_ok());
    EXPECT_EQ(rk[0], 0.f);
    EXPECT_EQ(rk[3], 0.f);
    EXPECT_EQ(rv[4], 0.f);
    EXPECT_EQ(rk[1], -1.5f);  // amax 1.5 ignores the infinities: -1.5 is the top code exactly
    ASSERT_TRUE(c->read_token(s, 0, 0, rk.data(), rv.data()).is_ok());
    EXPECT_EQ(rk[0], 0.f);
    EXPECT_EQ(rk[4], 0.f);
    EXPECT_EQ(rk[1], 1.f);
  }
}

TEST(WriteOrder, RefusesGapsAndUnreservedTokens) {
  auto c = make(make_config(Format::kInt8, kToken, 16, 2, 1, 8, 4, 0, 0));
  const SeqId s = c->add_sequence().value();
  ASSERT_TRUE(c->extend(s, 10).is_ok());
  std::vector<float> x(16 * 8, 1.f);
  Status st = c->write(s, 0, 2, x.data(), x.data(), 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("in order"), std::string::npos) << st.message();
  st = c->write(s, 0, 0, x.data(), x.data(), 11);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("extend"), std::string::npos) << st.message();
  EXPECT_EQ(c->write(s, 2, 0, x.data(), x.data(), 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->write(s, 0, 0, nullptr, x.data(), 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->write(s, 0, -1, x.data(), x.data(), 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->write(s + 1, 0, 0, x.data(), x.data(), 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->extend(s, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->write(s, 0, 0, x.data(), x.data(), 0).is_ok());
  EXPECT_EQ(c->written(s, 0), 0);
  ASSERT_TRUE(c->write(s, 0, 0, x.data(), x.data(), 4).is_ok());
  ASSERT_TRUE(c->write(s, 0, 4, x.data(), x.data(), 6).is_ok());
  ASSERT_TRUE(c->write(s, 0, 3, x.data(), x.data(), 2).is_ok());  // rewriting is allowed
  EXPECT_EQ(c->written(s, 0), 10);
  EXPECT_EQ(c->written(s, 1), 0);
  std::vector<float> r(8), r2(8);
  EXPECT_EQ(c->read_token(s, 1, 0, r.data(), r2.data()).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->free_sequence(s).is_ok());
  EXPECT_EQ(c->free_sequence(s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->seq_len(s), -1);
  EXPECT_TRUE(c->block_table(s).empty());
}

TEST(Exhaustion, ExtendIsAllOrNothing) {
  const CacheConfig cfg = make_config(Format::kFp8E4m3, kToken, 16, 2, 1, 8, 4, 2, 16);
  auto c = make(cfg);
  const SeqId a = c->add_sequence().value();
  ASSERT_TRUE(c->extend(a, 16 + 40).is_ok());  // 1 sink page + 3 pages
  EXPECT_EQ(c->pool().num_free(), 1);
  const SeqId b = c->add_sequence().value();
  ASSERT_TRUE(c->extend(b, 10).is_ok());  // sink only
  const auto free_before = c->pool().num_free(), sink_free_before = c->sink_pool().num_free();
  Status st = c->extend(b, 6 + 32);  // needs 2 pages, 1 free
  ASSERT_EQ(st.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(st.message().find("needs 2 pages (1 of 4 free)"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("more memory"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("fewer tokens"), std::string::npos) << st.message();
  EXPECT_EQ(c->seq_len(b), 10);
  EXPECT_TRUE(c->block_table(b).empty());
  EXPECT_EQ(c->pool().num_free(), free_before);
  EXPECT_EQ(c->sink_pool().num_free(), sink_free_before);
  // The sink pool runs out too: a third sequence finds no sink page.
  const SeqId d = c->add_sequence().value();
  st = c->extend(d, 1);
  ASSERT_EQ(st.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(st.message().find("1 sink pages (0 of 2 free)"), std::string::npos) << st.message();
  EXPECT_EQ(c->seq_len(d), 0);
  ASSERT_TRUE(c->extend(b, 6 + 16).is_ok());  // exactly fits
  EXPECT_EQ(c->pool().num_free(), 0);
  for (SeqId s : {a, b, d}) ASSERT_TRUE(c->free_sequence(s).is_ok());
  EXPECT_EQ(c->pool().num_free(), 4);
  EXPECT_EQ(c->sink_pool().num_free(), 2);
}

// A system prompt kept in the sink is shared by forks; each fork then diverges on its own pages.
TEST(Fork, SharesASinkPromptAndDiverges) {
  const int dim = 16, heads = 2, layers = 2;
  const CacheConfig cfg = make_config(Format::kInt8, kBlock, 16, layers, heads, dim, 16, 12, 0);
  auto c = make(cfg);
  Shadow shadow(cfg);
  std::mt19937 rng(21);
  const SeqId sys = c->add_sequence(48).value();  // 40-token prompt in a 48-token sink
  shadow.add(sys, 48);
  auto append = [&](SeqId s, int n) {
    ASSERT_TRUE(c->extend(s, n).is_ok());
    shadow.extend(s, n);
    for (int l = 0; l < layers; ++l) {
      const auto k = random_rows(rng, n, heads, dim), v = random_rows(rng, n, heads, dim);
      const int p = c->written(s, l);
      ASSERT_TRUE(c->write(s, l, p, k.data(), v.data(), n).is_ok());
      shadow.write(s, l, p, k.data(), v.data(), n);
    }
  };
  append(sys, 40);
  const SeqId a = c->fork(sys).value(), b = c->fork(sys).value();
  shadow.fork(sys, a);
  shadow.fork(sys, b);
  const auto& st = c->sink_table(sys);
  ASSERT_EQ(st.size(), 3u);
  EXPECT_EQ(c->sink_pool().refcount(st[0]), 3);  // full sink pages: shared
  EXPECT_EQ(c->sink_pool().refcount(st[1]), 3);
  EXPECT_EQ(c->sink_pool().refcount(st[2]), 1);  // partial and still growing: copied
  EXPECT_NE(c->sink_table(a)[2], st[2]);
  EXPECT_NE(c->sink_table(b)[2], c->sink_table(a)[2]);
  EXPECT_EQ(c->sink_table(a)[0], st[0]);
  EXPECT_EQ(c->sink_capacity(a), 48);
  append(a, 20);  // fills a's sink, then 12 quantized tokens
  append(b, 3);
  append(sys, 1);
  for (SeqId s : {sys, a, b}) EXPECT_TRUE(shadow.check(*c, s));
  EXPECT_EQ(c->sink_len(a), 48);
  EXPECT_EQ(c->block_table(a).size(), 1u);
  EXPECT_TRUE(c->block_table(b).empty());
  // A fork of a full-sink sequence shares the whole sink and copies the partial main page.
  const SeqId a2 = c->fork(a).value();
  shadow.fork(a, a2);
  EXPECT_EQ(c->sink_pool().refcount(c->sink_table(a)[2]), 2);
  EXPECT_NE(c->block_table(a2)[0], c->block_table(a)[0]);
  append(a2, 7);
  append(a, 2);
  for (SeqId s : {sys, a, b, a2}) EXPECT_TRUE(shadow.check(*c, s));
  EXPECT_EQ(c->stats().requantized_page_heads, shadow.requantized);
  for (SeqId s : {a, sys, a2, b}) ASSERT_TRUE(c->free_sequence(s).is_ok());
  EXPECT_EQ(c->pool().num_free(), 16);
  EXPECT_EQ(c->sink_pool().num_free(), 12);
}

// Pages full of *reserved* slots are shared by fork; the first write into one copies it.
TEST(Fork, WriteIntoASharedPageCopiesItFirst) {
  const int dim = 8, heads = 1;
  const CacheConfig cfg = make_config(Format::kFp8E4m3, kToken, 16, 1, heads, dim, 6, 0, 0);
  auto c = make(cfg);
  Shadow shadow(cfg);
  std::mt19937 rng(3);
  const SeqId p = c->add_sequence().value();
  shadow.add(p, 0);
  ASSERT_TRUE(c->extend(p, 32).is_ok());
  shadow.extend(p, 32);
  auto k = random_rows(rng, 26, heads, dim), v = random_rows(rng, 26, heads, dim);
  ASSERT_TRUE(c->write(p, 0, 0, k.data(), v.data(), 26).is_ok());
  shadow.write(p, 0, 0, k.data(), v.data(), 26);
  const SeqId q = c->fork(p).value();
  shadow.fork(p, q);
  EXPECT_EQ(c->block_table(q), c->block_table(p));  // both pages full (by reservation): shared
  EXPECT_EQ(c->pool().refcount(c->block_table(p)[1]), 2);
  EXPECT_EQ(c->pool().num_free(), 4);
  k = random_rows(rng, 6, heads, dim);
  v = random_rows(rng, 6, heads, dim);
  ASSERT_TRUE(c->write(p, 0, 26, k.data(), v.data(), 6).is_ok());
  shadow.write(p, 0, 26, k.data(), v.data(), 6);
  EXPECT_NE(c->block_table(p)[1], c->block_table(q)[1]);
  EXPECT_EQ(c->block_table(p)[0], c->block_table(q)[0]);
  EXPECT_EQ(c->pool().refcount(c->block_table(q)[1]), 1);
  k = random_rows(rng, 6, heads, dim);
  ASSERT_TRUE(c->write(q, 0, 26, k.data(), v.data(), 6).is_ok());  // private now: in place
  shadow.write(q, 0, 26, k.data(), v.data(), 6);
  // Rewriting a token of the shared first page copies that page too.
  k = random_rows(rng, 1, heads, dim);
  ASSERT_TRUE(c->write(q, 0, 5, k.data(), v.data(), 1).is_ok());
  shadow.write(q, 0, 5, k.data(), v.data(), 1);
  EXPECT_NE(c->block_table(p)[0], c->block_table(q)[0]);
  EXPECT_EQ(c->pool().num_free(), 2);
  EXPECT_TRUE(shadow.check(*c, p));
  EXPECT_TRUE(shadow.check(*c, q));
  // No page left for the next copy: the write fails and changes nothing.
  const SeqId r = c->fork(q).value();
  shadow.fork(q, r);
  const SeqId r2 = c->fork(q).value();
  shadow.fork(q, r2);
  ASSERT_TRUE(c->extend(p, 32).is_ok());
  EXPECT_EQ(c->pool().num_free(), 0);
  Status st = c->write(r, 0, 0, k.data(), v.data(), 1);
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory) << st.to_string();
  EXPECT_TRUE(shadow.check(*c, r));
  EXPECT_EQ(c->fork(q).status().code(), StatusCode::kOk);  // q's pages are full: fork needs no copy
}

// A prompt prefix shared by reference: whole pages only, no copies, the donor and each sharer then
// grow apart on pages of their own, and the pages outlive the donor. Every granularity, random data.
TEST(SharePrefix, SharesWholePagesWithoutCopiesAndOutlivesTheDonor) {
  for (ScaleGranularity g : {kToken, kBlock, ScaleGranularity::kPerTensor}) {
    SCOPED_TRACE(static_cast<int>(g));
    const int dim = 16, heads = 2, layers = 3, bs = 16;
    CacheConfig cfg = make_config(Format::kFp8E4m3, g, bs, layers, heads, dim, 24, 8, 32);
    auto c = make(cfg);
    Shadow shadow(cfg);
    std::mt19937 rng(40 + static_cast<int>(g));
    auto append = [&](SeqId s, int n) {
      ASSERT_TRUE(c->extend(s, n).is_ok());
      shadow.extend(s, n);
      for (int l = 0; l < layers; ++l) {
        const auto k = random_rows(rng, n, heads, dim, -3.f, 3.f), v = random_rows(rng, n, heads, dim, -3.f, 3.f);
        const int p = c->written(s, l);
        ASSERT_TRUE(c->write(s, l, p, k.data(), v.data(), n).is_ok());
        shadow.write(s, l, p, k.data(), v.data(), n);
      }
    };
    const SeqId donor = c->add_sequence().value();
    shadow.add(donor, 32);
    append(donor, 90);  // sink 32 + 58 quantized tokens: pages 16+16+16+10
    const int free_before = c->pool().num_free(), sink_free_before = c->sink_pool().num_free();
    // 80 tokens = the full sink + 3 whole main pages.
    const SeqId a = c->share_prefix(donor, 80).value();
    shadow.share_prefix(donor, a, 80);
    EXPECT_EQ(c->pool().num_free(), free_before) << "sharing allocates nothing";
    EXPECT_EQ(c->sink_pool().num_free(), sink_free_before);
    EXPECT_EQ(c->seq_len(a), 80);
    for (int l = 0; l < layers; ++l) EXPECT_EQ(c->written(a, l), 80);
    ASSERT_EQ(c->block_table(a).size(), 3u);
    for (int b = 0; b < 3; ++b) {
      EXPECT_EQ(c->block_table(a)[size_t(b)], c->block_table(donor)[size_t(b)]);
      EXPECT_EQ(c->pool().refcount(c->block_table(a)[size_t(b)]), 2);
    }
    EXPECT_EQ(c->sink_table(a), c->sink_table(donor));
    // 16 tokens: inside the sink, one whole sink page.
    const SeqId b = c->share_prefix(donor, 16).value();
    shadow.share_prefix(donor, b, 16);
    EXPECT_TRUE(c->block_table(b).empty());
    EXPECT_EQ(c->sink_table(b).size(), 1u);
    EXPECT_EQ(c->sink_pool().refcount(c->sink_table(donor)[0]), 3);
    for (SeqId s : {donor, a, b}) EXPECT_TRUE(shadow.check(*c, s));
    append(a, 21);  // a's own pages from position 80 on
    append(b, 40);  // b's own second sink page, then quantized pages
    append(donor, 7);
    for (SeqId s : {donor, a, b}) EXPECT_TRUE(shadow.check(*c, s));
    EXPECT_NE(c->block_table(a)[3], c->block_table(donor)[3]);
    EXPECT_NE(c->sink_table(b)[1], c->sink_table(donor)[1]);
    ASSERT_TRUE(c->free_sequence(donor).is_ok());
    shadow.free(donor);
    for (SeqId s : {a, b}) EXPECT_TRUE(shadow.check(*c, s)) << "shared pages outlive the donor";
    EXPECT_EQ(c->stats().requantized_page_heads, shadow.requantized);
    ASSERT_TRUE(c->free_sequence(a).is_ok());
    ASSERT_TRUE(c->free_sequence(b).is_ok());
    EXPECT_EQ(c->pool().num_free(), 24);
    EXPECT_EQ(c->sink_pool().num_free(), 8);
  }
}

TEST(SharePrefix, RefusesPartialPagesAndLengthsBeyondTheDonor) {
  const CacheConfig cfg = make_config(Format::kInt8, kToken, 16, 1, 1, 8, 8, 4, 20);
  auto c = make(cfg);
  const SeqId d = c->add_sequence().value();
  ASSERT_TRUE(c->extend(d, 60).is_ok());
  for (int n : {0, -1, 61, 8, 30, 20 + 15}) {
    auto r = c->share_prefix(d, n);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << n;
    EXPECT_FALSE(r.status().message().empty());
  }
  // Sink of 20 (not a multiple of 16): 16 fills one sink page; 20 + 16 fills the sink and one page.
  EXPECT_TRUE(PagedKvCache::prefix_pages_closed(16, 20, 16));
  EXPECT_TRUE(PagedKvCache::prefix_pages_closed(36, 20, 16));
  EXPECT_TRUE(PagedKvCache::prefix_pages_closed(20, 20, 16));
  EXPECT_TRUE(c->share_prefix(d, 36).is_ok());
  EXPECT_EQ(c->share_prefix(12345, 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->pool().num_free(), 8 - 3);
}

TEST(BatchTables, PaddedWithMinusOne) {
  auto c = make(make_config(Format::kInt8, kToken, 16, 1, 1, 8, 16, 4, 16));
  const SeqId a = c->add_sequence().value(), b = c->add_sequence(0).value(), d = c->add_sequence().value();
  ASSERT_TRUE(c->extend(a, 50).is_ok());  // 16 sink + 34 -> 3 pages
  ASSERT_TRUE(c->extend(b, 17).is_ok());  // 2 pages, no sink
  ASSERT_TRUE(c->extend(d, 5).is_ok());   // sink only
  const auto bt = c->batch_tables({b, a, 99, d});
  const BatchTablesView v = bt.view();
  ASSERT_EQ(v.num_seqs, 4);
  EXPECT_EQ(v.max_blocks, 3);
  EXPECT_EQ(v.max_sink_blocks, 1);
  EXPECT_EQ(std::vector<int32_t>(v.seq_lens, v.seq_lens + 4), (std::vector<int32_t>{17, 50, 0, 5}));
  EXPECT_EQ(std::vector<int32_t>(v.sink_lens, v.sink_lens + 4), (std::vector<int32_t>{0, 16, 0, 5}));
  const auto& ta = c->block_table(a);
  const auto& tb = c->block_table(b);
  EXPECT_EQ(std::vector<int32_t>(v.block_tables, v.block_tables + 12),
            (std::vector<int32_t>{tb[0], tb[1], -1, ta[0], ta[1], ta[2], -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(std::vector<int32_t>(v.sink_tables, v.sink_tables + 4),
            (std::vector<int32_t>{-1, c->sink_table(a)[0], -1, c->sink_table(d)[0]}));
  const MemoryReport m = c->memory_report();
  EXPECT_EQ(m.pages_used, 5);
  EXPECT_EQ(m.sink_pages_used, 2);
}

}  // namespace
}  // namespace kvq::cache
