// The int4 cache's bytes, read straight from the planes: two codes per byte (element 2i in the low
// nibble) at the geometry's packed addresses, against a float64 reference that shares no code
// with the codec (its own nibble arithmetic, its own rounding), over shuffled pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "cache/cache_test_util.h"

namespace kvq::cache {
namespace {

using testing::make_config;
using testing::random_rows;

// A signed nibble, by arithmetic instead of the codec's shifts.
int nibble(uint8_t byte, int which) {
  const int n = which == 0 ? byte % 16 : byte / 16;
  return n >= 8 ? n - 16 : n;
}

TEST(Int4Cache, PackedPlanesMatchAFloat64Reference) {
  constexpr auto kToken = ScaleGranularity::kPerTokenHead;
  const int layers = 2, heads = 3, dim = 40, bs = 16, pages = 12;
  auto created = PagedKvCache::create(make_config(Format::kInt4, kToken, bs, layers, heads, dim, pages, 4, 16));
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  PagedKvCache& c = *created.value();
  const CacheGeometry& g = c.geometry();
  ASSERT_EQ(g.row_code_bytes(), size_t(dim / 2));
  std::mt19937 rng(404);

  // Three sequences growing in turns scatter their pages; a freed one makes the next allocations
  // reuse pages out of order.
  std::vector<SeqId> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(c.add_sequence().value());
  std::vector<std::vector<float>> k_in(3), v_in(3);
  auto grow = [&](int i, int n) {
    ASSERT_TRUE(c.extend(seqs[static_cast<size_t>(i)], n).is_ok());
    const auto k = random_rows(rng, n, heads, dim), v = random_rows(rng, n, heads, dim);
    for (int l = 0; l < layers; ++l) {
      const SeqId s = seqs[static_cast<size_t>(i)];
      ASSERT_TRUE(c.write(s, l, c.written(s, l), k.data(), v.data(), n).is_ok());
    }
    k_in[static_cast<size_t>(i)].insert(k_in[static_cast<size_t>(i)].end(), k.begin(), k.end());
    v_in[static_cast<size_t>(i)].insert(v_in[static_cast<size_t>(i)].end(), v.begin(), v.end());
  };
  grow(0, 20), grow(1, 17), grow(2, 30), grow(0, 9), grow(1, 1);
  ASSERT_TRUE(c.free_sequence(seqs[2]).is_ok());
  seqs[2] = c.add_sequence().value();
  k_in[2].clear(), v_in[2].clear();
  grow(2, 40), grow(0, 14), grow(1, 3);
  bool out_of_order = false;
  for (SeqId s : seqs) {
    const auto& t = c.block_table(s);
    out_of_order |= !std::is_sorted(t.begin(), t.end()) || (t.size() > 1 && t[1] != t[0] + 1);
  }
  EXPECT_TRUE(out_of_order) << "the pages were allocated in order; the test would not catch a wrong address";

  std::set<int> codes_seen;
  for (int l = 0; l < layers; ++l) {
    const auto& p = c.planes(l);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const SeqId s = seqs[i];
      for (int t = c.sink_capacity(s); t < c.seq_len(s); ++t) {
        const int u = t - c.sink_capacity(s);
        const int page = c.block_table(s)[static_cast<size_t>(u / bs)], slot = u % bs;
        for (int h = 0; h < heads; ++h) {
          for (int kv = 0; kv < 2; ++kv) {
            const float* x = (kv == 0 ? k_in : v_in)[i].data() + (static_cast<size_t>(t) * heads + h) * dim;
            double amax = 0;
            for (int e = 0; e < dim; ++e) amax = std::max(amax, std::fabs(static_cast<double>(x[e])));
            const double scale = (kv == 0 ? p.k_scales : p.v_scales)[g.scale_index(page, h, slot)];
            ASSERT_EQ(scale, static_cast<double>(static_cast<float>(amax / 7.0)));
            const uint8_t* row = (kv == 0 ? p.k_codes : p.v_codes).data() + g.code_offset(page, h, slot);
            for (int e = 0; e < dim; ++e) {
              const int q = nibble(row[e / 2], e % 2);
              const double want = x[e] / scale;
              codes_seen.insert(q);
              ASSERT_LE(std::abs(q), 7);
              // Nearest grid point; the float quotient may break a near-tie the other way.
              ASSERT_LE(std::fabs(q - std::clamp(want, -7.0, 7.0)), 0.5 + 1e-5)
                  << "layer " << l << " seq " << i << " token " << t << " head " << h << " elem " << e;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(codes_seen.size(), 15u) << "the data should reach every code -7..7";
}

}  // namespace
}  // namespace kvq::cache
