// Randomised invariants of the paged cache against a float64 shadow model, and canary bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <ostream>
#include <random>
#include <set>
#include <vector>

#include "cache/cache_test_util.h"
#include "kvq/cache/paged_cache.h"

namespace kvq::cache {
namespace {

using testing::make_config;
using testing::random_rows;
using testing::Shadow;

constexpr auto kTensor = ScaleGranularity::kPerTensor;
constexpr auto kToken = ScaleGranularity::kPerTokenHead;
constexpr auto kBlock = ScaleGranularity::kPerBlockHead;

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Every page's refcount equals the number of table entries naming it; free pages are exactly
// those with refcount 0.
::testing::AssertionResult refcounts_consistent(const PagedKvCache& c, const std::vector<SeqId>& ids) {
  for (int sink = 0; sink < 2; ++sink) {
    const BlockPool& pool = sink ? c.sink_pool() : c.pool();
    std::vector<int> refs(static_cast<size_t>(pool.num_pages()), 0);
    for (SeqId id : ids) {
      for (int32_t p : sink ? c.sink_table(id) : c.block_table(id)) {
        if (p < 0 || p >= pool.num_pages()) return ::testing::AssertionFailure() << "page id " << p << " out of range";
        ++refs[static_cast<size_t>(p)];
      }
    }
    int free_pages = 0;
    for (int p = 0; p < pool.num_pages(); ++p) {
      if (pool.refcount(p) != refs[static_cast<size_t>(p)]) {
        return ::testing::AssertionFailure() << (sink ? "sink " : "") << "page " << p << " refcount "
                                             << pool.refcount(p) << " but " << refs[static_cast<size_t>(p)]
                                             << " table entries";
      }
      free_pages += refs[static_cast<size_t>(p)] == 0;
    }
    if (free_pages != pool.num_free()) return ::testing::AssertionFailure() << "free count " << pool.num_free() << " vs " << free_pages;
  }
  return ::testing::AssertionSuccess();
}

struct RandomCase {
  Format f;
  ScaleGranularity g;
  int block_size, dim;
  unsigned seed;
  ScaleDtype sd = ScaleDtype::kFp32;
};

void PrintTo(const RandomCase& c, std::ostream* os) {
  *os << "format " << static_cast<int>(c.f) << " " << granularity_name(c.g) << " b" << c.block_size << " d" << c.dim
      << " seed " << c.seed << (c.sd == ScaleDtype::kFp16 ? " fp16 scales" : "");
}

class RandomOps : public ::testing::TestWithParam<RandomCase> {};

// 10^4 random add/extend/write/fork/free operations; reads checked against the shadow after each
// write, pages never leak and exhaustion never changes anything.
TEST_P(RandomOps, ShadowModelAndNoLeaks) {
  const RandomCase rc = GetParam();
  const int layers = 2, heads = 2, pages = 40, sink_pages = 10;
  CacheConfig cfg = make_config(rc.f, rc.g, rc.block_size, layers, heads, rc.dim, pages, sink_pages, 16);
  cfg.spec.scale_dtype = rc.sd;
  auto created = PagedKvCache::create(cfg);
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  PagedKvCache& c = *created.value();
  Shadow shadow(cfg);
  std::mt19937 rng(rc.seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const int bs = rc.block_size;
  int ooms = 0, forks = 0, writes = 0, rewrites = 0;

  for (int step = 0; step < 10000; ++step) {
    const std::vector<SeqId> ids = shadow.ids();
    const int op = pick(100);
    if (ids.empty() || (op < 8 && ids.size() < 12)) {
      const int choice = pick(3);
      const int cap = choice == 0 ? -1 : choice == 1 ? 0 : pick(sink_pages * bs / 3);
      Result<SeqId> id = c.add_sequence(cap);
      ASSERT_TRUE(id.is_ok()) << id.status().to_string();
      ASSERT_FALSE(shadow.has(id.value()));
      shadow.add(id.value(), c.sink_capacity(id.value()));
      continue;
    }
    const SeqId s = ids[static_cast<size_t>(pick(static_cast<int>(ids.size())))];
    if (op < 38) {  // extend
      const int n = pick(10) == 0 ? 1 + pick(80) : 1 + pick(20);
      const int len = c.seq_len(s), cap = c.sink_capacity(s);
      const int need_main = ceil_div(std::max(0, len + n - cap), bs) - static_cast<int>(c.block_table(s).size());
      const int need_sink = ceil_div(std::min(len + n, cap), bs) - static_cast<int>(c.sink_table(s).size());
      const bool fits = need_main <= c.pool().num_free() && need_sink <= c.sink_pool().num_free();
      const auto before_main = c.block_table(s), before_sink = c.sink_table(s);
      const int free_main = c.pool().num_free(), free_sink = c.sink_pool().num_free();
      Status st = c.extend(s, n);
      ASSERT_EQ(st.is_ok(), fits) << st.to_string();
      if (st.is_ok()) {
        shadow.extend(s, n);
      } else {
        ++ooms;
        ASSERT_EQ(st.code(), StatusCode::kOutOfMemory);
        ASSERT_EQ(c.seq_len(s), len);
        ASSERT_EQ(c.block_table(s), before_main);
        ASSERT_EQ(c.sink_table(s), before_sink);
        ASSERT_EQ(c.pool().num_free(), free_main);
        ASSERT_EQ(c.sink_pool().num_free(), free_sink);
        if (pick(2) == 0) {  // make room, as a scheduler would by preempting
          const SeqId victim = ids[static_cast<size_t>(pick(static_cast<int>(ids.size())))];
          ASSERT_TRUE(c.free_sequence(victim).is_ok());
          shadow.free(victim);
        }
      }
    } else if (op < 80) {  // write the next chunk of one layer, or rewrite a recent token
      const int l = pick(layers);
      const int w = c.written(s, l), len = c.seq_len(s);
      int pos0 = w, n = 0;
      if (w > 0 && pick(10) == 0) {
        pos0 = w - 1 - pick(std::min(w, 4));
        n = 1 + pick(std::min(len - pos0, 3));
        ++rewrites;
      } else if (w < len) {
        n = 1 + pick(std::min(len - w, 40));
      }
      if (n == 0) continue;
      const auto k = random_rows(rng, n, heads, rc.dim, -5.f, 5.f, 0.002);
      const auto v = random_rows(rng, n, heads, rc.dim, -5.f, 5.f, 0.002);
      Status st = c.write(s, l, pos0, k.data(), v.data(), n);
      if (!st.is_ok()) {
        ASSERT_EQ(st.code(), StatusCode::kOutOfMemory) << st.to_string();  // only a copy-on-write can fail
        ++ooms;
        ASSERT_TRUE(shadow.check(c, s, l));
        continue;
      }
      ++writes;
      shadow.write(s, l, pos0, k.data(), v.data(), n);
      // Tokens whose page may have been re-quantized: from the first touched page on.
      const int cap = c.sink_capacity(s);
      const int from = pos0 < cap ? pos0 / bs * bs : cap + (pos0 - cap) / bs * bs;
      ASSERT_TRUE(shadow.check(c, s, l, from, pos0 + n)) << "step " << step;
    } else if (op < 90) {  // fork
      const int free_main = c.pool().num_free(), free_sink = c.sink_pool().num_free();
      Result<SeqId> child = c.fork(s);
      if (!child.is_ok()) {
        ASSERT_EQ(child.status().code(), StatusCode::kOutOfMemory) << child.status().to_string();
        ASSERT_EQ(c.pool().num_free(), free_main);
        ASSERT_EQ(c.sink_pool().num_free(), free_sink);
        ++ooms;
        continue;
      }
      ++forks;
      ASSERT_FALSE(shadow.has(child.value()));
      shadow.fork(s, child.value());
      ASSERT_TRUE(shadow.check(c, child.value()));
    } else {
      ASSERT_TRUE(c.free_sequence(s).is_ok());
      shadow.free(s);
    }
    if (step % 50 == 0) {
      ASSERT_TRUE(refcounts_consistent(c, shadow.ids())) << "step " << step;
    }
    if (step % 1000 == 999) {
      for (SeqId id : shadow.ids()) ASSERT_TRUE(shadow.check(c, id)) << "step " << step;
    }
  }
  for (SeqId id : shadow.ids()) ASSERT_TRUE(shadow.check(c, id));
  ASSERT_TRUE(refcounts_consistent(c, shadow.ids()));
  EXPECT_EQ(c.stats().values, shadow.values);
  EXPECT_EQ(c.stats().nonfinite, shadow.nonfinite);
  EXPECT_EQ(c.stats().requantized_page_heads, shadow.requantized);
  if (rc.g == kBlock && is_quantized(rc.f)) {
    EXPECT_GT(shadow.requantized, 100u);
  }
  // The run must have exercised the interesting paths.
  EXPECT_GT(ooms, 20);
  EXPECT_GT(forks, 200);
  EXPECT_GT(writes, 1000);
  EXPECT_GT(rewrites, 50);
  for (SeqId id : shadow.ids()) ASSERT_TRUE(c.free_sequence(id).is_ok());
  EXPECT_EQ(c.pool().num_free(), pages);
  EXPECT_EQ(c.sink_pool().num_free(), sink_pages);
  for (int p = 0; p < pages; ++p) ASSERT_EQ(c.pool().refcount(p), 0);
}

INSTANTIATE_TEST_SUITE_P(Configs, RandomOps,
                         ::testing::Values(RandomCase{Format::kFp8E4m3, kToken, 16, 16, 1},
                                           RandomCase{Format::kInt8, kBlock, 16, 8, 2},
                                           RandomCase{Format::kFp8E4m3Fnuz, kBlock, 32, 16, 3},
                                           RandomCase{Format::kInt8, kTensor, 16, 16, 4},
                                           RandomCase{Format::kBf16, kToken, 32, 8, 5},
                                           RandomCase{Format::kInt4, kToken, 16, 16, 6},
                                           RandomCase{Format::kInt4, kBlock, 32, 8, 7}));

// fp16 scale planes: every quantized format x granularity (the shadow rounds its float64 scale up
// onto the fp16 grid independently of the library).
constexpr auto kHalfScales = ScaleDtype::kFp16;
INSTANTIATE_TEST_SUITE_P(Fp16Scales, RandomOps,
                         ::testing::Values(RandomCase{Format::kFp8E4m3, kToken, 16, 16, 11, kHalfScales},
                                           RandomCase{Format::kFp8E4m3, kBlock, 32, 8, 12, kHalfScales},
                                           RandomCase{Format::kFp8E4m3, kTensor, 16, 8, 13, kHalfScales},
                                           RandomCase{Format::kFp8E4m3Fnuz, kToken, 32, 8, 14, kHalfScales},
                                           RandomCase{Format::kFp8E4m3Fnuz, kBlock, 16, 16, 15, kHalfScales},
                                           RandomCase{Format::kFp8E4m3Fnuz, kTensor, 16, 8, 16, kHalfScales},
                                           RandomCase{Format::kInt8, kToken, 16, 8, 17, kHalfScales},
                                           RandomCase{Format::kInt8, kBlock, 16, 16, 18, kHalfScales},
                                           RandomCase{Format::kInt8, kTensor, 32, 8, 19, kHalfScales}));

// Canary scales, NaN in either dtype: would poison any read that used them. Written one scale
// element at a time, so a page copy (which moves whole elements) keeps the pattern.
constexpr uint32_t kScaleBits = 0x7FA5A5A5u;
constexpr uint16_t kHalfScaleBits = 0x7EA5u;

void fill_scale_pattern(void* plane, size_t bytes, size_t width) {
  for (size_t i = 0; i < bytes / width; ++i)
    std::memcpy(static_cast<uint8_t*>(plane) + i * width, width == 2 ? static_cast<const void*>(&kHalfScaleBits) : &kScaleBits, width);
}

bool scale_is_pattern(const void* plane, size_t idx, size_t width) {
  const void* want = width == 2 ? static_cast<const void*>(&kHalfScaleBits) : &kScaleBits;
  return std::memcmp(static_cast<const uint8_t*>(plane) + idx * width, want, width) == 0;
}

// Fill every plane with a pattern, run operations (no frees, so no page is ever reused), then
// every byte that no live sequence has written must still hold the pattern.
TEST(Canary, BytesOutsideWrittenSlotsAreUntouched) {
  struct Case {
    Format f;
    ScaleGranularity g;
    ScaleDtype sd;
  };
  for (auto [f, g, sd] : {Case{Format::kFp8E4m3, kToken, ScaleDtype::kFp32}, {Format::kInt8, kBlock, ScaleDtype::kFp32},
                          {Format::kFp8E4m3Fnuz, kTensor, ScaleDtype::kFp32}, {Format::kBf16, kToken, ScaleDtype::kFp32},
                          {Format::kInt8, kToken, ScaleDtype::kFp16}, {Format::kFp8E4m3, kBlock, ScaleDtype::kFp16},
                          {Format::kInt8, kTensor, ScaleDtype::kFp16},
                          {Format::kInt4, kToken, ScaleDtype::kFp32}, {Format::kInt4, kBlock, ScaleDtype::kFp32},
                          {Format::kInt4, kToken, ScaleDtype::kFp16}}) {
    const int layers = 2, heads = 3, dim = 16, bs = 16, pages = 24, sink_pages = 8;
    CacheConfig cfg = make_config(f, g, bs, layers, heads, dim, pages, sink_pages, 16);
    cfg.spec.scale_dtype = sd;
    SCOPED_TRACE(cfg.spec.to_string());
    auto created = PagedKvCache::create(cfg);
    ASSERT_TRUE(created.is_ok());
    PagedKvCache& c = *created.value();
    const CacheGeometry& geo = c.geometry();
    constexpr uint8_t kCode = 0x5A;
    constexpr uint16_t kSink = 0xA5C3;
    for (int l = 0; l < layers; ++l) {
      LayerView v = c.layer_view(l);
      std::memset(v.k_codes, kCode, geo.code_plane_bytes());
      std::memset(v.v_codes, kCode, geo.code_plane_bytes());
      for (size_t i = 0; i < geo.sink_plane_bytes() / 2; ++i) v.k_sink[i] = v.v_sink[i] = kSink;
      if (geo.has_scales()) {
        fill_scale_pattern(v.k_scales, geo.scale_plane_bytes(), geo.scale_bytes());
        fill_scale_pattern(v.v_scales, geo.scale_plane_bytes(), geo.scale_bytes());
      }
    }
    std::mt19937 rng(77);
    std::vector<SeqId> seqs;
    auto write_next = [&](SeqId s, int l, int n) {
      const auto k = random_rows(rng, n, heads, dim), v = random_rows(rng, n, heads, dim);
      ASSERT_TRUE(c.write(s, l, c.written(s, l), k.data(), v.data(), n).is_ok());
    };
    for (int i = 0; i < 4; ++i) seqs.push_back(c.add_sequence(i == 3 ? 0 : -1).value());
    ASSERT_TRUE(c.extend(seqs[0], 45).is_ok());
    write_next(seqs[0], 0, 45);
    write_next(seqs[0], 1, 30);  // layer 1 lags: its slots 30..44 stay pattern
    ASSERT_TRUE(c.extend(seqs[1], 16).is_ok());
    write_next(seqs[1], 1, 9);  // layer 0 of seqs[1] untouched
    ASSERT_TRUE(c.extend(seqs[3], 20).is_ok());
    write_next(seqs[3], 0, 20);
    write_next(seqs[3], 1, 20);
    seqs.push_back(c.fork(seqs[0]).value());  // copies the partial page with its pattern tail
    ASSERT_TRUE(c.extend(seqs.back(), 3).is_ok());
    write_next(seqs.back(), 0, 3);
    seqs.push_back(c.fork(seqs[3]).value());
    ASSERT_TRUE(c.write(seqs.back(), 0, 2, random_rows(rng, 1, heads, dim).data(), random_rows(rng, 1, heads, dim).data(), 1).is_ok());
    ASSERT_TRUE(c.extend(seqs[2], 5).is_ok());  // reserved, never written

    for (int l = 0; l < layers; ++l) {
      std::set<std::pair<int, int>> main_written, sink_written;  // (page, slot)
      for (SeqId s : seqs) {
        const int cap = c.sink_capacity(s);
        for (int t = 0; t < c.written(s, l); ++t) {
          if (t < cap) {
            sink_written.insert({c.sink_table(s)[static_cast<size_t>(t / bs)], t % bs});
          } else {
            main_written.insert({c.block_table(s)[static_cast<size_t>((t - cap) / bs)], (t - cap) % bs});
          }
        }
      }
      ASSERT_FALSE(main_written.empty());
      const auto& p = c.planes(l);
      for (int page = 0; page < pages; ++page) {
        bool page_written = false;
        for (int slot = 0; slot < bs; ++slot) page_written |= main_written.count({page, slot}) > 0;
        for (int h = 0; h < heads; ++h) {
          if (g == kBlock && is_quantized(f) && !page_written) {
            ASSERT_TRUE(scale_is_pattern(p.k_scales.data(), geo.scale_index(page, h, 0), geo.scale_bytes()))
                << "layer " << l << " page " << page << " head " << h;
            ASSERT_TRUE(scale_is_pattern(p.v_scales.data(), geo.scale_index(page, h, 0), geo.scale_bytes()));
          }
          for (int slot = 0; slot < bs; ++slot) {
            if (main_written.count({page, slot})) continue;
            const size_t off = geo.code_offset(page, h, slot);
            for (size_t b = 0; b < geo.row_code_bytes(); ++b) {
              ASSERT_EQ(p.k_codes[off + b], kCode) << "layer " << l << " page " << page << " head " << h << " slot " << slot;
              ASSERT_EQ(p.v_codes[off + b], kCode);
            }
            if (g == kToken && is_quantized(f)) {
              ASSERT_TRUE(scale_is_pattern(p.k_scales.data(), geo.scale_index(page, h, slot), geo.scale_bytes()));
            }
          }
        }
      }
      for (size_t b = geo.bytes_per_page() * pages; b < p.k_codes.size(); ++b) ASSERT_EQ(p.k_codes[b], kCode);
      const size_t scales_used = g == kTensor ? 1 : geo.scales_per_page() * pages;
      for (size_t i = scales_used; i < p.k_scales.size() * 4 / geo.scale_bytes(); ++i) {
        ASSERT_TRUE(scale_is_pattern(p.k_scales.data(), i, geo.scale_bytes())) << "scale padding " << i;
      }
      for (int page = 0; page < sink_pages; ++page) {
        for (int h = 0; h < heads; ++h) {
          for (int slot = 0; slot < bs; ++slot) {
            if (sink_written.count({page, slot})) continue;
            const size_t off = geo.elem_index(page, h, slot);
            for (int i = 0; i < dim; ++i) {
              ASSERT_EQ(p.k_sink[off + i], kSink) << "sink page " << page;
              ASSERT_EQ(p.v_sink[off + i], kSink);
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvq::cache
