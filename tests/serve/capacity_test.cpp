// Capacity from the geometry, checked against an independent per-token computation, and the
// design's "~6 GB saved at 32k" for the 27B-class model.
#include "kvq/serve/capacity.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kvq::serve {
namespace {

QuantSpec make(Format f, ScaleGranularity g, int sink, int block = 16) {
  QuantSpec s;
  s.format = f;
  s.granularity = g;
  s.sink_tokens = sink;
  s.block_size = block;
  return s;
}

// Independent: bytes of K and V per token per layer per head from the element sizes alone.
double independent_bytes(Format f, ScaleGranularity g, int sink, int block, double tokens) {
  const double L = 46, H = 16, D = 128;
  const double bits = f == Format::kBf16 ? 16 : 8;
  const double sink_tok = std::min<double>(sink, tokens);
  const double main_tok = tokens - sink_tok;
  const double main_pages = std::ceil(main_tok / block), sink_pages = std::ceil(sink_tok / block);
  double per_page = L * 2 * H * block * D * bits / 8;  // codes of one page, all layers, K and V
  if (f != Format::kBf16) {
    if (g == ScaleGranularity::kPerTokenHead) per_page += L * 2 * H * block * 4;  // fp32 per token and head
    if (g == ScaleGranularity::kPerBlockHead) per_page += L * 2 * H * 4;          // fp32 per page and head
  }
  const double sink_page = L * 2 * H * block * D * 2;  // bf16
  return main_pages * per_page + sink_pages * sink_page;
}

TEST(Capacity, MatchesAnIndependentComputation) {
  const KvGeometry g = geometry_27b_class();
  for (int block : {16, 32})
    for (int sink : {0, 256, 1000})
      for (Format f : {Format::kBf16, Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8})
        for (ScaleGranularity gr : {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead})
          for (int64_t tokens : {1, 255, 256, 4097, 32768}) {
            auto kv = sequence_kv(make(f, gr, sink, block), g, tokens);
            ASSERT_TRUE(kv.is_ok()) << kv.status().to_string();
            EXPECT_EQ(static_cast<double>(kv.value().total()), independent_bytes(f, gr, sink, block, double(tokens)))
                << make(f, gr, sink, block).to_string() << " tokens " << tokens;
          }
}

TEST(Capacity, TheDesignsSixGigabytesAt32k) {
  const KvGeometry g = geometry_27b_class();
  std::vector<QuantSpec> specs = {make(Format::kBf16, ScaleGranularity::kPerTokenHead, 256),
                                  make(Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 256),
                                  make(Format::kInt8, ScaleGranularity::kPerBlockHead, 256)};
  auto rows = capacity_table(specs, g, 32768, size_t(40) << 30);
  ASSERT_TRUE(rows.is_ok());
  const auto& r = rows.value();
  // bf16: 46 layers x 2 x 16 heads x 128 x 2 bytes x 32768 tokens = 12.35 GB.
  EXPECT_EQ(r[0].seq.total(), size_t(46) * 2 * 16 * 128 * 2 * 32768);
  for (size_t i = 1; i < r.size(); ++i) {
    EXPECT_GT(r[i].saved_vs_baseline, 5.5e9) << r[i].spec.to_string();
    EXPECT_LT(r[i].saved_vs_baseline, 6.5e9) << r[i].spec.to_string();
    EXPECT_GE(r[i].seqs_vs_baseline, 1.85) << r[i].spec.to_string();
  }
  EXPECT_NE(capacity_markdown(r, g, 32768, size_t(40) << 30).find("| fp8_e4m3/per_token_head/b16/sink256 |"),
            std::string::npos);
}

TEST(Capacity, PlansPoolsFromABudget) {
  const KvGeometry g{"small", 30, 3, 64, 9};
  const QuantSpec s = make(Format::kInt8, ScaleGranularity::kPerTokenHead, 256);
  auto p = plan_kv_pools(s, g, 8, 8192, size_t(1) << 30);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p.value().num_sink_pages, 8 * 16);
  EXPECT_LE(p.value().main_bytes + p.value().sink_bytes, size_t(1) << 30);
  EXPECT_FALSE(plan_kv_pools(s, g, 1000, 8192, size_t(64) << 20).is_ok());  // sinks alone exceed 64 MiB
}

// A recent window reserves bf16 twins for every sequence (one window plus one chunk), counted in
// the budget before the main pages.
TEST(Capacity, RecentWindowIsReservedFromTheBudget) {
  const KvGeometry g{"small", 30, 3, 64, 9};
  QuantSpec s = make(Format::kInt8, ScaleGranularity::kPerTokenHead, 256);
  const auto without = plan_kv_pools(s, g, 8, 8192, size_t(1) << 30, 64);
  s.recent_tokens = 128;
  const auto with = plan_kv_pools(s, g, 8, 8192, size_t(1) << 30, 64);
  ASSERT_TRUE(with.is_ok() && without.is_ok());
  // ceil((127 + 64) / 16) + 1 = 13 pages per sequence.
  EXPECT_EQ(with.value().num_recent_pages, 8 * 13);
  EXPECT_EQ(with.value().recent_bytes, size_t(8 * 13) * 30 * 2 * 3 * 16 * 64 * 2);
  EXPECT_LE(with.value().main_bytes + with.value().sink_bytes + with.value().recent_bytes, size_t(1) << 30);
  EXPECT_LT(with.value().num_pages, without.value().num_pages);
  EXPECT_EQ(without.value().num_recent_pages, 0);
  s.format = Format::kBf16;  // no window for bf16 pages
  EXPECT_EQ(plan_kv_pools(s, g, 8, 8192, size_t(1) << 30, 64).value().num_recent_pages, 0);
}

}  // namespace
}  // namespace kvq::serve
