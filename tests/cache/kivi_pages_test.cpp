// int4_kivi pages of the host cache: each page's codes and fp16 scale / zero-point planes are
// quant/kivi.h's reference quantization of the page's bf16 values, written exactly when the page's
// first token leaves the window of the last query written (layout.h's kivi_page_final), and the
// same whether the tokens arrive in chunks or one by one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cache/cache_test_util.h"
#include "kvq/cache/paged_cache.h"
#include "kvq/quant/kivi.h"

namespace kvq::cache {
namespace {

using testing::random_rows;

constexpr int kLayers = 2, kHeads = 2, kDim = 16;

CacheConfig kivi_config(int bs, int sink, int recent, int recent_pages) {
  CacheConfig c = testing::make_config(Format::kInt4Kivi, ScaleGranularity::kPerTokenHead, bs, kLayers, kHeads, kDim,
                                       96, 8, sink);
  c.spec.scale_dtype = ScaleDtype::kFp16;
  c.spec.recent_tokens = recent;
  c.num_recent_pages = recent_pages;
  return c;
}

float stored_input(float x) { return std::isfinite(x) ? format::bf16_to_float(format::float_to_bf16(x)) : 0.f; }

// Whether main page `block` of `s` in `layer` holds exactly kivi_quantize of its inputs.
::testing::AssertionResult page_matches_reference(const PagedKvCache& c, SeqId s, int layer, int block,
                                                  const std::vector<float>& k_in, const std::vector<float>& v_in) {
  const int bs = c.geometry().block_size, cap = c.sink_capacity(s);
  const int32_t page = c.block_table(s)[static_cast<size_t>(block)];
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  for (int h = 0; h < kHeads; ++h) {
    std::vector<float> k(static_cast<size_t>(bs) * kDim), v(k.size());
    for (int t = 0; t < bs; ++t)
      for (int i = 0; i < kDim; ++i) {
        const size_t src = static_cast<size_t>(cap + block * bs + t) * row + static_cast<size_t>(h) * kDim + i;
        k[static_cast<size_t>(t) * kDim + i] = stored_input(k_in[src]);
        v[static_cast<size_t>(t) * kDim + i] = stored_input(v_in[src]);
      }
    const quant::KiviPageHead want = quant::kivi_quantize(k.data(), v.data(), bs, kDim);
    for (int kv = 0; kv < 2; ++kv) {
      const CacheGeometry g = c.layer_geometry(layer).plane(kv);
      const auto& pl = c.planes(layer);
      const uint8_t* codes = (kv == 0 ? pl.k_codes : pl.v_codes).data();
      const void* params = (kv == 0 ? pl.k_scales : pl.v_scales).data();
      const std::vector<uint8_t>& want_codes = kv == 0 ? want.k_codes : want.v_codes;
      for (int t = 0; t < bs; ++t)
        if (std::memcmp(codes + g.code_offset(page, h, t), want_codes.data() + static_cast<size_t>(t) * kDim / 2, kDim / 2))
          return ::testing::AssertionFailure() << "codes differ: kv " << kv << " head " << h << " slot " << t;
      for (int grp = 0; grp < g.kivi_groups(); ++grp) {
        const float sc = load_scale(params, g.kivi_param_index(page, h, grp, false), g.scale_dtype);
        const float zp = load_scale(params, g.kivi_param_index(page, h, grp, true), g.scale_dtype);
        const float ws = (kv == 0 ? want.k_scale : want.v_scale)[static_cast<size_t>(grp)];
        const float wz = (kv == 0 ? want.k_zero : want.v_zero)[static_cast<size_t>(grp)];
        if (sc != ws || zp != wz)
          return ::testing::AssertionFailure() << "params differ: kv " << kv << " head " << h << " group " << grp
                                               << ": " << sc << "/" << zp << " vs " << ws << "/" << wz;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

struct Seq {
  SeqId chunked = -1, single = -1;
  std::vector<float> k, v;  // every token written so far, [len][heads][dim]
  std::vector<std::pair<int32_t, int32_t>> made;  // kivi_pages_made_final over the writes so far, in order
};

struct Shape {
  int block, sink, recent;
};

class KiviPages : public ::testing::TestWithParam<Shape> {};

// Three sequences grow by random chunks in an interleaved order (their pages interleave in the
// pools; one is freed and replaced midway) in cache `a`, and one token at a time in cache `b`.
// After every chunk: the pages final for the last query match the reference bit for bit, in both
// caches, and every token reads back alike from both; unfinished pages read back as bf16.
TEST_P(KiviPages, FinalPagesMatchReferenceChunkedOrNot) {
  const Shape sh = GetParam();
  const int bs = sh.block, R = sh.recent, max_chunk = 37;
  const int per_seq = PagedKvCache::recent_pages_per_sequence(R, max_chunk, bs);
  auto ma = PagedKvCache::create(kivi_config(bs, sh.sink, R, 3 * per_seq));
  auto mb = PagedKvCache::create(kivi_config(bs, sh.sink, R, 3 * per_seq));
  ASSERT_TRUE(ma.is_ok()) << ma.status().to_string();
  ASSERT_TRUE(mb.is_ok());
  PagedKvCache& a = *ma.value();
  PagedKvCache& b = *mb.value();
  std::mt19937 rng(21 + bs);
  std::vector<Seq> seqs(3);
  auto add = [&](Seq& s) {
    s = Seq{};
    s.chunked = a.add_sequence().value();
    s.single = b.add_sequence().value();
  };
  for (Seq& s : seqs) add(s);
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  int checked_pages = 0;
  for (int step = 0; step < 45; ++step) {
    if (step == 22) {
      ASSERT_TRUE(a.free_sequence(seqs[1].chunked).is_ok());
      ASSERT_TRUE(b.free_sequence(seqs[1].single).is_ok());
      add(seqs[1]);
    }
    Seq& s = seqs[std::uniform_int_distribution<size_t>(0, 2)(rng)];
    const int len = a.seq_len(s.chunked);
    const int n = std::uniform_int_distribution<int>(1, max_chunk)(rng);
    // Channels with their own offsets (what per-channel K grouping is for), a few non-finite values.
    std::vector<float> k = random_rows(rng, n, kHeads, kDim, -2.f, 3.f, 0.002);
    const std::vector<float> v = random_rows(rng, n, kHeads, kDim, -2.f, 3.f, 0.002);
    for (size_t e = 0; e < k.size(); ++e) k[e] += 6.f * static_cast<float>(e % kDim % 5) - 12.f;
    ASSERT_TRUE(a.extend(s.chunked, n).is_ok());
    // What a device backend would quantize for this write, asked before it (the twins are alive then).
    ASSERT_TRUE(a.kivi_pages_made_final(s.chunked, len, n, s.made).is_ok());
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(a.write(s.chunked, l, len, k.data(), v.data(), n).is_ok());
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE(b.extend(s.single, 1).is_ok());
      for (int l = 0; l < kLayers; ++l)
        ASSERT_TRUE(b.write(s.single, l, len + i, k.data() + i * row, v.data() + i * row, 1).is_ok());
    }
    s.k.insert(s.k.end(), k.begin(), k.end());
    s.v.insert(s.v.end(), v.begin(), v.end());
    const int cap = a.sink_capacity(s.chunked), main_written = len + n - cap;
    // The pages reported over all writes are exactly the final ones, in block order, each once.
    int n_final = 0;
    for (int blk = 0; main_written > 0 && blk < static_cast<int>(a.block_table(s.chunked).size()); ++blk)
      n_final += kivi_page_final(blk, bs, main_written, R) ? 1 : 0;
    ASSERT_EQ(static_cast<int>(s.made.size()), n_final) << "step " << step;
    for (size_t i = 0; i < s.made.size(); ++i) ASSERT_EQ(s.made[i].first, a.block_table(s.chunked)[i]) << i;
    for (int blk = 0; main_written > 0 && blk < static_cast<int>(a.block_table(s.chunked).size()); ++blk) {
      if (!kivi_page_final(blk, bs, main_written, R)) continue;
      for (int l = 0; l < kLayers; ++l) {
        ASSERT_TRUE(page_matches_reference(a, s.chunked, l, blk, s.k, s.v)) << "step " << step << " block " << blk;
        ASSERT_TRUE(page_matches_reference(b, s.single, l, blk, s.k, s.v)) << "step " << step << " block " << blk;
      }
      ++checked_pages;
    }
    for (int pos = 0; pos < len + n; ++pos) {
      std::vector<float> ka(row), va(row), kb(row), vb(row);
      ASSERT_TRUE(a.read_token(s.chunked, 1, pos, ka.data(), va.data()).is_ok());
      ASSERT_TRUE(b.read_token(s.single, 1, pos, kb.data(), vb.data()).is_ok());
      ASSERT_EQ(0, std::memcmp(ka.data(), kb.data(), row * sizeof(float))) << "pos " << pos;
      ASSERT_EQ(0, std::memcmp(va.data(), vb.data(), row * sizeof(float))) << "pos " << pos;
      const int u = pos - cap;
      if (u >= 0 && !kivi_page_final(u / bs, bs, main_written, R)) {  // still in the window: its bf16 twin
        for (size_t e = 0; e < row; ++e) ASSERT_EQ(ka[e], stored_input(s.k[static_cast<size_t>(pos) * row + e]));
      }
    }
  }
  EXPECT_GT(checked_pages, 20);
  EXPECT_GT(a.stats().nonfinite, 0u);
  EXPECT_EQ(a.stats().saturated, 0u) << "nothing clips: codes span each group's own range";
  for (const Seq& s : seqs) ASSERT_TRUE(a.free_sequence(s.chunked).is_ok());
  EXPECT_EQ(a.recent_pool().num_free(), a.recent_pool().num_pages());
}

INSTANTIATE_TEST_SUITE_P(Shapes, KiviPages,
                         ::testing::Values(Shape{16, 16, 40}, Shape{32, 0, 32}, Shape{16, 5, 16}, Shape{32, 8, 77}));

// The page count a backend's write uses is kivi_page_final's prefix, for every length and window.
TEST(KiviPagesRules, FinalPageCountIsThePrefixPageFinalMarks) {
  for (int bs : {16, 32})
    for (int R : {bs, bs + 5, 77, 128})
      for (int w = -3; w < 700; ++w) {
        int prefix = 0;
        while (kivi_page_final(prefix, bs, w, R)) ++prefix;
        for (int b = prefix; b < prefix + 3; ++b) ASSERT_FALSE(kivi_page_final(b, bs, w, R));
        ASSERT_EQ(kivi_final_page_count(w, bs, R), prefix) << "bs " << bs << " R " << R << " written " << w;
      }
}

// Extending past a page that a layer has not written in full releases its twin unquantized;
// writing into it afterwards is refused by name, and so is reading it.
TEST(KiviPagesRules, WritesBehindTheWindowAreRefused) {
  auto made = PagedKvCache::create(kivi_config(16, 0, 16, 8));
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  PagedKvCache& c = *made.value();
  std::mt19937 rng(2);
  const SeqId s = c.add_sequence().value();
  ASSERT_TRUE(c.extend(s, 16).is_ok());
  const std::vector<float> k = random_rows(rng, 16, kHeads, kDim), v = random_rows(rng, 16, kHeads, kDim);
  ASSERT_TRUE(c.write(s, 0, 0, k.data(), v.data(), 16).is_ok());  // layer 1 left behind
  ASSERT_TRUE(c.extend(s, 32).is_ok());
  ASSERT_TRUE(c.extend(s, 1).is_ok());  // the next query (position 48) reads [33, 48] in bf16: page 0 leaves
  EXPECT_LT(c.recent_table(s)[0], 0);
  ASSERT_TRUE(page_matches_reference(c, s, 0, 0, k, v)) << "layer 0's page was quantized before its twin left";
  const Status w = c.write(s, 1, 0, k.data(), v.data(), 16);
  EXPECT_EQ(w.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.message().find("recent window"), std::string::npos) << w.message();
  // A device backend asking which pages that write finalizes gets the same refusal.
  std::vector<std::pair<int32_t, int32_t>> pages;
  const Status q = c.kivi_pages_made_final(s, 0, 49, pages);
  EXPECT_EQ(q.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(q.message().find("released"), std::string::npos) << q.message();
  EXPECT_EQ(c.kivi_pages_made_final(12345, 0, 1, pages).code(), StatusCode::kInvalidArgument);
}

TEST(KiviPagesRules, CreateNeedsAWindowOfAPage) {
  auto small = PagedKvCache::create(kivi_config(32, 0, 16, 8));
  ASSERT_FALSE(small.is_ok());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("recent window"), std::string::npos);
}

// The bytes the issue asks for: SmolLM2's shape (30 layers, 3 kv heads, head_dim 64) at block 32
// stores K as 32 code bytes + 2 x 64 fp16 per 32 tokens and V as 32 + 2 fp16 per token-head:
// 76 of bf16's 256 bytes (0.297x); block 16 doubles K's parameter share (84 bytes, 0.328x).
TEST(KiviPagesRules, BytesPerToken) {
  QuantSpec kivi;
  kivi.format = Format::kInt4Kivi;
  kivi.scale_dtype = ScaleDtype::kFp16;
  kivi.block_size = 32;
  QuantSpec bf16;
  bf16.format = Format::kBf16;
  const size_t per_token_head_pair = size_t{30} * 3;
  EXPECT_EQ(bytes_per_token(bf16, 30, 3, 64), per_token_head_pair * 256);
  EXPECT_EQ(bytes_per_token(kivi, 30, 3, 64), per_token_head_pair * 76);
  EXPECT_LE(static_cast<double>(bytes_per_token(kivi, 30, 3, 64)) / bytes_per_token(bf16, 30, 3, 64), 0.30);
  kivi.block_size = 16;
  EXPECT_EQ(bytes_per_token(kivi, 30, 3, 64), per_token_head_pair * 84);
  // The host planes are those sizes too: V's parameter plane is per slot, K's per channel.
  auto made = PagedKvCache::create(kivi_config(32, 0, 32, 4));
  ASSERT_TRUE(made.is_ok());
  const CacheGeometry& g = made.value()->layer_geometry(0);
  EXPECT_EQ(g.plane(0).scales_per_page(), size_t{2} * kHeads * kDim);
  EXPECT_EQ(g.plane(1).scales_per_page(), size_t{2} * kHeads * 32);
}

}  // namespace
}  // namespace kvq::cache
