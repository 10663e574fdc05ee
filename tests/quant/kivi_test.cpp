// KIVI's page-head quantizer (quant/kivi.h) against float64: K grouped per channel, V per token,
// both asymmetric 0..15 with zero points.
#include "kvq/quant/kivi.h"

#include "kvq/format/bf16.h"
#include "kvq/quant/kivi_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvq::quant {
namespace {

int nibble(const std::vector<uint8_t>& codes, size_t e) { return e % 2 ? codes[e / 2] >> 4 : codes[e / 2] & 15; }

TEST(Kivi, PageHeadMatchesFloat64Reference) {
  const int n = 16, d = 64;
  std::mt19937 rng(12);
  std::normal_distribution<float> z(0.f, 1.f);
  std::vector<float> k(size_t(n) * d), v(k.size());
  // K: channels with their own offset and spread (what per-channel grouping is for); V: rows.
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      k[size_t(t) * d + i] = 3.f * float(i % 5) - 4.f + z(rng) * (i % 7 == 0 ? 8.f : 0.5f);
      v[size_t(t) * d + i] = z(rng) * float(1 + t % 3) + 0.25f * float(t);
    }
  k[5] = std::numeric_limits<float>::quiet_NaN();
  v[70] = std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) k[size_t(t) * d + 11] = 2.5f;  // a constant channel: scale 1

  const KiviPageHead p = kivi_quantize(k.data(), v.data(), n, d);
  std::vector<float> kd(k.size()), vd(v.size());
  kivi_dequantize(p, n, d, kd.data(), vd.data());

  auto check_group = [&](const std::vector<float>& x, const std::vector<float>& y, const std::vector<uint8_t>& codes,
                         double scale, double zero, auto elem, int count, const char* what) {
    double lo = 0, hi = 0;
    bool any = false;
    for (int j = 0; j < count; ++j) {
      const double xv = x[elem(j)];
      if (!std::isfinite(xv)) continue;
      lo = any ? std::min(lo, xv) : xv, hi = any ? std::max(hi, xv) : xv, any = true;
    }
    // kivi_policy.h: spread / 15, floored at magnitude / 1024, rounded up to fp16; zero -lo / scale
    // rounded to fp16, so a code may sit up to |zero| * 2^-11 further from the ideal one.
    const double mag = std::max(std::fabs(lo), std::fabs(hi));
    const double raw = !any || mag == 0 ? 1.0 : std::max((hi - lo) / 15, mag / 1024);
    ASSERT_GE(scale, raw * (1 - 1e-7)) << what;
    ASSERT_LE(scale, raw * (1 + 1.0 / 1024)) << what;
    ASSERT_EQ(double(format::fp16_to_float(format::float_to_fp16(float(scale)))), scale) << what << ": fp16-exact";
    ASSERT_EQ(double(format::fp16_to_float(format::float_to_fp16(float(zero)))), zero) << what << ": fp16-exact";
    const double slack = std::fabs(zero) / 2048 + 1e-4;
    ASSERT_NEAR(zero, -lo / scale, slack) << what;
    for (int j = 0; j < count; ++j) {
      const size_t e = elem(j);
      const double xv = std::isfinite(x[e]) ? x[e] : 0.0;  // non-finite: the code nearest 0
      const double ideal = std::clamp(xv / scale + zero, 0.0, 15.0);
      ASSERT_LE(std::fabs(nibble(codes, e) - ideal), 0.5 + 1e-4) << what << " element " << e;
      if (std::isfinite(x[e])) {
        ASSERT_LE(std::fabs(y[e] - xv), (0.5 + slack) * scale * (1 + 1e-4)) << what << " " << e;
      }
    }
  };
  for (int c = 0; c < d; ++c)
    check_group(k, kd, p.k_codes, p.k_scale[size_t(c)], p.k_zero[size_t(c)], [&](int t) { return size_t(t) * d + c; }, n,
                "K channel");
  for (int t = 0; t < n; ++t)
    check_group(v, vd, p.v_codes, p.v_scale[size_t(t)], p.v_zero[size_t(t)], [&](int i) { return size_t(t) * d + i; }, d,
                "V token");
  EXPECT_LE(p.k_scale[11], 2.5f / 1024 * (1 + 1.f / 1024)) << "a constant channel: the magnitude floor";
  for (int t = 0; t < n; ++t) EXPECT_NEAR(kd[size_t(t) * d + 11], 2.5f, 2.5f / 2048) << "a constant channel";
}

// Per-channel grouping is what K needs: on channels with their own offsets, the K error is far
// below per-token asymmetric grouping of the same rows.
TEST(Kivi, PerChannelKBeatsPerTokenOnOffsetChannels) {
  const int n = 16, d = 64;
  std::mt19937 rng(4);
  std::normal_distribution<float> z(0.f, 1.f);
  std::vector<float> k(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) k[size_t(t) * d + i] = 10.f * float(i % 9) - 40.f + z(rng);
  const KiviPageHead as_k = kivi_quantize(k.data(), k.data(), n, d);  // K per channel, V per token
  std::vector<float> kd(k.size()), vd(k.size());
  kivi_dequantize(as_k, n, d, kd.data(), vd.data());
  double err_channel = 0, err_token = 0;
  for (size_t e = 0; e < k.size(); ++e) {
    err_channel += (double(kd[e]) - k[e]) * (double(kd[e]) - k[e]);
    err_token += (double(vd[e]) - k[e]) * (double(vd[e]) - k[e]);
  }
  EXPECT_LT(err_channel, 0.1 * err_token);
}

// Groups far from zero (large offset, small spread) and groups with nothing finite: the zero point
// stays inside fp16's precise range and nothing decodes to a non-finite value.
TEST(Kivi, PolicyEdgeGroups) {
  KiviRange offset;
  for (float x : {1000.f, 1000.5f, 1001.f}) offset.add(x);
  const KiviParams p = kivi_params(offset);
  EXPECT_LE(std::fabs(p.zero), kKiviZeroBound * (1 + 1.f / 1024));
  for (float x : {1000.f, 1000.5f, 1001.f})
    EXPECT_NEAR(kivi_value(kivi_code(x, p), p), x, p.scale) << x;
  KiviRange none;
  none.add(std::numeric_limits<float>::quiet_NaN());
  none.add(-std::numeric_limits<float>::infinity());
  const KiviParams q = kivi_params(none);
  EXPECT_EQ(q.scale, 1.f);
  EXPECT_EQ(q.zero, 0.f);
  EXPECT_EQ(kivi_value(kivi_code(std::numeric_limits<float>::quiet_NaN(), q), q), 0.f);
  KiviRange huge;  // a spread beyond fp16's largest scale is clamped and counted
  huge.add(-3e38f);
  huge.add(3e38f);
  EXPECT_TRUE(kivi_scale_clamped(huge));
  EXPECT_EQ(kivi_params(huge).scale, kFp16ScaleMax);
  EXPECT_FALSE(kivi_scale_clamped(offset));
}

}  // namespace
}  // namespace kvq::quant
