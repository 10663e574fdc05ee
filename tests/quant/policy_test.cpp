// The format table (format/traits.h) and the scale policy (quant/policy.h) against independent
// references: the clip rule against rounding on an unbounded grid of the format's precision, the
// scale against float64 division, and the table's sizes against the codecs.
#include <gtest/gtest.h>

#include <cfloat>
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvq/cache/layout.h"
#include "kvq/format/format.h"
#include "kvq/quant/policy.h"
#include "kvq/quant/quantize.h"

namespace kvq {
namespace {

// Significand bits (implicit bit included) and the largest finite value the writer emits.
struct Grid {
  int precision;  // 0: integers
  double max_emitted;
};
Grid grid_of(Format f) {
  switch (f) {
    case Format::kBf16: return {8, std::ldexp(255.0 / 128.0, 127)};
    case Format::kFp16: return {11, 65504.0};
    case Format::kFp8E4m3: return {4, 448.0};
    case Format::kFp8E4m3Fnuz: return {4, 224.0};
    case Format::kInt8: return {0, 127.0};
    case Format::kInt4: return {0, 7.0};
    case Format::kInt4Kivi: return {0, 15.0};
  }
  return {0, 0.0};
}

// Round |s| to nearest even on the grid with the format's precision and no upper exponent limit.
double unbounded_round(Format f, double a) {
  const Grid g = grid_of(f);
  if (g.precision == 0) return std::nearbyint(a);
  const double step = std::ldexp(1.0, std::ilogb(a) - (g.precision - 1));
  return std::nearbyint(a / step) * step;
}

TEST(FormatTraits, ClipRuleMatchesRoundingOnAnUnboundedGrid) {
  for (Format f : kAllFormats) {
    const FormatTraits t = format_traits(f);
    const float lim = t.clip_limit;
    for (float s : {lim, std::nextafter(lim, 0.f), std::nextafter(lim, FLT_MAX), t.qmax,
                    static_cast<float>(grid_of(f).max_emitted), std::nextafter(static_cast<float>(grid_of(f).max_emitted), FLT_MAX)}) {
      const bool want = unbounded_round(f, s) > grid_of(f).max_emitted;
      EXPECT_EQ(quant::clips(f, s), want) << t.name << " at " << s;
      EXPECT_EQ(quant::clips(f, -s), want) << t.name << " at " << -s;
    }
  }
}

TEST(FormatTraits, TableAgreesWithTheCodecs) {
  for (Format f : kAllFormats) {
    const FormatTraits t = format_traits(f);
    EXPECT_EQ(is_quantized(f), t.kind != CodeKind::kHalf) << t.name;
    EXPECT_EQ(t.axis == GroupAxis::kNone, !is_quantized(f)) << t.name;
    // Row sizes follow bits and packing: 7 elements.
    const size_t bytes = quant::row_bytes(f, 7);
    EXPECT_EQ(bytes, t.elems_per_byte > 1 ? size_t(4) : size_t(7 * t.bits / 8)) << t.name;
    if (!is_quantized(f)) continue;
    // qmax is what the encoder saturates to, and a code the decoder gives back exactly.
    EXPECT_EQ(decode_byte(f, encode_byte(f, 1e30f)), t.qmax) << t.name;
    // An unsigned grid (zero point added before encoding) bottoms out at code 0.
    EXPECT_EQ(decode_byte(f, encode_byte(f, -1e30f)), t.is_signed ? -t.qmax : 0.f) << t.name;
    EXPECT_EQ(t.zero_point, !t.is_signed) << t.name;
    EXPECT_EQ(static_cast<double>(t.qmax), grid_of(f).max_emitted) << t.name;
    EXPECT_TRUE(t.cache_ready) << t.name;
    if (t.device_ready) {
      EXPECT_TRUE(t.cache_ready) << t.name << ": the CPU reference comes first";
    }
  }
}

TEST(ScalePolicy, ScaleIsTheCorrectlyRoundedQuotient) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> ex(-140, 120);
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4}) {
    for (int i = 0; i < 20000; ++i) {
      const float amax = static_cast<float>(std::ldexp(mant(rng), ex(rng)));
      // float64 quotient rounded once to float: exact for a quotient of two floats (53 >= 2 * 24 + 2).
      float want = static_cast<float>(static_cast<double>(amax) / format_qmax(f));
      if (want < FLT_MIN) want = FLT_MIN;
      ASSERT_EQ(quant::scale_for_amax(f, amax), want) << format_name(f) << " amax " << amax;
    }
    EXPECT_EQ(quant::scale_for_amax(f, 0.f), 1.f);
    EXPECT_EQ(quant::scale_for_amax(f, INFINITY), 1.f);
    EXPECT_EQ(quant::scale_for_amax(f, NAN), 1.f);
  }
  EXPECT_EQ(quant::scale_for_amax(Format::kBf16, 100.f), 1.f);  // unscaled storage
}

// Every positive finite fp16 value, ascending, built from the binary16 definition in float64
// (subnormals m * 2^-24, normals (1 + m / 1024) * 2^(e - 15)), not from kvq's converters.
std::vector<double> fp16_grid() {
  std::vector<double> g;
  for (int m = 1; m < 1024; ++m) g.push_back(std::ldexp(m, -24));
  for (int e = 1; e < 31; ++e)
    for (int m = 0; m < 1024; ++m) g.push_back(std::ldexp(1.0 + m / 1024.0, e - 15));
  return g;
}

// The documented fp16 rule in float64: the smallest grid value >= the fp32 scale, clamped.
double fp16_reference(const std::vector<double>& grid, double s) {
  if (s >= grid.back()) return grid.back();
  return *std::lower_bound(grid.begin(), grid.end(), s);
}

TEST(ScalePolicy, Fp16ScaleIsTheFp32ScaleRoundedUpOnTheFp16Grid) {
  const std::vector<double> grid = fp16_grid();
  std::mt19937_64 rng(16);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> ex(-40, 40);  // amax 1e-12 .. 1e12: both clamps and the subnormals
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8}) {
    const double qmax = format_qmax(f);
    uint64_t clamped = 0;
    for (int i = 0; i < 50000; ++i) {
      const float amax = static_cast<float>(std::ldexp(mant(rng), ex(rng)));
      const double s32 = static_cast<double>(amax) / qmax;  // the fp32 policy, before its rounding
      const float got = quant::scale_for_amax(f, amax, ScaleDtype::kFp16);
      const double want = fp16_reference(grid, static_cast<double>(quant::scale_for_amax(f, amax)));
      ASSERT_EQ(static_cast<double>(got), want) << format_name(f) << " amax " << amax;
      const bool out_of_range = s32 > 65504.0 || static_cast<double>(quant::scale_for_amax(f, amax)) < std::ldexp(1.0, -24);
      ASSERT_EQ(quant::scale_clamped(f, amax, ScaleDtype::kFp16), out_of_range) << format_name(f) << " amax " << amax;
      clamped += out_of_range;
      // Inside fp16's range no value of the row clips: amax / stored scale stays within qmax.
      if (!out_of_range) {
        ASSERT_FALSE(quant::clips(f, quant::div_rn(amax, got))) << format_name(f) << " amax " << amax;
      }
      // The plane holds it exactly: store then load is the identity.
      uint16_t cell = 0;
      cache::store_scale(&cell, 0, got, ScaleDtype::kFp16);
      ASSERT_EQ(cache::load_scale(&cell, 0, ScaleDtype::kFp16), got);
    }
    EXPECT_GT(clamped, 1000u) << "the sweep must reach both clamps";
    // The bounds themselves and the non-finite / zero rule (scale 1, representable).
    EXPECT_EQ(quant::scale_for_amax(f, 1e30f, ScaleDtype::kFp16), 65504.f);
    EXPECT_EQ(quant::scale_for_amax(f, 1e-30f, ScaleDtype::kFp16), quant::kFp16ScaleMin);
    EXPECT_TRUE(quant::scale_clamped(f, 1e-30f, ScaleDtype::kFp16));
    for (float a : {0.f, INFINITY, NAN}) {
      EXPECT_EQ(quant::scale_for_amax(f, a, ScaleDtype::kFp16), 1.f);
      EXPECT_FALSE(quant::scale_clamped(f, a, ScaleDtype::kFp16));
    }
    // fp32 planes are unchanged by the dtype-aware overload.
    EXPECT_EQ(quant::scale_for_amax(f, 3.f, ScaleDtype::kFp32), quant::scale_for_amax(f, 3.f));
    EXPECT_FALSE(quant::scale_clamped(f, 1e30f, ScaleDtype::kFp32));
  }
}

TEST(ScalePolicy, ElementAndBookkeepingRules) {
  EXPECT_EQ(quant::amax_term(-3.5f), 3.5f);
  EXPECT_EQ(quant::amax_term(NAN), 0.f);
  EXPECT_EQ(quant::amax_term(-INFINITY), 0.f);
  EXPECT_EQ(quant::quantize_value(Format::kInt8, NAN, 1.f), 0);
  EXPECT_EQ(quant::quantize_value(Format::kInt8, INFINITY, 1.f), 0);
  EXPECT_EQ(quant::quantize_value(Format::kInt8, -254.f, 2.f), static_cast<uint8_t>(-127));
  EXPECT_EQ(quant::quantize_value(Format::kInt8, 5.f, 2.f), 2);  // 2.5 rounds to even
  EXPECT_TRUE(quant::block_scale_grows(2.f, 1.f));
  EXPECT_FALSE(quant::block_scale_grows(1.f, 1.f));  // equal amax keeps the scale (and the codes)
  EXPECT_TRUE(quant::tensor_scale_unset(0.f));
  EXPECT_FALSE(quant::tensor_scale_unset(FLT_MIN));
}

}  // namespace
}  // namespace kvq
