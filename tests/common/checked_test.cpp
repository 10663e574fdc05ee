// Checked integer helpers: overflow is reported, never wrapped, and float-to-int conversions
// refuse NaN, infinities, fractions and out-of-range values instead of invoking undefined behaviour.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kvq/common/checked.h"

namespace kvq {
namespace {

TEST(Checked, AddAndMulReportOverflow) {
  uint64_t u = 0;
  EXPECT_TRUE(checked_add<uint64_t>(1, 2, &u));
  EXPECT_EQ(u, 3u);
  EXPECT_FALSE(checked_add<uint64_t>(UINT64_MAX, 1, &u));
  EXPECT_TRUE(checked_mul<uint64_t>(1ull << 31, 1ull << 32, &u));
  EXPECT_EQ(u, 1ull << 63);
  EXPECT_FALSE(checked_mul<uint64_t>(1ull << 32, 1ull << 32, &u));
  int32_t i = 0;
  EXPECT_FALSE(checked_mul<int32_t>(65536, 32768, &i));  // 2^31: the "negative nonsense" case
  EXPECT_TRUE(checked_mul<int32_t>(-65536, 32768, &i));
  EXPECT_EQ(i, INT32_MIN);
}

TEST(Checked, NarrowingKeepsSignAndRange) {
  int32_t i = 0;
  EXPECT_TRUE(checked_narrow(uint64_t{INT32_MAX}, &i));
  EXPECT_EQ(i, INT32_MAX);
  EXPECT_FALSE(checked_narrow(uint64_t{1} << 31, &i));
  uint32_t u = 0;
  EXPECT_FALSE(checked_narrow(int64_t{-1}, &u));
  EXPECT_TRUE(checked_narrow(int64_t{7}, &u));
  EXPECT_EQ(u, 7u);
}

TEST(Checked, FloatToIntRefusesWhatCannotConvert) {
  int v = 0;
  EXPECT_TRUE(checked_float_to_int(6.0, &v));
  EXPECT_EQ(v, 6);
  EXPECT_TRUE(checked_float_to_int(-2147483648.0, &v));
  EXPECT_EQ(v, INT32_MIN);
  EXPECT_FALSE(checked_float_to_int(2147483648.0, &v));
  EXPECT_FALSE(checked_float_to_int(std::nan(""), &v));
  EXPECT_FALSE(checked_float_to_int(INFINITY, &v));
  EXPECT_FALSE(checked_float_to_int(-INFINITY, &v));
  EXPECT_FALSE(checked_float_to_int(1.5, &v));
  EXPECT_FALSE(checked_float_to_int(1e300, &v));
  int64_t w = 0;
  EXPECT_FALSE(checked_float_to_int(9223372036854775808.0, &w));  // 2^63
  EXPECT_TRUE(checked_float_to_int(-9223372036854775808.0, &w));
  EXPECT_EQ(w, INT64_MIN);
  uint8_t b = 0;
  EXPECT_FALSE(checked_float_to_int(-1.0, &b));
  EXPECT_FALSE(checked_float_to_int(256.0, &b));
  EXPECT_TRUE(checked_float_to_int(255.0, &b));
  EXPECT_EQ(b, 255);
}

TEST(Checked, ProductAndSumNameTheQuantity) {
  auto p = checked_product({1ull << 40, 1ull << 30}, "tensor 'x' bytes");
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kCorruptInput);
  EXPECT_NE(p.status().message().find("tensor 'x' bytes"), std::string::npos);
  auto q = checked_product({3, 5, 7}, "x");
  ASSERT_TRUE(q.is_ok());
  EXPECT_EQ(q.value(), 105u);
  EXPECT_FALSE(checked_sum({UINT64_MAX, 1}, "y").is_ok());
  EXPECT_EQ(checked_sum({2, 3}, "y").value(), 5u);
}

}  // namespace
}  // namespace kvq
