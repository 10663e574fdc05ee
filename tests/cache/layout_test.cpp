// Memory accounting, hand-checked against the arithmetic of DESIGN §4 for real model shapes.
#include "kvq/cache/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "kvq/cache/aligned.h"

namespace kvq::cache {
namespace {

QuantSpec spec(Format f, ScaleGranularity g, int bs = 16) {
  QuantSpec s;
  s.format = f;
  s.granularity = g;
  s.block_size = bs;
  return s;
}

constexpr auto kTensor = ScaleGranularity::kPerTensor;
constexpr auto kToken = ScaleGranularity::kPerTokenHead;
constexpr auto kBlock = ScaleGranularity::kPerBlockHead;

// SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
TEST(BytesPerToken, HeadDim64SmolLM2) {
  // bf16: 30 layers * (K+V) * 3 heads * 64 dims * 2 bytes.
  EXPECT_EQ(bytes_per_token(spec(Format::kBf16, kToken), 30, 3, 64), 23040u);
  EXPECT_EQ(bytes_per_token(spec(Format::kFp16, kBlock), 30, 3, 64), 23040u);
  // fp8 per_token_head: codes 30*2*3*64 = 11520, scales 30*2*3*4 = 720.
  EXPECT_EQ(bytes_per_token(spec(Format::kFp8E4m3, kToken), 30, 3, 64), 12240u);
  EXPECT_EQ(bytes_per_token(spec(Format::kInt8, kToken), 30, 3, 64), 12240u);
  // per_tensor: the per-layer scale is not per token.
  EXPECT_EQ(bytes_per_token(spec(Format::kFp8E4m3Fnuz, kTensor), 30, 3, 64), 11520u);
  // per_block_head, block 16: one page = 30*2*(3*16*64 + 3*4) = 185040 bytes = 11565 per token.
  EXPECT_EQ(bytes_per_page(spec(Format::kInt8, kBlock), 30, 3, 64), 185040u);
  EXPECT_EQ(bytes_per_token(spec(Format::kInt8, kBlock), 30, 3, 64), 11565u);
  // Block 32: 30*2*(3*32*64 + 12) = 369360 per page = 11542.5 per token, reported rounded up.
  EXPECT_EQ(bytes_per_page(spec(Format::kInt8, kBlock, 32), 30, 3, 64), 369360u);
  EXPECT_EQ(bytes_per_token(spec(Format::kInt8, kBlock, 32), 30, 3, 64), 11543u);
  // int4 packs two codes per byte: codes 30*2*3*32 = 5760, scales 720: 0.28x of bf16.
  EXPECT_EQ(bytes_per_token(spec(Format::kInt4, kToken), 30, 3, 64), 6480u);
  EXPECT_EQ(bytes_per_token(spec(Format::kInt4, kTensor), 30, 3, 64), 5760u);
  // per_block_head, block 16: 30*2*(3*16*32 + 3*4) = 92880 per page = 5805 per token.
  EXPECT_EQ(bytes_per_page(spec(Format::kInt4, kBlock), 30, 3, 64), 92880u);
  EXPECT_EQ(bytes_per_token(spec(Format::kInt4, kBlock), 30, 3, 64), 5805u);
}

// Llama-3-8B-like: 32 layers, 8 KV heads, head_dim 128.
TEST(BytesPerToken, HeadDim128Llama) {
  EXPECT_EQ(bytes_per_token(spec(Format::kBf16, kToken), 32, 8, 128), 131072u);
  EXPECT_EQ(bytes_per_token(spec(Format::kFp8E4m3, kToken), 32, 8, 128), 32u * 2 * 8 * (128 + 4));  // 67584
  EXPECT_EQ(bytes_per_token(spec(Format::kFp8E4m3, kTensor), 32, 8, 128), 65536u);
  // int8 per_block_head, block 32: 32*2*(8*32*128 + 8*4) / 32 = 65600 exactly.
  EXPECT_EQ(bytes_per_token(spec(Format::kInt8, kBlock, 32), 32, 8, 128), 65600u);
  EXPECT_EQ(bytes_per_page(spec(Format::kInt8, kBlock, 32), 32, 8, 128), 2099200u);
  // The quantized cache is a bit over half the bf16 one once scales are counted.
  EXPECT_EQ(bytes_per_page(spec(Format::kFp8E4m3, kToken), 32, 8, 128), 67584u * 16);
}

// fp16 scales (DESIGN §3) halve the scale bytes: SmolLM2 per_token_head 11520 + 30*2*3*2 = 11880.
TEST(BytesPerToken, Fp16ScalesHalveTheScaleBytes) {
  QuantSpec s = spec(Format::kFp8E4m3, kToken);
  s.scale_dtype = ScaleDtype::kFp16;
  EXPECT_EQ(bytes_per_token(s, 30, 3, 64), 11880u);
  s.format = Format::kInt8;
  EXPECT_EQ(bytes_per_token(s, 30, 3, 64), 11880u);
  s.granularity = kBlock;  // 30*2*(3*16*64 + 3*2) = 184680 per page
  EXPECT_EQ(bytes_per_page(s, 30, 3, 64), 184680u);
  s.granularity = kTensor;
  EXPECT_EQ(bytes_per_token(s, 30, 3, 64), 11520u);
  s.format = Format::kBf16;  // unscaled storage ignores the scale dtype
  EXPECT_EQ(bytes_per_token(s, 30, 3, 64), 23040u);
  // The geometry's plane: 5 pages * 3 heads * 16 slots * 2 bytes = 480, padded to 512.
  CacheGeometry g;
  g.num_kv_heads = 3, g.head_dim = 64, g.num_pages = 5, g.format = Format::kInt8;
  g.scale_dtype = ScaleDtype::kFp16;
  EXPECT_EQ(g.scale_bytes(), 2u);
  EXPECT_EQ(g.scale_plane_bytes(), 512u);
}

TEST(BytesPerToken, Stories260KHeadDim8) {
  // 5 layers, 4 KV heads, head_dim 8: the scale is a third of each per_token_head row.
  EXPECT_EQ(bytes_per_token(spec(Format::kInt8, kToken), 5, 4, 8), 5u * 2 * 4 * (8 + 4));
  EXPECT_EQ(bytes_per_token(spec(Format::kBf16, kToken), 5, 4, 8), 5u * 2 * 4 * 16);
}

TEST(BytesPerToken, InvalidShapeIsZero) {
  EXPECT_EQ(bytes_per_token(spec(Format::kInt8, kToken), 0, 3, 64), 0u);
  EXPECT_EQ(bytes_per_token(spec(Format::kInt8, kToken), 30, 0, 64), 0u);
  EXPECT_EQ(capacity(1u << 30, spec(Format::kInt8, kToken), 30, 3, 0), 0u);
}

TEST(Capacity, WholePagesOnly) {
  const QuantSpec s = spec(Format::kFp8E4m3, kToken);
  const size_t page = 67584u * 16;  // 1081344 bytes per page, all layers
  EXPECT_EQ(capacity(page * 3, s, 32, 8, 128), 48u);
  EXPECT_EQ(capacity(page * 3 - 1, s, 32, 8, 128), 32u);
  EXPECT_EQ(capacity(page - 1, s, 32, 8, 128), 0u);
  // 1 GiB: floor(1073741824 / 1081344) = 992 pages of 16 tokens.
  EXPECT_EQ(capacity(size_t{1} << 30, s, 32, 8, 128), 15872u);
  // bf16 in the same GiB: 1073741824 / (131072 * 16) = 512 pages.
  EXPECT_EQ(capacity(size_t{1} << 30, spec(Format::kBf16, kToken), 32, 8, 128), 8192u);
}

TEST(Geometry, IndicesAreHeadMajor) {
  CacheGeometry g;
  g.num_layers = 2;
  g.num_kv_heads = 3;
  g.head_dim = 16;
  g.block_size = 16;
  g.num_pages = 5;
  g.format = Format::kInt8;
  g.granularity = kToken;
  EXPECT_EQ(g.elem_index(0, 0, 1), 16u);
  EXPECT_EQ(g.elem_index(0, 1, 0), 256u);
  EXPECT_EQ(g.elem_index(2, 1, 3), (2u * 3 + 1) * 16 * 16 + 3 * 16);
  EXPECT_EQ(g.scale_index(2, 1, 3), (2u * 3 + 1) * 16 + 3);
  EXPECT_EQ(g.code_plane_bytes(), 3840u);  // 5 * 768, already a multiple of 128
  EXPECT_EQ(g.scale_plane_bytes(), 1024u);  // 5 * 48 * 4 = 960 -> 1024
  g.granularity = kBlock;
  EXPECT_EQ(g.scale_index(2, 1, 3), 7u);
  EXPECT_EQ(g.scale_plane_bytes(), 128u);  // 15 floats
  g.granularity = kTensor;
  EXPECT_EQ(g.scale_plane_bytes(), 128u);
  g.format = Format::kBf16;
  EXPECT_EQ(g.scale_plane_bytes(), 0u);
}

// Code addresses are bytes, not elements: 2 per bf16 element, 1 per 8-bit code, 1/2 per int4 code.
TEST(Geometry, CodeOffsetsFollowThePacking) {
  CacheGeometry g;
  g.num_layers = 1, g.num_kv_heads = 3, g.head_dim = 24, g.block_size = 16, g.num_pages = 5;
  g.granularity = kToken;
  const size_t e = g.elem_index(2, 1, 3);
  for (auto [f, num, den] : {std::tuple{Format::kBf16, 2, 1}, {Format::kFp16, 2, 1}, {Format::kFp8E4m3, 1, 1},
                             {Format::kInt8, 1, 1}, {Format::kInt4, 1, 2}}) {
    g.format = f;
    EXPECT_EQ(g.code_offset(2, 1, 3), e * num / den) << format_name(f);
    EXPECT_EQ(g.row_code_bytes(), size_t(24) * num / den) << format_name(f);
    EXPECT_EQ(g.bytes_per_page(), size_t(3 * 16 * 24) * num / den) << format_name(f);
    // Rows of a page head tile are contiguous and never overlap.
    EXPECT_EQ(g.code_offset(2, 1, 4) - g.code_offset(2, 1, 3), g.row_code_bytes()) << format_name(f);
    EXPECT_EQ(g.code_offset(3, 0, 0) - g.code_offset(2, 0, 0), g.bytes_per_page()) << format_name(f);
  }
  g.format = Format::kInt4;
  EXPECT_EQ(g.code_plane_bytes(), 2944u);  // 5 pages * 576 bytes = 2880, padded to 128
}

TEST(AlignedVector, StartsOn128Bytes) {
  for (size_t n : {1u, 3u, 100u, 4097u}) {
    AlignedVector<uint8_t> a(n);
    AlignedVector<float> b(n);
    AlignedVector<uint16_t> c(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 128, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 128, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(c.data()) % 128, 0u);
    a.resize(n * 3);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 128, 0u);
  }
}

// position_slot against the slots laid out one by one: the sink pages in table order, every slot
// of each, then the main pages; shuffled page ids, every sink capacity up to three pages.
TEST(PositionSlot, WalksSinkPagesThenMainPages) {
  std::mt19937 rng(11);
  for (int bs : {16, 32}) {
    for (int cap = 0; cap <= 3 * bs; cap += 7) {
      std::vector<int32_t> ids(64);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      const int sink_pages = (cap + bs - 1) / bs;
      const std::vector<int32_t> sinks(ids.begin(), ids.begin() + sink_pages), mains(ids.begin() + 32, ids.end());
      std::vector<int32_t> want;
      for (int32_t p : sinks)
        for (int k = 0; k < bs && static_cast<int>(want.size()) < cap; ++k) want.push_back(-(p * bs + k) - 1);
      for (int32_t p : mains)
        for (int k = 0; k < bs; ++k) want.push_back(p * bs + k);
      for (int pos = 0; pos < static_cast<int>(want.size()); ++pos) {
        const int32_t got = position_slot(pos, cap, mains.data(), sinks.data(), bs);
        ASSERT_EQ(got, want[static_cast<size_t>(pos)]) << "bs " << bs << " cap " << cap << " pos " << pos;
        EXPECT_EQ(slot_is_sink(got), pos < cap);
      }
    }
  }
}

}  // namespace
}  // namespace kvq::cache
