// FP8 E4M3 codecs against ml_dtypes (decode of every code, encode of >= 10^6 floats) and the
// writers' interchange rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "format/oracle.h"
#include "kvq/format/fp8.h"

namespace kvq::format {
namespace {

using test::oracle;

std::string hexf(float x) {
  char s[48];
  std::snprintf(s, sizeof s, "%a (bits 0x%08x)", static_cast<double>(x), float_bits(x));
  return s;
}

void expect_same_float(float ours, float ref, unsigned code, const char* fmt) {
  if (std::isnan(ref)) {
    EXPECT_TRUE(std::isnan(ours)) << fmt << " code 0x" << std::hex << code << ": ml_dtypes NaN, ours " << ours;
  } else {
    EXPECT_EQ(float_bits(ours), float_bits(ref))
        << fmt << " code 0x" << std::hex << code << ": ours " << hexf(ours) << ", ml_dtypes " << hexf(ref);
  }
}

TEST(Fp8Decode, AllCodesMatchMlDtypes) {
  const auto& o = oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  int nan_ocp = 0, nan_fnuz = 0;
  for (unsigned c = 0; c < 256; ++c) {
    expect_same_float(decode_fp8_e4m3(static_cast<uint8_t>(c)), o.fp8_e4m3_decode[c], c, "float8_e4m3fn");
    expect_same_float(decode_fp8_e4m3_fnuz(static_cast<uint8_t>(c)), o.fp8_e4m3_fnuz_decode[c], c,
                      "float8_e4m3fnuz");
    nan_ocp += std::isnan(o.fp8_e4m3_decode[c]);
    nan_fnuz += std::isnan(o.fp8_e4m3_fnuz_decode[c]);
  }
  // The oracle itself: OCP has two NaN codes (S.1111.111), FNUZ one (0x80).
  EXPECT_EQ(nan_ocp, 2);
  EXPECT_EQ(nan_fnuz, 1);
  EXPECT_EQ(o.fp8_e4m3_decode[0x7e], 448.0f);
  EXPECT_EQ(o.fp8_e4m3_fnuz_decode[0x7f], 240.0f);
}

// ml_dtypes does not saturate: an out-of-range float casts to NaN. kvq's encoders saturate, so
// the oracle is ml_dtypes' cast of clip(x, -max, max) (the script does the clip). The only other
// documented difference is NaN: ml_dtypes keeps it (a NaN code), kvq writes +0 (the quantizers
// count such inputs). +-inf clip to +-max, which is also kvq's policy.
TEST(Fp8Encode, SweepMatchesMlDtypesClampThenCast) {
  const auto& o = oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  const auto& x = o.sweep_inputs;
  ASSERT_GE(x.size(), 1000000u);
  size_t nan_inputs = 0, bad_ocp = 0, bad_fnuz = 0, subnormal_hits = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint8_t ocp = encode_fp8_e4m3(x[i]), fnuz = encode_fp8_e4m3_fnuz(x[i]);
    uint8_t want_ocp = o.sweep_fp8_e4m3[i], want_fnuz = o.sweep_fp8_e4m3_fnuz[i];
    if (std::isnan(x[i])) {
      ++nan_inputs;
      EXPECT_EQ(want_ocp & 0x7f, 0x7f) << "ml_dtypes should keep NaN";
      EXPECT_EQ(want_fnuz, 0x80) << "ml_dtypes should keep NaN";
      want_ocp = want_fnuz = 0x00;  // kvq policy
    }
    subnormal_hits += (ocp & 0x78) == 0 && (ocp & 7) != 0;
    if (ocp != want_ocp && bad_ocp++ < 10)
      ADD_FAILURE() << "encode_fp8_e4m3(" << hexf(x[i]) << ") = 0x" << std::hex << int(ocp) << ", ml_dtypes 0x"
                    << int(want_ocp);
    if (fnuz != want_fnuz && bad_fnuz++ < 10)
      ADD_FAILURE() << "encode_fp8_e4m3_fnuz(" << hexf(x[i]) << ") = 0x" << std::hex << int(fnuz)
                    << ", ml_dtypes 0x" << int(want_fnuz);
  }
  EXPECT_EQ(bad_ocp, 0u);
  EXPECT_EQ(bad_fnuz, 0u);
  EXPECT_GT(nan_inputs, 100u);       // the random bit patterns include NaNs
  EXPECT_GT(subnormal_hits, 1000u);  // and the sweep really exercises subnormals
}

TEST(Fp8Encode, TiesRoundToEvenAndSaturation) {
  // Hand-checked spec points (independent of ml_dtypes).
  EXPECT_EQ(encode_fp8_e4m3(1.0625f), 0x38);      // between 1 and 1.125 -> even
  EXPECT_EQ(encode_fp8_e4m3(1.1875f), 0x3A);      // between 1.125 and 1.25 -> even
  EXPECT_EQ(encode_fp8_e4m3(0x1p-10f), 0x00);     // half the smallest subnormal -> 0
  EXPECT_EQ(encode_fp8_e4m3(0x1.8p-9f), 0x02);    // 1.5 subnormal ulps -> 2
  EXPECT_EQ(encode_fp8_e4m3(0x1.ep-7f), 0x08);    // 7.5 * 2^-9 rounds up into the first normal
  EXPECT_EQ(encode_fp8_e4m3(464.0f), 0x7E);       // would round to 480 (NaN code): saturates
  EXPECT_EQ(encode_fp8_e4m3(-1e38f), 0xFE);
  EXPECT_EQ(encode_fp8_e4m3(-0.0f), 0x80);
  EXPECT_EQ(encode_fp8_e4m3(-1e-30f), 0x80);
  EXPECT_EQ(encode_fp8_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(encode_fp8_e4m3(NAN), 0x00);
  EXPECT_EQ(encode_fp8_e4m3_fnuz(-0.0f), 0x00);
  EXPECT_EQ(encode_fp8_e4m3_fnuz(-1e-30f), 0x00);
  EXPECT_EQ(encode_fp8_e4m3_fnuz(244.0f), 0x7F);
  EXPECT_EQ(encode_fp8_e4m3_fnuz(-INFINITY), 0xFF);
  EXPECT_EQ(encode_fp8_e4m3_fnuz(-NAN), 0x00);
}

TEST(Fp8Writer, OcpNeverEmitsNegativeZeroAndOtherwiseEqualsEncoder) {
  const auto& o = oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  size_t flushed = 0;
  for (float v : o.sweep_inputs) {
    const uint8_t w = write_fp8_e4m3(v), e = encode_fp8_e4m3(v);
    ASSERT_NE(w, 0x80) << hexf(v);
    ASSERT_NE(w & 0x7f, 0x7f) << hexf(v);
    if (e == 0x80) {
      ++flushed;
      ASSERT_EQ(w, 0x00);
    } else {
      ASSERT_EQ(w, e) << hexf(v);
    }
  }
  EXPECT_GT(flushed, 10u);
}

TEST(Fp8Writer, FnuzCapsAt224) {
  const auto& o = oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  size_t capped = 0;
  for (float v : o.sweep_inputs) {
    const uint8_t w = write_fp8_e4m3_fnuz(v), e = encode_fp8_e4m3_fnuz(v);
    ASSERT_LE(w & 0x7f, 0x7E) << hexf(v);
    ASSERT_NE(w, 0x80) << hexf(v);
    if ((e & 0x7f) == 0x7f) {
      ++capped;
      ASSERT_EQ(w, (e & 0x80) | 0x7E) << hexf(v);
      ASSERT_EQ(std::fabs(decode_fp8_e4m3_fnuz(w)), kFp8FnuzWriterMax);
    } else {
      ASSERT_EQ(w, e) << hexf(v);
    }
  }
  EXPECT_GT(capped, 1000u);
  EXPECT_EQ(write_fp8_e4m3_fnuz(232.0f), 0x7E);  // tie between 224 and 240 -> even, and capped anyway
  EXPECT_EQ(write_fp8_e4m3_fnuz(1e9f), 0x7E);
  EXPECT_EQ(write_fp8_e4m3_fnuz(-INFINITY), 0xFE);
}

// DESIGN §2: the same data quantized for OCP with scale s and for FNUZ with scale 2s gives the
// same bytes, so a cache moves between vendors by rescaling only.
TEST(Fp8Writer, InterchangeProperty) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> log_scale(-12.0f, 6.0f), log_mag(-20.0f, 12.0f), unit(-1.0f, 1.0f);
  size_t nonzero = 0, saturated = 0;
  for (int i = 0; i < 1000000; ++i) {
    const float s = std::exp2(log_scale(rng));
    float x = unit(rng) * std::exp2(log_mag(rng));
    if (i % 1000 == 0) x = (i % 2000 == 0 ? 1 : -1) * std::exp2(log_mag(rng)) * 448.0f;  // saturating
    const uint8_t ocp = write_fp8_e4m3(x / s), fnuz = write_fp8_e4m3_fnuz(x / (2.0f * s));
    ASSERT_EQ(ocp, fnuz) << "x=" << hexf(x) << " s=" << hexf(s);
    nonzero += ocp != 0;
    saturated += (ocp & 0x7f) == 0x7e;
    // and the decoded values agree once each is multiplied by its own scale
    ASSERT_EQ(decode_fp8_e4m3(ocp) * s, decode_fp8_e4m3_fnuz(fnuz) * (2.0f * s));
  }
  EXPECT_GT(nonzero, 500000u);
  EXPECT_GT(saturated, 100u);
  for (float v : {INFINITY, -INFINITY, NAN, -0.0f, 0.0f}) EXPECT_EQ(write_fp8_e4m3(v), write_fp8_e4m3_fnuz(v));
}

TEST(Fp8Writer, EveryWrittenCodeMeansHalfInFnuz) {
  for (unsigned c = 0; c < 256; ++c) {
    const auto b = static_cast<uint8_t>(c);
    if (b == 0x80 || (b & 0x7f) == 0x7f) continue;  // never written
    EXPECT_EQ(decode_fp8_e4m3_fnuz(b), decode_fp8_e4m3(b) * 0.5f) << std::hex << c;
  }
}

}  // namespace
}  // namespace kvq::format
