// Moving an fp8 cache between OCP and FNUZ: bytes untouched, scales doubled/halved, bad bytes refused.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>
#include <vector>

#include "kvq/format/transcode.h"

namespace kvq::format {
namespace {

struct Cache {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // one per row of `row` codes
  int row = 64;
};

Cache write_cache(Format f, int rows, uint32_t seed) {
  Cache c;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int r = 0; r < rows; ++r) {
    std::vector<float> x(c.row);
    float amax = 0.0f;
    for (auto& v : x) v = nd(rng), amax = std::fmax(amax, std::fabs(v));
    const float scale = amax / format_qmax(f);
    c.scales.push_back(scale);
    for (float v : x) c.codes.push_back(encode_byte(f, v / scale));
  }
  return c;
}

std::vector<float> decode(Format f, const Cache& c) {
  std::vector<float> y;
  for (size_t i = 0; i < c.codes.size(); ++i) y.push_back(decode_byte(f, c.codes[i]) * c.scales[i / c.row]);
  return y;
}

TEST(Transcode, RoundTripKeepsBytesAndValues) {
  for (Format from : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz}) {
    const Format to = from == Format::kFp8E4m3 ? Format::kFp8E4m3Fnuz : Format::kFp8E4m3;
    Cache c = write_cache(from, 50, 3);
    const Cache orig = c;
    const std::vector<float> before = decode(from, c);
    ASSERT_TRUE(transcode_fp8(from, to, c.codes.data(), c.codes.size(), c.scales.data(), c.scales.size()).is_ok());
    EXPECT_EQ(c.codes, orig.codes);
    for (size_t i = 0; i < c.scales.size(); ++i)
      EXPECT_EQ(c.scales[i], from == Format::kFp8E4m3 ? orig.scales[i] * 2 : orig.scales[i] / 2);
    // Read as the other format with the new scales: every value is bit-identical.
    const std::vector<float> after = decode(to, c);
    ASSERT_EQ(before.size(), after.size());
    for (size_t i = 0; i < before.size(); ++i) ASSERT_EQ(float_bits(before[i]), float_bits(after[i])) << i;
    ASSERT_TRUE(transcode_fp8(to, from, c.codes.data(), c.codes.size(), c.scales.data(), c.scales.size()).is_ok());
    EXPECT_EQ(c.scales, orig.scales);
    EXPECT_EQ(c.codes, orig.codes);
  }
}

TEST(Transcode, RefusesBytesOutsideTheInterchangeRuleWithoutTouchingScales) {
  for (uint8_t bad : {uint8_t{0x80}, uint8_t{0x7F}, uint8_t{0xFF}}) {
    Cache c = write_cache(Format::kFp8E4m3, 4, 9);
    const size_t where = 137;
    c.codes[where] = bad;
    const Cache orig = c;
    Status s = transcode_fp8(Format::kFp8E4m3, Format::kFp8E4m3Fnuz, c.codes.data(), c.codes.size(),
                             c.scales.data(), c.scales.size());
    EXPECT_EQ(s.code(), StatusCode::kCorruptInput);
    EXPECT_NE(s.message().find("offset 137"), std::string::npos) << s.message();
    EXPECT_EQ(c.scales, orig.scales);
    EXPECT_EQ(c.codes, orig.codes);
  }
}

TEST(Transcode, ChecksEveryCodeAgainstTheRule) {
  int accepted = 0;
  for (unsigned b = 0; b < 256; ++b) {
    const uint8_t code = static_cast<uint8_t>(b);
    float scale = 1.0f;
    const bool ok = transcode_fp8(Format::kFp8E4m3Fnuz, Format::kFp8E4m3, &code, 1, &scale, 1).is_ok();
    EXPECT_EQ(ok, is_interchange_code(code)) << b;
    EXPECT_EQ(scale, ok ? 0.5f : 1.0f);
    accepted += ok;
  }
  EXPECT_EQ(accepted, 256 - 3);  // 0x80, 0x7F, 0xFF
}

TEST(Transcode, ArgumentErrors) {
  uint8_t code = 0x10;
  float scale = 1.0f;
  EXPECT_EQ(transcode_fp8(Format::kInt8, Format::kFp8E4m3, &code, 1, &scale, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(transcode_fp8(Format::kFp8E4m3, Format::kBf16, &code, 1, &scale, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(transcode_fp8(Format::kFp8E4m3, Format::kFp8E4m3Fnuz, nullptr, 1, &scale, 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(transcode_fp8(Format::kFp8E4m3, Format::kFp8E4m3, &code, 1, &scale, 1).is_ok());
  EXPECT_EQ(scale, 1.0f);  // same format: nothing to do
  EXPECT_TRUE(transcode_fp8(Format::kFp8E4m3, Format::kFp8E4m3Fnuz, nullptr, 0, nullptr, 0).is_ok());
  // Scales that cannot be rescaled exactly are refused, and nothing changes.
  float scales[2] = {1.0f, FLT_MAX};
  EXPECT_EQ(transcode_fp8(Format::kFp8E4m3, Format::kFp8E4m3Fnuz, &code, 1, scales, 2).code(),
            StatusCode::kCorruptInput);
  EXPECT_EQ(scales[0], 1.0f);
  float tiny[1] = {std::nextafter(FLT_MIN, 1.0f)};  // odd mantissa: its half is not a float
  EXPECT_EQ(transcode_fp8(Format::kFp8E4m3Fnuz, Format::kFp8E4m3, &code, 1, tiny, 1).code(),
            StatusCode::kCorruptInput);
  float nan_scale[1] = {NAN};
  EXPECT_EQ(transcode_fp8(Format::kFp8E4m3Fnuz, Format::kFp8E4m3, &code, 1, nan_scale, 1).code(),
            StatusCode::kCorruptInput);
}

}  // namespace
}  // namespace kvq::format
