// The bf16 recent window of the paged cache (QuantSpec::recent_tokens): which twins a sequence
// holds after each extend, their contents, and fork / share_prefix / truncate / exhaustion.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cache/cache_test_util.h"
#include "kvq/cache/paged_cache.h"

namespace kvq::cache {
namespace {

using testing::make_config;
using testing::random_rows;

constexpr int kLayers = 2, kHeads = 2, kDim = 16;

CacheConfig window_config(Format f, ScaleGranularity g, int bs, int sink, int recent, int recent_pages) {
  CacheConfig c = make_config(f, g, bs, kLayers, kHeads, kDim, 96, 8, sink);
  c.spec.recent_tokens = recent;
  c.num_recent_pages = recent_pages;
  return c;
}

// A cache of the test's shape with block 16 (null after a failed expectation).
std::unique_ptr<PagedKvCache> window_cache(Format f, ScaleGranularity g, int sink, int recent, int recent_pages) {
  auto made = PagedKvCache::create(window_config(f, g, 16, sink, recent, recent_pages));
  EXPECT_TRUE(made.is_ok()) << made.status().to_string();
  return made.is_ok() ? std::move(made).value() : nullptr;
}

// bf16 bits of one token's K (kv 0) or V (kv 1) row of head h, read from its twin page.
std::vector<uint16_t> twin_row(const PagedKvCache& c, SeqId s, int layer, int kv, int pos, int h) {
  const CacheGeometry& g = c.geometry();
  const int u = pos - c.sink_capacity(s);
  const int32_t page = c.recent_table(s)[static_cast<size_t>(u / g.block_size)];
  const auto& plane = kv == 0 ? c.planes(layer).k_recent : c.planes(layer).v_recent;
  const size_t e = g.elem_index(page, h, u % g.block_size);
  return std::vector<uint16_t>(plane.begin() + static_cast<ptrdiff_t>(e), plane.begin() + static_cast<ptrdiff_t>(e + g.head_dim));
}

struct Seq {
  SeqId id = -1;
  std::vector<float> k, v;  // every token written so far, [len][heads][dim]
};

// Three sequences grow by random chunks in an interleaved order (so their main, sink and recent
// pages interleave in the pools), one is freed and replaced midway. After every write: each main
// token a query of that chunk reads in bf16 has a twin holding exactly bf16(input), the window
// never holds more than recent_pages_per_sequence pages, and the codes are bit for bit those of
// the same operations on a cache without a window.
class RecentWindowRandom : public ::testing::TestWithParam<ScaleGranularity> {};

TEST_P(RecentWindowRandom, TwinsHoldTheWindowAndCodesAreUnchanged) {
  const int bs = 16, sink = 16, R = 40, max_chunk = 23;
  const int per_seq = PagedKvCache::recent_pages_per_sequence(R, max_chunk, bs);
  auto with = PagedKvCache::create(window_config(Format::kFp8E4m3, GetParam(), bs, sink, R, 3 * per_seq));
  auto without = PagedKvCache::create(window_config(Format::kFp8E4m3, GetParam(), bs, sink, 0, 0));
  ASSERT_TRUE(with.is_ok()) << with.status().to_string();
  ASSERT_TRUE(without.is_ok());
  PagedKvCache& a = *with.value();
  PagedKvCache& b = *without.value();
  std::mt19937 rng(7);
  std::vector<Seq> seqs(3);
  auto add = [&](Seq& s) {
    s = Seq{};
    s.id = a.add_sequence().value();
    ASSERT_EQ(b.add_sequence().value(), s.id);
  };
  for (Seq& s : seqs) add(s);
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  for (int step = 0; step < 60; ++step) {
    if (step == 30) {  // free one in the middle: later pages come from a shuffled free list
      ASSERT_TRUE(a.free_sequence(seqs[1].id).is_ok());
      ASSERT_TRUE(b.free_sequence(seqs[1].id).is_ok());
      add(seqs[1]);
    }
    Seq& s = seqs[std::uniform_int_distribution<size_t>(0, 2)(rng)];
    const int len = a.seq_len(s.id);
    const int n = std::uniform_int_distribution<int>(1, max_chunk)(rng);
    ASSERT_TRUE(a.extend(s.id, n).is_ok());
    ASSERT_TRUE(b.extend(s.id, n).is_ok());
    const std::vector<float> k = random_rows(rng, n, kHeads, kDim), v = random_rows(rng, n, kHeads, kDim);
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(a.write(s.id, l, len, k.data(), v.data(), n).is_ok());
      ASSERT_TRUE(b.write(s.id, l, len, k.data(), v.data(), n).is_ok());
    }
    s.k.insert(s.k.end(), k.begin(), k.end());
    s.v.insert(s.v.end(), v.begin(), v.end());
    const int live = static_cast<int>(std::count_if(a.recent_table(s.id).begin(), a.recent_table(s.id).end(),
                                                    [](int32_t p) { return p >= 0; }));
    EXPECT_LE(live, per_seq) << "step " << step;
    ASSERT_EQ(a.recent_table(s.id).size(), a.block_table(s.id).size());
    for (int pos = std::max(len + 1 - R, sink); pos < len + n; ++pos)
      for (int l = 0; l < kLayers; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < kHeads; ++h) {
            const std::vector<uint16_t> got = twin_row(a, s.id, l, kv, pos, h);
            const float* x = (kv == 0 ? s.k : s.v).data() + static_cast<size_t>(pos) * row + static_cast<size_t>(h) * kDim;
            for (int i = 0; i < kDim; ++i)
              ASSERT_EQ(got[static_cast<size_t>(i)], format::float_to_bf16(x[i]))
                  << "step " << step << " pos " << pos << " layer " << l << " kv " << kv << " head " << h;
          }
    for (int pos = 0; pos < len + n; ++pos) {
      std::vector<float> ka(row), va(row), kb(row), vb(row);
      ASSERT_TRUE(a.read_token(s.id, 0, pos, ka.data(), va.data()).is_ok());
      ASSERT_TRUE(b.read_token(s.id, 0, pos, kb.data(), vb.data()).is_ok());
      ASSERT_EQ(0, std::memcmp(ka.data(), kb.data(), row * sizeof(float))) << "pos " << pos;
      ASSERT_EQ(0, std::memcmp(va.data(), vb.data(), row * sizeof(float))) << "pos " << pos;
    }
  }
  EXPECT_GT(a.memory_report().recent_pages_used, 0);
  for (const Seq& s : seqs) ASSERT_TRUE(a.free_sequence(s.id).is_ok());
  EXPECT_EQ(a.recent_pool().num_free(), a.recent_pool().num_pages());
}

INSTANTIATE_TEST_SUITE_P(Granularities, RecentWindowRandom,
                         ::testing::Values(ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead,
                                           ScaleGranularity::kPerTensor));

TEST(RecentWindow, ConfigurationRules) {
  // Too small a pool for one decoding sequence is refused by name.
  auto small = PagedKvCache::create(window_config(Format::kInt8, ScaleGranularity::kPerTokenHead, 16, 0, 64, 2));
  ASSERT_FALSE(small.is_ok());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("recent"), std::string::npos);
  // Unquantized pages are bf16 already: the window is a no-op and allocates nothing.
  auto plain = PagedKvCache::create(window_config(Format::kBf16, ScaleGranularity::kPerTokenHead, 16, 0, 64, 0));
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  EXPECT_EQ(plain.value()->geometry().recent_tokens, 0);
  EXPECT_EQ(plain.value()->memory_report().recent_bytes, 0u);
  // The report counts the window's planes: K and V, every layer, bf16.
  auto c = PagedKvCache::create(window_config(Format::kInt8, ScaleGranularity::kPerTokenHead, 16, 0, 64, 10));
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c.value()->memory_report().recent_bytes, size_t{2} * kLayers * c.value()->geometry().recent_plane_bytes());
  EXPECT_EQ(c.value()->memory_report().recent_bytes, size_t{2} * kLayers * 10 * kHeads * 16 * kDim * 2);
}

// Writes n random tokens at the end of s (all layers).
void grow(PagedKvCache& c, SeqId s, int n, std::mt19937& rng) {
  const int len = c.seq_len(s);
  ASSERT_TRUE(c.extend(s, n).is_ok());
  const std::vector<float> k = random_rows(rng, n, kHeads, kDim), v = random_rows(rng, n, kHeads, kDim);
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(c.write(s, l, len, k.data(), v.data(), n).is_ok());
}

TEST(RecentWindow, ForkCopiesTwinsAndTheyDiverge) {
  const auto made = window_cache(Format::kInt8, ScaleGranularity::kPerTokenHead, 0, 20, 12);
  ASSERT_TRUE(made);
  PagedKvCache& c = *made;
  std::mt19937 rng(3);
  const SeqId p = c.add_sequence().value();
  grow(c, p, 37, rng);
  const SeqId child = c.fork(p).value();
  const auto& pt = c.recent_table(p);
  const auto& ct = c.recent_table(child);
  ASSERT_EQ(pt.size(), ct.size());
  for (size_t b = 0; b < pt.size(); ++b) {
    EXPECT_EQ(pt[b] < 0, ct[b] < 0);
    if (pt[b] >= 0) {
      EXPECT_NE(pt[b], ct[b]) << "twins are private, never shared";
    }
  }
  for (int pos = 37 + 1 - 20; pos < 37; ++pos) EXPECT_EQ(twin_row(c, child, 1, 1, pos, 1), twin_row(c, p, 1, 1, pos, 1));
  const std::vector<uint16_t> before = twin_row(c, p, 0, 0, 36, 0);
  // The child rewrites the parent's last token position in its own copy.
  std::vector<float> k = random_rows(rng, 1, kHeads, kDim), v = random_rows(rng, 1, kHeads, kDim);
  ASSERT_TRUE(c.write(child, 0, 36, k.data(), v.data(), 1).is_ok());
  EXPECT_EQ(twin_row(c, p, 0, 0, 36, 0), before);
  EXPECT_NE(twin_row(c, child, 0, 0, 36, 0), before);
  ASSERT_TRUE(c.free_sequence(p).is_ok());
  ASSERT_TRUE(c.free_sequence(child).is_ok());
  EXPECT_EQ(c.recent_pool().num_free(), 12);
}

// A bookkeeping-only cache (a device backend's) cannot copy twins: fork is refused up front,
// leaving the pools as they were.
TEST(RecentWindow, ForkWithoutHostPlanesIsRefusedUpFront) {
  CacheConfig cfg = window_config(Format::kInt8, ScaleGranularity::kPerTokenHead, 16, 0, 20, 12);
  cfg.host_planes = false;
  auto made = PagedKvCache::create(cfg);
  ASSERT_TRUE(made.is_ok());
  PagedKvCache& c = *made.value();
  const SeqId p = c.add_sequence().value();
  ASSERT_TRUE(c.extend(p, 37).is_ok());
  const int main_free = c.pool().num_free(), recent_free = c.recent_pool().num_free();
  auto child = c.fork(p);
  ASSERT_FALSE(child.is_ok());
  EXPECT_EQ(child.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(c.pool().num_free(), main_free);
  EXPECT_EQ(c.recent_pool().num_free(), recent_free);
}

TEST(RecentWindow, SharePrefixRefusedAndTruncateKeepsOnlyAHeldWindow) {
  const auto made = window_cache(Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 0, 20, 8);
  ASSERT_TRUE(made);
  PagedKvCache& c = *made;
  std::mt19937 rng(5);
  const SeqId s = c.add_sequence().value();
  for (int i = 0; i < 6; ++i) grow(c, s, 16, rng);  // 96 tokens; the last extend kept [61, 96)'s pages
  auto shared = c.share_prefix(s, 32);
  ASSERT_FALSE(shared.is_ok());
  EXPECT_EQ(shared.status().code(), StatusCode::kUnsupported);
  // Keeping 32 tokens would need bf16 twins of [13, 32), released long ago.
  Status cut = c.truncate(s, 32);
  EXPECT_EQ(cut.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.seq_len(s), 96);
  // Keeping 80 needs [61, 80): pages 3 and 4, still held.
  ASSERT_TRUE(c.truncate(s, 80).is_ok());
  EXPECT_EQ(c.recent_table(s).size(), 5u);
  grow(c, s, 1, rng);  // and the sequence goes on
  EXPECT_EQ(c.seq_len(s), 81);
}

TEST(RecentWindow, ExhaustedRecentPoolChangesNothing) {
  const int per_seq = PagedKvCache::recent_pages_per_sequence(20, 16, 16);  // 4
  const auto made = window_cache(Format::kInt8, ScaleGranularity::kPerTokenHead, 0, 20, per_seq);
  ASSERT_TRUE(made);
  PagedKvCache& c = *made;
  std::mt19937 rng(9);
  const SeqId a = c.add_sequence().value();
  for (int i = 0; i < 8; ++i) grow(c, a, 16, rng);  // one sequence runs forever in its window
  EXPECT_LE(c.memory_report().recent_pages_used, per_seq);
  const SeqId b = c.add_sequence().value();
  const int free_main = c.pool().num_free();
  Status st = Status::ok();
  for (int i = 0; i < 4 && st.is_ok(); ++i) st = c.extend(b, 16);
  ASSERT_EQ(st.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(st.message().find("recent"), std::string::npos);
  const int len_b = c.seq_len(b);
  EXPECT_EQ(c.pool().num_free(), free_main - len_b / 16) << "the refused extend allocated nothing";
}

}  // namespace
}  // namespace kvq::cache
