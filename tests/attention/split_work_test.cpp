// The CUDA decode's split partition (kvq/attention/cuda/split_work.h) on the host: every sink tile
// and every main tile is attended by exactly one split, as the kernels walk them (the register
// kernel tile by tile, the bulk kernel page by page), for every split count, both sink placements,
// page size and length around the page and sink boundaries.
#include "kvq/attention/cuda/split_work.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kc = kvq::attention::cuda;

namespace {

constexpr int kTileTokens = 8;  // the decode kernels' tile

struct Coverage {
  std::vector<int> sink, main;
};

// What the kernels attend for one (sequence, head) with this shape, counted per tile.
Coverage walk(const kc::SplitShape& s) {
  Coverage c{std::vector<int>(s.n_sink_tiles, 0), std::vector<int>(s.n_main_tiles, 0)};
  const int ua = s.unit_align;
  for (int split = 0; split < s.num_splits; ++split) {
    const kc::SplitRange r = kc::split_range(s, split);
    if (r.empty()) continue;  // the kernel stores an empty partial and returns
    for (int t = r.sink_t0; t < r.sink_t1; ++t) ++c.sink.at(t);
    if (ua == 1) {
      for (int t = r.main_t0; t < r.main_t1; ++t) ++c.main.at(t);
      continue;
    }
    // The bulk kernel: pages [first_page, first_page + pages), each page's tiles below main_t1.
    for (int i = 0; i < r.pages(ua); ++i) {
      const int tile0 = (r.first_page(ua) + i) * ua;
      for (int kt = 0; kt < ua && tile0 + kt < r.main_t1; ++kt) ++c.main.at(tile0 + kt);
    }
  }
  return c;
}

TEST(SplitWork, EveryTileAttendedExactlyOnce) {
  int cases = 0;
  for (int splits = 1; splits <= 9; ++splits)
    for (const bool spread : {false, true})
      for (const int ua : {1, 2, 4})  // register kernel; block 16 and 32 in the bulk kernel
        for (const int sink_tokens : {0, 16, 20, 32, 64, 256})
          for (int len = 1; len <= 700; len += len < 160 ? 1 : 37) {
            const int sink = std::min(sink_tokens, len);
            kc::SplitShape s;
            s.n_sink_tiles = (sink + kTileTokens - 1) / kTileTokens;
            s.n_main_tiles = (len - sink + kTileTokens - 1) / kTileTokens;
            s.num_splits = splits, s.spread_sink = spread, s.unit_align = ua;
            const std::string tag = "splits " + std::to_string(splits) + (spread ? " spread" : " first") +
                                    " unit_align " + std::to_string(ua) + " sink " + std::to_string(sink) + " len " +
                                    std::to_string(len);
            const Coverage c = walk(s);
            for (size_t t = 0; t < c.sink.size(); ++t) ASSERT_EQ(c.sink[t], 1) << tag << ": sink tile " << t;
            for (size_t t = 0; t < c.main.size(); ++t) ASSERT_EQ(c.main[t], 1) << tag << ": main tile " << t;
            for (int split = 0; split < splits; ++split) {
              const kc::SplitRange r = kc::split_range(s, split);
              if (r.main_t0 < r.main_t1) {
                ASSERT_EQ(r.main_t0 % ua, 0) << tag << ": split " << split << " starts mid-page";
              }
              // Spread: each split holds its even share of the sink, at most one tile more.
              if (spread) {
                ASSERT_LE(r.sink_t1 - r.sink_t0, (s.n_sink_tiles + splits - 1) / splits) << tag << ": split " << split;
              }
            }
            ++cases;
          }
  EXPECT_GT(cases, 10000);
}

// Spread, every split holds its even share of the sink and its share of all units within a page;
// not spread, the sink fills the first splits in order (the planner's choice for plans of many waves).
TEST(SplitWork, SinkPlacement) {
  kc::SplitShape s;
  s.n_sink_tiles = 32;  // 256 tokens
  s.n_main_tiles = 1024;
  s.num_splits = 6;
  s.unit_align = 2;
  s.spread_sink = true;
  for (int split = 0; split < s.num_splits; ++split) {
    const kc::SplitRange r = kc::split_range(s, split);
    EXPECT_GE(r.sink_t1 - r.sink_t0, 5) << "split " << split;
    EXPECT_LE(r.sink_t1 - r.sink_t0, 6) << "split " << split;
    EXPECT_NEAR(r.sink_t1 - r.sink_t0 + r.main_t1 - r.main_t0, (32 + 1024) / 6.0, 2.0) << "split " << split;
  }
  s.spread_sink = false;
  EXPECT_EQ(kc::split_range(s, 0).sink_t1, 32);
  EXPECT_EQ(kc::split_range(s, 1).sink_t0, 32);
  s.num_splits = 16;  // per_split 66 units: the sink in the first split, the rest main
  EXPECT_EQ(kc::split_range(s, 0).sink_t1, 32);
  EXPECT_EQ(kc::split_range(s, 0).main_t1, 34);
  s.n_main_tiles = 2, s.num_splits = 8;  // per_split 6 (5 rounded to a page): the sink over the first 6 splits in order
  EXPECT_EQ(kc::split_range(s, 1).sink_t0, 6);
  EXPECT_EQ(kc::split_range(s, 5).sink_t1, 32);
  EXPECT_EQ(kc::split_range(s, 5).main_t1, 2);
  EXPECT_TRUE(kc::split_range(s, 6).empty());
}

// The case that a first version of the spread got wrong on the GPU: a split holding only sink tiles
// after a main part that ends mid-page has no page to stream (it had streamed the last page again).
TEST(SplitWork, SinkOnlySplitAfterUnalignedMainHasNoPage) {
  kc::SplitShape s;
  s.n_sink_tiles = 2;  // 16 sink tokens
  s.n_main_tiles = 1;  // 3 main tokens: half a 16-token page
  s.num_splits = 2, s.spread_sink = true, s.unit_align = 2;
  const kc::SplitRange r1 = kc::split_range(s, 1);
  EXPECT_FALSE(r1.empty());
  EXPECT_EQ(r1.sink_t1 - r1.sink_t0, 1);
  EXPECT_EQ(r1.pages(2), 0);
  EXPECT_EQ(kc::split_range(s, 0).pages(2), 1);
}

}  // namespace
