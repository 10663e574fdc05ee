// int4_outlier in the host cache: every value read back is either within half an int4 step of its
// row's scale or a kept outlier exact to fp16; the planes hold exactly the counted entries. Pages
// are shuffled, rewritten after a truncation and forked; overflow is counted.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cache/cache_test_util.h"
#include "kvq/format/bf16.h"

namespace kvq::cache {
namespace {

using testing::make_config;

// Rows with rare spikes (2% of values at 10-60x) on top of channel-dependent magnitudes.
std::vector<float> spiky_rows(std::mt19937& rng, int n, int heads, int dim) {
  std::normal_distribution<float> z(0.f, 1.f);
  std::uniform_real_distribution<float> spike(10.f, 60.f);
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<float> x(static_cast<size_t>(n) * heads * dim);
  for (size_t r = 0; r < x.size(); ++r) {
    const int ch = static_cast<int>(r % dim);
    x[r] = z(rng) * (ch % 8 == 1 ? 4.f : 1.f) * (pick(rng) < 2 ? spike(rng) : 1.f);
  }
  return x;
}

CacheConfig outlier_config(int layers, int heads, int dim, int pages) {
  CacheConfig c = make_config(Format::kInt4, ScaleGranularity::kPerTokenHead, 16, layers, heads, dim, pages, 2, 16);
  c.spec.outliers = true;
  return c;
}

struct Tally {
  uint64_t inliers = 0, kept = 0, clipped = 0;
};

// Classifies every read-back value of tokens [from, to) of `s` against the rows written.
void classify(const PagedKvCache& c, SeqId s, int layer, int from, int to, const std::vector<float>& k_in,
              const std::vector<float>& v_in, Tally* tally) {
  const CacheGeometry& g = c.geometry();
  const int heads = g.num_kv_heads, d = g.head_dim, bs = g.block_size;
  std::vector<float> k(static_cast<size_t>(heads) * d), v(k.size());
  for (int t = from; t < to; ++t) {
    ASSERT_TRUE(c.read_token(s, layer, t, k.data(), v.data()).is_ok());
    if (t < c.sink_capacity(s)) continue;
    const int u = t - c.sink_capacity(s);
    const int page = c.block_table(s)[static_cast<size_t>(u / bs)], slot = u % bs;
    for (int kv = 0; kv < 2; ++kv) {
      const auto& in = kv == 0 ? k_in : v_in;
      const auto& got = kv == 0 ? k : v;
      const auto& scales = kv == 0 ? c.planes(layer).k_scales : c.planes(layer).v_scales;
      for (int h = 0; h < heads; ++h) {
        const double s_row = scales[g.scale_index(page, h, slot)];
        for (int i = 0; i < d; ++i) {
          const double x = in[(static_cast<size_t>(t) * heads + h) * d + i], y = got[static_cast<size_t>(h) * d + i];
          if (std::fabs(y - x) <= 0.5 * s_row * (1 + 1e-6)) {
            ++tally->inliers;
          } else if (y == double(format::fp16_to_float(format::float_to_fp16(float(x))))) {
            ++tally->kept;
          } else {
            ASSERT_NEAR(std::fabs(y), 7 * s_row, 7 * s_row * 1e-6) << "neither inlier nor kept: must be clipped";
            ++tally->clipped;
          }
        }
      }
    }
  }
}

TEST(Int4OutlierCache, ReadBackIsInlierKeptOrCountedClip) {
  const int layers = 2, heads = 2, dim = 32;
  auto created = PagedKvCache::create(outlier_config(layers, heads, dim, 16));
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  PagedKvCache& c = *created.value();
  ASSERT_EQ(c.geometry().outlier_capacity, 16);
  std::mt19937 rng(5);
  std::vector<SeqId> seqs = {c.add_sequence().value(), c.add_sequence().value()};
  std::vector<std::vector<float>> k_in(2), v_in(2);
  auto grow = [&](int i, int n) {
    const SeqId s = seqs[static_cast<size_t>(i)];
    ASSERT_TRUE(c.extend(s, n).is_ok());
    const auto k = spiky_rows(rng, n, heads, dim), v = spiky_rows(rng, n, heads, dim);
    for (int l = 0; l < layers; ++l) ASSERT_TRUE(c.write(s, l, c.written(s, l), k.data(), v.data(), n).is_ok());
    k_in[static_cast<size_t>(i)].insert(k_in[static_cast<size_t>(i)].end(), k.begin(), k.end());
    v_in[static_cast<size_t>(i)].insert(v_in[static_cast<size_t>(i)].end(), v.begin(), v.end());
  };
  grow(0, 40), grow(1, 23), grow(0, 1), grow(1, 30), grow(0, 25);
  for (int i = 0; i < 9; ++i) grow(i % 2, 1);  // decode-style single tokens

  Tally t;
  for (int i = 0; i < 2; ++i)
    for (int l = 0; l < layers; ++l)
      ASSERT_NO_FATAL_FAILURE(classify(c, seqs[static_cast<size_t>(i)], l, 0, c.seq_len(seqs[static_cast<size_t>(i)]),
                                       k_in[static_cast<size_t>(i)], v_in[static_cast<size_t>(i)], &t));
  const quant::QuantStats& st = c.stats();
  std::printf("values %llu: inliers %llu, kept %llu, clipped %llu; stats outliers %llu overflow %llu\n",
              (unsigned long long)st.values, (unsigned long long)t.inliers, (unsigned long long)t.kept,
              (unsigned long long)t.clipped, (unsigned long long)st.outliers, (unsigned long long)st.outlier_overflow);
  EXPECT_GT(st.outliers, 50u) << "spikes should become sparse entries";
  EXPECT_LE(t.kept, st.outliers);
  EXPECT_EQ(t.clipped, 0u) << "nothing is clipped: a row's scale covers every value that is not an entry";
  EXPECT_EQ(st.nonfinite, 0u);
  // Nothing was rewritten yet: the planes hold exactly the counted entries, each decoding to its
  // input in fp16.
  uint64_t in_planes = 0;
  const CacheGeometry& g = c.geometry();
  for (int l = 0; l < layers; ++l)
    for (int i = 0; i < 2; ++i)
      for (size_t b = 0; b < c.block_table(seqs[size_t(i)]).size(); ++b)
        for (int h = 0; h < heads; ++h) {
          const int page = c.block_table(seqs[size_t(i)])[b];
          const uint32_t* plane = c.planes(l).k_outliers.data() + g.outlier_index(page, h);
          in_planes += plane[0] + c.planes(l).v_outliers[g.outlier_index(page, h)];
          for (uint32_t j = 0; j < plane[0]; ++j) {
            const quant::OutlierEntry e = quant::unpack_outlier(plane[1 + j]);
            const int t_pos = 16 + int(b) * 16 + e.index / dim;
            const float x = k_in[size_t(i)][(size_t(t_pos) * heads + h) * dim + e.index % dim];
            ASSERT_EQ(e.value, format::float_to_fp16(x));
          }
        }
  EXPECT_EQ(in_planes, st.outliers);

  // Truncate to whole pages and write again: the dropped slots' entries must go, new ones come.
  const SeqId s = seqs[0];
  const uint64_t before = st.outliers;
  ASSERT_TRUE(c.truncate(s, 16 + 32).is_ok());  // sink 16 + two main pages
  k_in[0].resize(static_cast<size_t>(48) * heads * dim), v_in[0].resize(k_in[0].size());
  grow(0, 20);
  EXPECT_GT(c.stats().outliers, before);
  Tally t2;
  for (int l = 0; l < layers; ++l)
    ASSERT_NO_FATAL_FAILURE(classify(c, s, l, 0, c.seq_len(s), k_in[0], v_in[0], &t2));

  // A fork copies the partial page with its entries; both read the same.
  const SeqId child = c.fork(s).value();
  std::vector<float> a(static_cast<size_t>(heads) * dim), b(a.size()), a2(a.size()), b2(a.size());
  for (int pos = 0; pos < c.seq_len(s); ++pos) {
    ASSERT_TRUE(c.read_token(s, 1, pos, a.data(), b.data()).is_ok());
    ASSERT_TRUE(c.read_token(child, 1, pos, a2.data(), b2.data()).is_ok());
    ASSERT_EQ(a, a2);
    ASSERT_EQ(b, b2);
  }
}

TEST(Int4OutlierCache, OverflowIsCountedNotSilent) {
  // Two pages of small values warm the statistics up; in the third, token j spikes channels j
  // (+50) and j + 8 (-60): two candidates per token, a fair share of one entry per token (16 for
  // 16 slots). The -60 is kept, the +50 overflows and stays an ordinary int4 value.
  const int heads = 1, dim = 16;
  auto c = PagedKvCache::create(outlier_config(1, heads, dim, 4)).value();
  const SeqId s = c->add_sequence(0).value();
  ASSERT_TRUE(c->extend(s, 48).is_ok());
  std::vector<float> k(static_cast<size_t>(48) * dim), v(k.size());
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  ASSERT_TRUE(c->write(s, 0, 0, k.data(), v.data(), 32).is_ok());
  EXPECT_EQ(c->stats().outliers, 0u) << "|x| <= 1 never exceeds 4x the RMS (>= 0.3)";
  for (int j = 0; j < 16; ++j) {
    k[static_cast<size_t>(32 + j) * dim + j % 16] = 50.f;
    k[static_cast<size_t>(32 + j) * dim + (j + 8) % 16] = -60.f;
  }
  ASSERT_TRUE(c->write(s, 0, 32, k.data() + 32 * dim, v.data() + 32 * dim, 16).is_ok());
  EXPECT_EQ(c->stats().outliers, 16u);
  EXPECT_EQ(c->stats().outlier_overflow, 16u);
  EXPECT_EQ(c->stats().saturated, 0u);
  std::vector<float> rk(dim), rv(dim);
  for (int j : {0, 8}) {
    ASSERT_TRUE(c->read_token(s, 0, 32 + j, rk.data(), rv.data()).is_ok());
    EXPECT_EQ(rk[(j + 8) % 16], -60.f) << "kept exactly";
    EXPECT_NEAR(rk[j % 16], 50.f, 0.5f * 50.f / 7) << "an ordinary value at the scale it sets";
  }
}

TEST(Int4OutlierCache, SpecAndBytes) {
  QuantOptions o;
  o.kv_cache_dtype = "int4_outlier";
  auto spec = parse_quant_spec(o);
  ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
  EXPECT_TRUE(spec->outliers);
  EXPECT_EQ(spec->format, Format::kInt4);
  EXPECT_EQ(spec->to_string(), "int4_outlier/per_token_head/b16/sink256");
  o.granularity = "per_block_head";
  EXPECT_EQ(parse_quant_spec(o).status().code(), StatusCode::kUnsupported);
  // SmolLM2: int4 6480 B/token plus 30 * 2 * 3 heads * (1 + 16) words * 4 bytes / 16 tokens.
  EXPECT_EQ(bytes_per_token(spec.value(), 30, 3, 64), 6480u + 765u);
  CacheConfig bad = outlier_config(1, 1, 16, 2);
  bad.spec.granularity = ScaleGranularity::kPerTensor;
  EXPECT_EQ(PagedKvCache::create(bad).status().code(), StatusCode::kUnsupported);
}

}  // namespace
}  // namespace kvq::cache
