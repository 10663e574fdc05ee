// bf16 / fp16 conversions against numpy (float16) and ml_dtypes (bfloat16).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "format/oracle.h"
#include "kvq/format/bf16.h"

namespace kvq::format {
namespace {

using test::oracle;

bool is_nan16(uint16_t h, uint16_t exp_mask) { return (h & exp_mask) == exp_mask && (h & ~exp_mask & 0x7fff) != 0; }

TEST(Half, DecodeAllCodesMatchesNumpy) {
  const auto& o = oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  for (unsigned c = 0; c < 65536; ++c) {
    const auto h = static_cast<uint16_t>(c);
    const float f16 = fp16_to_float(h), bf = bf16_to_float(h);
    if (std::isnan(o.fp16_decode[c]))
      ASSERT_TRUE(std::isnan(f16)) << std::hex << c;
    else
      ASSERT_EQ(float_bits(f16), float_bits(o.fp16_decode[c])) << "fp16 code 0x" << std::hex << c;
    if (std::isnan(o.bf16_decode[c]))
      ASSERT_TRUE(std::isnan(bf)) << std::hex << c;
    else
      ASSERT_EQ(float_bits(bf), float_bits(o.bf16_decode[c])) << "bf16 code 0x" << std::hex << c;
  }
}

TEST(Half, EncodeSweepMatchesNumpyAndMlDtypes) {
  const auto& o = oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  ASSERT_GT(o.half_inputs.size(), 500000u);
  size_t bad16 = 0, badbf = 0, overflow = 0, subnormal = 0;
  for (size_t i = 0; i < o.half_inputs.size(); ++i) {
    const float x = o.half_inputs[i];
    const uint16_t f16 = float_to_fp16(x), bf = float_to_bf16(x);
    const uint16_t want16 = o.half_fp16[i], wantbf = o.half_bf16[i];
    // NaN payloads are not part of either format's contract: compare NaN as NaN.
    const bool ok16 = is_nan16(want16, 0x7c00) ? is_nan16(f16, 0x7c00) : f16 == want16;
    const bool okbf = is_nan16(wantbf, 0x7f80) ? is_nan16(bf, 0x7f80) : bf == wantbf;
    overflow += (want16 & 0x7fff) == 0x7c00 && std::isfinite(x);
    subnormal += (want16 & 0x7c00) == 0 && (want16 & 0x3ff) != 0;
    if (!ok16 && bad16++ < 10)
      ADD_FAILURE() << "float_to_fp16(" << x << " bits 0x" << std::hex << float_bits(x) << ") = 0x" << f16
                    << ", numpy 0x" << want16;
    if (!okbf && badbf++ < 10)
      ADD_FAILURE() << "float_to_bf16(" << x << " bits 0x" << std::hex << float_bits(x) << ") = 0x" << bf
                    << ", ml_dtypes 0x" << wantbf;
  }
  EXPECT_EQ(bad16, 0u);
  EXPECT_EQ(badbf, 0u);
  EXPECT_GT(overflow, 1000u);   // fp16 overflow-to-inf edge is exercised
  EXPECT_GT(subnormal, 1000u);  // and fp16 subnormals
}

}  // namespace
}  // namespace kvq::format
