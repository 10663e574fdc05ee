// A per-layer, per-K/V mix (QuantSpec::plane_formats): every plane must hold exactly what a
// uniform cache of that plane's format holds after the same operations (random data, interleaved
// writes, scrambled block tables), and the memory accounting must follow the planes.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <tuple>

#include "kvq/attention/synthetic.h"
#include "kvq/cache/paged_cache.h"
#include "cache/cache_test_util.h"

namespace kvq::cache {
namespace {

constexpr int kLayers = 4;
// Layer 0: K int8, V fp8; layer 1: K bf16, V int8; layer 2: K fp8_fnuz, V fp8_fnuz; layer 3: K int4
// (packed: its rows sit at other byte offsets than V's), V int8.
const std::vector<Format> kMix = {Format::kInt8, Format::kFp8E4m3, Format::kBf16, Format::kInt8,
                                  Format::kFp8E4m3Fnuz, Format::kFp8E4m3Fnuz, Format::kInt4, Format::kInt8};

attention::SyntheticCacheOptions options(const QuantSpec& spec) {
  attention::SyntheticCacheOptions o;
  o.spec = spec;
  o.num_layers = kLayers;
  o.kv.num_kv_heads = 2;
  o.kv.head_dim = 32;
  o.seq_lens = {1, 17, 40, 95, 160};
  o.seed = 1234;
  o.shuffle = true;
  o.prompt_tokens = 40;
  return o;
}

template <class V>
bool same_bytes(const V& a, const V& b) {
  // Empty planes (a format without scales) have null data(): memcmp must not see them.
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
}

class MixedCache : public ::testing::TestWithParam<std::tuple<ScaleGranularity, ScaleDtype>> {};

TEST_P(MixedCache, EveryPlaneEqualsTheUniformCacheOfItsFormat) {
  QuantSpec mixed;
  mixed.granularity = std::get<0>(GetParam());
  mixed.scale_dtype = std::get<1>(GetParam());
  mixed.sink_tokens = 16;
  mixed.plane_formats = kMix;
  mixed.format = kMix.front();
  auto m = attention::build_synthetic_cache(options(mixed));
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const PagedKvCache& mc = *m.value().cache;

  std::map<Format, attention::SyntheticCache> uniform;
  for (Format f : kMix) {
    if (uniform.count(f)) continue;
    QuantSpec s = mixed;
    s.plane_formats.clear();
    s.format = f;
    auto u = attention::build_synthetic_cache(options(s));
    ASSERT_TRUE(u.is_ok()) << u.status().to_string();
    uniform.emplace(f, std::move(u).value());
  }
  for (const auto& [f, u] : uniform)
    for (size_t i = 0; i < m.value().seqs.size(); ++i) {
      ASSERT_EQ(u.cache->block_table(u.seqs[i]), mc.block_table(m.value().seqs[i]));  // same page placement
      ASSERT_EQ(u.cache->sink_table(u.seqs[i]), mc.sink_table(m.value().seqs[i]));
    }
  bool scrambled = false;
  for (cache::SeqId s : m.value().seqs)
    for (size_t j = 1; j < mc.block_table(s).size(); ++j) scrambled |= mc.block_table(s)[j] != mc.block_table(s)[j - 1] + 1;
  EXPECT_TRUE(scrambled) << "the block tables should not be contiguous";

  for (int l = 0; l < kLayers; ++l) {
    const auto& p = mc.planes(l);
    const auto& kp = uniform.at(kMix[2 * l]).cache->planes(l);
    const auto& vp = uniform.at(kMix[2 * l + 1]).cache->planes(l);
    EXPECT_TRUE(same_bytes(p.k_codes, kp.k_codes)) << "layer " << l << " K codes";
    EXPECT_TRUE(same_bytes(p.k_scales, kp.k_scales)) << "layer " << l << " K scales";
    EXPECT_TRUE(same_bytes(p.v_codes, vp.v_codes)) << "layer " << l << " V codes";
    EXPECT_TRUE(same_bytes(p.v_scales, vp.v_scales)) << "layer " << l << " V scales";
    EXPECT_TRUE(same_bytes(p.k_sink, kp.k_sink) && same_bytes(p.v_sink, vp.v_sink)) << "layer " << l << " sink";
    const CacheGeometry& g = mc.layer_geometry(l);
    EXPECT_EQ(g.plane_format(0), kMix[2 * l]);
    EXPECT_EQ(g.plane_format(1), kMix[2 * l + 1]);
    EXPECT_EQ(g.mixed_kv, kMix[2 * l] != kMix[2 * l + 1]);
    // A plane without scales exposes no scale pointer.
    PagedKvCache& mut = *m.value().cache;
    EXPECT_EQ(mut.layer_view(l).k_scales == nullptr, !is_quantized(kMix[2 * l]));
    EXPECT_EQ(mut.layer_view(l).v_scales == nullptr, !is_quantized(kMix[2 * l + 1]));
  }

  // Read-back of every token equals the uniform caches' read-back of the same plane.
  const int row = 2 * 32;
  std::vector<float> k(row), v(row), uk(row), uv(row), tmp(row);
  for (size_t i = 0; i < m.value().seqs.size(); ++i) {
    const SeqId s = m.value().seqs[i];
    for (int l = 0; l < kLayers; ++l)
      for (int t = 0; t < mc.seq_len(s); ++t) {
        ASSERT_TRUE(mc.read_token(s, l, t, k.data(), v.data()).is_ok());
        const auto& ku = uniform.at(kMix[2 * l]);
        const auto& vu = uniform.at(kMix[2 * l + 1]);
        ASSERT_TRUE(ku.cache->read_token(ku.seqs[i], l, t, uk.data(), tmp.data()).is_ok());
        ASSERT_TRUE(vu.cache->read_token(vu.seqs[i], l, t, tmp.data(), uv.data()).is_ok());
        ASSERT_EQ(0, std::memcmp(k.data(), uk.data(), row * sizeof(float))) << "seq " << i << " layer " << l << " t " << t;
        ASSERT_EQ(0, std::memcmp(v.data(), uv.data(), row * sizeof(float))) << "seq " << i << " layer " << l << " t " << t;
      }
  }

  // Accounting: allocated code + scale bytes per page equal bytes_per_page (up to plane padding).
  const MemoryReport r = mc.memory_report();
  const size_t per_page = bytes_per_page(mixed, kLayers, 2, 32);
  const size_t pages = static_cast<size_t>(mc.pool().num_pages());
  EXPECT_GE(r.code_bytes + r.scale_bytes, per_page * pages);
  EXPECT_LT(r.code_bytes + r.scale_bytes, per_page * pages + 4 * kLayers * kPlaneAlignment);
}

INSTANTIATE_TEST_SUITE_P(GranularitiesAndScaleDtypes, MixedCache,
                         ::testing::Combine(::testing::Values(ScaleGranularity::kPerTokenHead,
                                                              ScaleGranularity::kPerBlockHead,
                                                              ScaleGranularity::kPerTensor),
                                            ::testing::Values(ScaleDtype::kFp32, ScaleDtype::kFp16)));

TEST(MixedCacheConfig, RefusesAWrongLayerCount) {
  CacheConfig c = testing::make_config(Format::kInt8, ScaleGranularity::kPerTokenHead, 16, /*layers=*/2, 1, 16,
                                       /*pages=*/4, 0, 0);
  c.spec.plane_formats = kMix;  // four layers
  auto r = PagedKvCache::create(c);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("4 layers but the model has 2"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace kvq::cache
