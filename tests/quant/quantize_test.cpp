// Reference quantizer against float64 error bounds derived from each format's grid.
//
// For a scaled value y = x / s, round-to-nearest onto the format's grid errs by at most:
//   fp8 E4M3 (3 mantissa bits): half an ulp = 2^-4 * 2^e <= 2^-4 |y| in the normal range; in the
//     subnormal range the spacing is 2^-9 (OCP, bias 7) or 2^-10 (FNUZ, bias 8), so half of it;
//   int8 / int4: 0.5 (unit grid);
//   bf16 (7 stored mantissa bits): 2^-8 |x|; fp16 (10 bits): 2^-11 |x|, subnormal half-step 2^-25.
// Back in x's units the grid error is multiplied by s; the float32 division x / s and the product
// code * s add at most 2^-24 relative each, covered by a 2^-22 slack term.
#include "kvq/quant/quantize.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvq::quant {
namespace {

struct Bound {
  double rel;  // relative to |x|
  double abs;  // in scaled units (times the scale)
};

Bound grid_bound(Format f) {
  switch (f) {
    case Format::kFp8E4m3: return {std::ldexp(1.0, -4), std::ldexp(1.0, -10)};
    case Format::kFp8E4m3Fnuz: return {std::ldexp(1.0, -4), std::ldexp(1.0, -11)};
    case Format::kInt8: case Format::kInt4: case Format::kInt4Kivi: return {0.0, 0.5};
    case Format::kBf16: return {std::ldexp(1.0, -8), std::ldexp(1.0, -134)};
    case Format::kFp16: return {std::ldexp(1.0, -11), std::ldexp(1.0, -25)};
  }
  return {0, 0};
}

double allowed_error(Format f, double x, double scale) {
  const Bound b = grid_bound(f);
  const double s = is_quantized(f) ? scale : 1.0;
  return std::max(b.rel * std::fabs(x), b.abs * s) * (1 + std::ldexp(1.0, -22)) +
         std::ldexp(1.0, -22) * std::fabs(x);
}

// Rows of mixed magnitude: normal values times a log-uniform factor, with a few exact zeros and
// values ~1e-3 of the row's largest, so fp8 subnormals and int rounding near 0 are exercised.
std::vector<float> random_row(std::mt19937& rng, int n) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> expo(-6.f, 6.f);
  std::uniform_int_distribution<int> kind(0, 19);
  const float mag = std::exp2(expo(rng));
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) {
    const int k = kind(rng);
    v = k == 0 ? 0.f : k == 1 ? normal(rng) * mag * 1e-3f : normal(rng) * mag;
  }
  return x;
}

const Format kAllFormats[] = {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8,
                              Format::kInt4,    Format::kBf16,        Format::kFp16};

TEST(FiniteAmax, SkipsAndCountsNonFinite) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {1.f, -7.5f, nan, inf, -inf, 3.f};
  QuantStats st;
  EXPECT_EQ(finite_amax(x.data(), static_cast<int>(x.size()), &st), 7.5f);
  EXPECT_EQ(st.nonfinite, 3u);
  EXPECT_EQ(finite_amax(x.data(), 0), 0.f);
  const std::vector<float> only_bad = {nan, -inf};
  EXPECT_EQ(finite_amax(only_bad.data(), 2), 0.f);
}

TEST(ScaleForAmax, MapsAmaxToQmax) {
  EXPECT_EQ(scale_for_amax(Format::kFp8E4m3, 448.f), 1.f);
  EXPECT_EQ(scale_for_amax(Format::kFp8E4m3Fnuz, 224.f), 1.f);  // the interchange cap, not 240
  EXPECT_EQ(scale_for_amax(Format::kInt8, 127.f * 3.f), 3.f);
  EXPECT_EQ(scale_for_amax(Format::kInt4, 7.f / 8.f), 0.125f);
  EXPECT_EQ(scale_for_amax(Format::kInt8, 0.f), 1.f);
  EXPECT_EQ(scale_for_amax(Format::kBf16, 123.f), 1.f);
  EXPECT_EQ(scale_for_amax(Format::kFp8E4m3, 1e-44f), FLT_MIN);  // never a denormal scale
  EXPECT_EQ(scale_for_amax(Format::kInt8, std::numeric_limits<float>::infinity()), 1.f);
}

TEST(Clips, ThresholdsFollowTheGridAndRounding) {
  // OCP: 448 is the top code, the next grid value would be 480; the tie 464 rounds to even 448.
  EXPECT_FALSE(clips(Format::kFp8E4m3, 464.f));
  EXPECT_TRUE(clips(Format::kFp8E4m3, std::nextafter(464.f, 1e9f)));
  EXPECT_FALSE(clips(Format::kFp8E4m3Fnuz, 232.f));
  EXPECT_TRUE(clips(Format::kFp8E4m3Fnuz, std::nextafter(232.f, 1e9f)));
  EXPECT_FALSE(clips(Format::kInt8, std::nextafter(127.5f, 0.f)));
  EXPECT_TRUE(clips(Format::kInt8, -127.5f));
  EXPECT_FALSE(clips(Format::kInt4, -7.4f));
  EXPECT_TRUE(clips(Format::kInt4, 7.5f));
  EXPECT_FALSE(clips(Format::kFp16, 65519.f));
  EXPECT_TRUE(clips(Format::kFp16, 65520.f));
  EXPECT_FALSE(clips(Format::kBf16, FLT_MAX / 2));
  EXPECT_TRUE(clips(Format::kBf16, FLT_MAX));
  // Consistency with the codecs: just under a threshold still encodes to the top code.
  EXPECT_EQ(format::write_fp8_e4m3(464.f), 0x7E);
  EXPECT_EQ(format::write_fp8_e4m3_fnuz(232.f), 0x7E);
  EXPECT_EQ(format::encode_int8(std::nextafter(127.5f, 0.f)), 127);
}

TEST(RowBytes, PerFormat) {
  EXPECT_EQ(row_bytes(Format::kInt8, 64), 64u);
  EXPECT_EQ(row_bytes(Format::kFp8E4m3, 8), 8u);
  EXPECT_EQ(row_bytes(Format::kBf16, 8), 16u);
  EXPECT_EQ(row_bytes(Format::kFp16, 3), 6u);
  EXPECT_EQ(row_bytes(Format::kInt4, 7), 4u);
  EXPECT_EQ(row_bytes(Format::kInt4, 8), 4u);
  EXPECT_EQ(row_bytes(Format::kInt4, 0), 0u);
}

TEST(QuantizeRow, RoundTripWithinDerivedBoundAndBoundIsTight) {
  std::mt19937 rng(1234);
  for (Format f : kAllFormats) {
    double worst_ratio = 0;
    uint64_t checked = 0;
    for (int row = 0; row < 400; ++row) {
      const int n = 8 + 8 * (row % 16) + (f == Format::kInt4 ? row % 2 : 0);  // odd int4 rows too
      const std::vector<float> x = random_row(rng, n);
      // Amax and scale in float64, independently of the library.
      double amax = 0;
      for (float v : x) amax = std::max(amax, std::fabs(static_cast<double>(v)));
      const float scale = scale_for_amax(f, static_cast<float>(amax));
      if (is_quantized(f) && amax > 0) {
        EXPECT_NEAR(scale, amax / format_qmax(f), amax / format_qmax(f) * 1e-6);
      }
      std::vector<uint8_t> codes(row_bytes(f, n) + 1, 0xAB);
      QuantStats st;
      quantize_row(f, x.data(), n, scale, codes.data(), &st);
      EXPECT_EQ(codes.back(), 0xAB) << "wrote past row_bytes for " << format_bits(f) << "-bit format";
      EXPECT_EQ(st.values, static_cast<uint64_t>(n));
      EXPECT_EQ(st.saturated, 0u);
      EXPECT_EQ(st.nonfinite, 0u);
      std::vector<float> y(static_cast<size_t>(n));
      dequantize_row(f, codes.data(), n, scale, y.data());
      for (int i = 0; i < n; ++i) {
        const double err = std::fabs(static_cast<double>(y[i]) - x[i]);
        const double bound = allowed_error(f, x[i], scale);
        ASSERT_LE(err, bound) << "format " << static_cast<int>(f) << " x=" << x[i] << " got " << y[i]
                              << " scale " << scale;
        if (bound > 0) worst_ratio = std::max(worst_ratio, err / bound);
        ++checked;
      }
      if (f == Format::kInt4 && n % 2 == 1) {
        EXPECT_EQ(codes[static_cast<size_t>(n / 2)] >> 4, 0);
      }
    }
    // The bound is derived, not fitted; random data should come close to it, or the test could
    // not notice a grid twice too coarse.
    EXPECT_GT(worst_ratio, 0.75) << "format " << static_cast<int>(f) << " over " << checked << " values";
  }
}

TEST(QuantizeRow, AmaxMapsToTheTopCode) {
  const std::vector<float> x = {0.5f, -3.25f, 1.f, 0.f};
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8}) {
    const float s = scale_for_amax(f, 3.25f);
    uint8_t codes[4];
    quantize_row(f, x.data(), 4, s, codes, nullptr);
    EXPECT_EQ(decode_byte(f, codes[1]), -format_qmax(f));
    EXPECT_EQ(codes[3], 0);  // +0, never -0 (interchange rule)
  }
}

TEST(QuantizeRow, NonFiniteWrittenAsZeroAndCounted) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {nan, 2.f, -inf, -1.f, inf, 0.5f, -nan, 1.5f};
  for (Format f : kAllFormats) {
    QuantStats st;
    const float s = scale_for_amax(f, finite_amax(x.data(), 8));
    std::vector<uint8_t> codes(row_bytes(f, 8));
    quantize_row(f, x.data(), 8, s, codes.data(), &st);
    EXPECT_EQ(st.nonfinite, 4u);
    EXPECT_EQ(st.values, 8u);
    EXPECT_EQ(st.saturated, 0u);
    std::vector<float> y(8);
    dequantize_row(f, codes.data(), 8, s, y.data());
    for (int i : {0, 2, 4, 6}) {
      EXPECT_EQ(y[static_cast<size_t>(i)], 0.f) << static_cast<int>(f);
      EXPECT_FALSE(std::signbit(y[static_cast<size_t>(i)]));
    }
    for (int i : {1, 3, 5, 7}) {
      EXPECT_LE(std::fabs(y[static_cast<size_t>(i)] - x[static_cast<size_t>(i)]), allowed_error(f, x[static_cast<size_t>(i)], s));
    }
  }
}

TEST(QuantizeRow, SaturatesAndCountsExactlyTheClippedValues) {
  std::mt19937 rng(99);
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4}) {
    const std::vector<float> x = random_row(rng, 256);
    double amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(static_cast<double>(v)));
    // A scale fixed from a quarter of the data's range, as a per_tensor baseline would have.
    const float s = static_cast<float>(amax / 4 / format_qmax(f));
    std::vector<uint8_t> codes(row_bytes(f, 256));
    QuantStats st;
    quantize_row(f, x.data(), 256, s, codes.data(), &st);
    std::vector<float> y(256);
    dequantize_row(f, codes.data(), 256, s, y.data());
    // Independent count: everything more than one top-grid half step beyond qmax * s must clip;
    // the grid's top step is 1 (int), 32 (OCP: 448 -> 480), 16 (FNUZ writer: 224 -> 240).
    const double top_half_step = f == Format::kFp8E4m3 ? 16 : f == Format::kFp8E4m3Fnuz ? 8 : 0.5;
    uint64_t surely = 0, maybe = 0;
    for (int i = 0; i < 256; ++i) {
      const double a = std::fabs(static_cast<double>(x[static_cast<size_t>(i)])) / s;
      if (a > format_qmax(f) + top_half_step * 1.0001) ++surely;
      if (a >= (format_qmax(f) + top_half_step) * 0.9999) ++maybe;
      if (a > format_qmax(f)) {
        EXPECT_FLOAT_EQ(std::fabs(y[static_cast<size_t>(i)]), format_qmax(f) * s);
        EXPECT_EQ(std::signbit(y[static_cast<size_t>(i)]), std::signbit(x[static_cast<size_t>(i)]));
      }
    }
    EXPECT_GT(surely, 10u);
    EXPECT_GE(st.saturated, surely);
    EXPECT_LE(st.saturated, maybe);
  }
}

TEST(QuantizeRow, HalfFormatsSaturateInsteadOfOverflowing) {
  const std::vector<float> x = {70000.f, -FLT_MAX, 1.f, 65504.f};
  uint8_t codes[8];
  float y[4];
  QuantStats st;
  quantize_row(Format::kFp16, x.data(), 4, 1.f, codes, &st);
  dequantize_row(Format::kFp16, codes, 4, 1.f, y);
  EXPECT_EQ(st.saturated, 2u);
  EXPECT_EQ(y[0], 65504.f);
  EXPECT_EQ(y[1], -65504.f);
  EXPECT_EQ(y[3], 65504.f);
  QuantStats sb;
  quantize_row(Format::kBf16, x.data(), 4, 1.f, codes, &sb);
  dequantize_row(Format::kBf16, codes, 4, 1.f, y);
  EXPECT_EQ(sb.saturated, 1u);
  EXPECT_TRUE(std::isfinite(y[1]));
  EXPECT_EQ(y[1], -format::bf16_to_float(0x7F7F));
}

TEST(QuantizeRow, SixteenBitFormatsAreLittleEndianPatterns) {
  const float x[2] = {1.0f, -2.0f};
  uint8_t b[4];
  quantize_row(Format::kBf16, x, 2, 1.f, b, nullptr);
  EXPECT_EQ(b[0], 0x80);  // 1.0 = 0x3F80
  EXPECT_EQ(b[1], 0x3F);
  EXPECT_EQ(b[2], 0x00);  // -2.0 = 0xC000
  EXPECT_EQ(b[3], 0xC0);
  quantize_row(Format::kFp16, x, 2, 1.f, b, nullptr);
  EXPECT_EQ(b[0], 0x00);  // 1.0 = 0x3C00
  EXPECT_EQ(b[1], 0x3C);
  EXPECT_EQ(b[3], 0xC0);  // -2.0 = 0xC000
}

TEST(QuantizeRow, Int4PacksLowNibbleFirst) {
  const float x[3] = {1.f, -2.f, 7.f};
  uint8_t b[2] = {0xFF, 0xFF};
  quantize_row(Format::kInt4, x, 3, 1.f, b, nullptr);
  EXPECT_EQ(b[0], 0xE1);  // lo = 1, hi = -2 (0xE)
  EXPECT_EQ(b[1], 0x07);  // lo = 7, hi nibble of the odd tail = 0
}

}  // namespace
}  // namespace kvq::quant
