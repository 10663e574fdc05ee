// int8 / int4 / uint4 codecs against a float64 reference, and int4 packing.
#include <gtest/gtest.h>

#include <cfenv>
#include <cmath>
#include <random>
#include <vector>

#include "kvq/format/format.h"
#include "kvq/format/integer.h"

namespace kvq::format {
namespace {

// Reference: round half to even in double precision (the default rounding mode), then clamp.
int ref_symmetric(float x, int qmax) {
  if (std::isnan(x)) return 0;
  const double q = std::nearbyint(static_cast<double>(x));
  return static_cast<int>(std::fmax(-qmax, std::fmin(qmax, q)));
}
int ref_unsigned(float x, int qmax) {
  if (std::isnan(x)) return 0;
  const double q = std::nearbyint(static_cast<double>(x));
  return static_cast<int>(std::fmax(0.0, std::fmin(qmax, q)));
}

std::vector<float> int_inputs() {
  std::vector<float> x;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> wide(-300.0f, 300.0f), narrow(-20.0f, 20.0f);
  for (int i = 0; i < 200000; ++i) x.push_back(i % 2 ? wide(rng) : narrow(rng));
  for (int k = -300; k <= 300; ++k) {  // exact ties and their neighbours
    const float t = static_cast<float>(k) + 0.5f;
    x.insert(x.end(), {t, std::nextafter(t, 1e9f), std::nextafter(t, -1e9f), static_cast<float>(k)});
  }
  x.insert(x.end(), {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 1e30f, -1e30f, 0.49999997f, -0.49999997f});
  return x;
}

TEST(Integer, Int8MatchesFloat64Reference) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  for (float x : int_inputs()) {
    ASSERT_EQ(encode_int8(x), ref_symmetric(x, 127)) << x;
    ASSERT_EQ(decode_int8(encode_int8(x)), static_cast<float>(ref_symmetric(x, 127))) << x;
  }
  EXPECT_EQ(encode_int8(-1e9f), -127);  // never -128
  EXPECT_EQ(encode_int8(2.5f), 2);
  EXPECT_EQ(encode_int8(-3.5f), -4);
}

TEST(Integer, Int4AndUint4MatchFloat64Reference) {
  for (float x : int_inputs()) {
    ASSERT_EQ(encode_int4(x), ref_symmetric(x, 7)) << x;
    ASSERT_EQ(encode_uint4(x), ref_unsigned(x, 15)) << x;
    ASSERT_EQ(decode_byte(Format::kInt4, encode_byte(Format::kInt4, x)), static_cast<float>(ref_symmetric(x, 7)))
        << x;
    ASSERT_EQ(decode_byte(Format::kInt8, encode_byte(Format::kInt8, x)), static_cast<float>(ref_symmetric(x, 127)))
        << x;
  }
  EXPECT_EQ(encode_int4(7.5f), 7);
  EXPECT_EQ(encode_int4(6.5f), 6);
  EXPECT_EQ(encode_uint4(15.5f), 15);
  EXPECT_EQ(encode_uint4(-0.5f), 0);
}

TEST(Integer, Int4PackingAllPairs) {
  for (int lo = -8; lo <= 7; ++lo)
    for (int hi = -8; hi <= 7; ++hi) {
      const uint8_t b = pack_int4(lo, hi);
      ASSERT_EQ(unpack_int4_lo(b), lo);
      ASSERT_EQ(unpack_int4_hi(b), hi);
      ASSERT_EQ(b & 0xf, lo & 0xf);  // element 2i in the low nibble
    }
  for (int lo = 0; lo <= 15; ++lo)
    for (int hi = 0; hi <= 15; ++hi) {
      const uint8_t b = pack_int4(lo, hi);
      ASSERT_EQ(b, lo | (hi << 4));
      ASSERT_EQ(unpack_uint4_lo(b), lo);
      ASSERT_EQ(unpack_uint4_hi(b), hi);
    }
}

TEST(Integer, Int4RowsRoundTripAgainstFloat64) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t n : {size_t{1}, size_t{2}, size_t{7}, size_t{64}, size_t{127}, size_t{128}}) {
    std::vector<float> x(n);
    for (auto& v : x) v = nd(rng);
    float amax = 0.0f;
    for (float v : x) amax = std::fmax(amax, std::fabs(v));
    const float scale = amax / 7.0f;
    std::vector<uint8_t> packed(int4_row_bytes(n) + 1, 0xAB);  // one canary byte
    encode_int4_row(x.data(), n, scale, packed.data());
    EXPECT_EQ(packed.back(), 0xAB) << "wrote past int4_row_bytes(" << n << ")";
    if (n & 1) {
      EXPECT_EQ(packed[n / 2] >> 4, 0) << "odd row: high nibble of the last byte must be 0";
    }
    std::vector<float> y(n);
    decode_int4_row(packed.data(), n, scale, y.data());
    for (size_t i = 0; i < n; ++i) {
      const int q = ref_symmetric(x[i] / scale, 7);
      ASSERT_EQ(int4_at(packed.data(), i), q) << i;
      ASSERT_EQ(y[i], static_cast<float>(q) * scale);
      // |error| <= scale / 2 against the exact value, computed in float64
      ASSERT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), 0.5 * scale * (1 + 1e-6)) << i;
    }

    // Asymmetric (KIVI-style): min..max mapped onto 0..15.
    float lo = x[0], hi = x[0];
    for (float v : x) lo = std::fmin(lo, v), hi = std::fmax(hi, v);
    const float ascale = hi > lo ? (hi - lo) / 15.0f : 1.0f;
    const float zp = std::nearbyint(-lo / ascale);
    encode_uint4_row(x.data(), n, ascale, zp, packed.data());
    decode_uint4_row(packed.data(), n, ascale, zp, y.data());
    for (size_t i = 0; i < n; ++i) {
      const int q = ref_unsigned(x[i] / ascale + zp, 15);
      ASSERT_EQ(uint4_at(packed.data(), i), q) << i;
      ASSERT_EQ(y[i], (static_cast<float>(q) - zp) * ascale);
    }
  }
}

}  // namespace
}  // namespace kvq::format
