// KIVI's page-head quantizer (quant/kivi.h) against float64: K grouped per channel, V per token,
// both asymmetric 0..15 with zero points.
#include "kvq/quant/kivi.h"

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
    const double want_scale = hi > lo ? (hi - lo) / 15 : 1.0;
    ASSERT_NEAR(scale, want_scale, want_scale * 1e-6) << what;
    ASSERT_NEAR(zero, -lo / scale, 1e-4 * std::max(1.0, std::fabs(lo / scale))) << what;
    for (int j = 0; j < count; ++j) {
      const size_t e = elem(j);
      const double xv = std::isfinite(x[e]) ? x[e] : 0.0;  // non-finite: the code nearest 0
      const double ideal = std::clamp(xv / scale + zero, 0.0, 15.0);
      ASSERT_LE(std::fabs(nibble(codes, e) - ideal), 0.5 + 1e-4) << what << " element " << e;
      if (std::isfinite(x[e]) && hi > lo) {
        ASSERT_LE(std::fabs(y[e] - xv), 0.5 * scale * (1 + 1e-4)) << what << " " << e;
      }
    }
  };
  for (int c = 0; c < d; ++c)
    check_group(k, kd, p.k_codes, p.k_scale[size_t(c)], p.k_zero[size_t(c)], [&](int t) { return size_t(t) * d + c; }, n,
                "K channel");
  for (int t = 0; t < n; ++t)
    check_group(v, vd, p.v_codes, p.v_scale[size_t(t)], p.v_zero[size_t(t)], [&](int i) { return size_t(t) * d + i; }, d,
                "V token");
  EXPECT_EQ(p.k_scale[11], 1.f);
  for (int t = 0; t < n; ++t) EXPECT_NEAR(kd[size_t(t) * d + 11], 2.5f, 1e-6f) << "a constant channel decodes exactly";
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

}  // namespace
}  // namespace kvq::quant
