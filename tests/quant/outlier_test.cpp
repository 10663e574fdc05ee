// The outlier-aware int4 page-head quantizer (quant/outlier.h) against a float64 reference that
// picks the outliers, the scales and the codes on its own.
#include "kvq/quant/outlier.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kvq/format/bf16.h"
#include "kvq/quant/quantize.h"

namespace kvq::quant {
namespace {

// Page head rows with a few heavy channels and rare spikes anywhere.
std::vector<float> heavy_rows(std::mt19937& rng, int n, int d) {
  std::normal_distribution<float> z(0.f, 1.f);
  std::uniform_real_distribution<float> spike(8.f, 40.f);
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<float> x(static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      float v = z(rng) * (i % 16 == 3 ? 6.f : 1.f);
      if (pick(rng) < 4) v *= spike(rng);
      x[static_cast<size_t>(t) * d + i] = v;
    }
  return x;
}

int nibble(uint8_t b, int hi) {
  const int v = hi ? b / 16 : b % 16;
  return v >= 8 ? v - 16 : v;
}

TEST(ChannelStats, ThresholdIsAMultipleOfTheRunningRms) {
  ChannelStats s(3);
  std::vector<float> rows;
  for (int t = 0; t < 20; ++t) rows.insert(rows.end(), {float(t), -2.f, std::numeric_limits<float>::quiet_NaN()});
  s.update(rows.data(), 10);
  EXPECT_TRUE(std::isinf(s.threshold(0))) << "10 values: still warming up";
  s.update(rows.data() + 30, 10);
  double sq = 0;
  for (int t = 0; t < 20; ++t) sq += double(t) * t;
  EXPECT_FLOAT_EQ(s.threshold(0), float(kOutlierRmsMultiple * std::sqrt(sq / 20)));
  EXPECT_FLOAT_EQ(s.threshold(1), float(kOutlierRmsMultiple * 2.0));
  EXPECT_TRUE(std::isinf(s.threshold(2))) << "NaN values are not counted";
}

class PageHead : public ::testing::TestWithParam<int> {};  // capacity

TEST_P(PageHead, MatchesFloat64Reference) {
  const int capacity = GetParam(), n = 16, d = 64;
  std::mt19937 rng(91 + capacity);
  std::vector<float> x = heavy_rows(rng, n, d);
  x[5] = std::numeric_limits<float>::infinity();
  x[77] = std::numeric_limits<float>::quiet_NaN();
  x[300] = 1e6f;  // beyond fp16: kept saturated while there is room
  std::vector<float> thr(d);
  for (int i = 0; i < d; ++i) thr[i] = i % 16 == 3 ? 24.f : 4.f;

  std::vector<uint8_t> codes(size_t(n) * d / 2);
  std::vector<float> scales(n);
  std::vector<OutlierEntry> entries;
  const OutlierStats st = quantize_page_head(x.data(), n, d, thr.data(), capacity, codes.data(), scales.data(), &entries);

  // Reference: a value is a candidate beyond min(its channel's threshold, the head's: the RMS of
  // all thresholds); rows in slot order take candidates by |x| descending (stable), row t at most
  // ceil(free / rows left) of them. Overflowed candidates are ordinary values.
  double head_sq = 0;
  for (int i = 0; i < d; ++i) head_sq += double(thr[i]) * thr[i];
  const double head = std::sqrt(head_sq / d);
  std::vector<int> role(size_t(n) * d, 0);  // 0 ordinary, 1 kept
  std::vector<int> cand_all, kept_elems;
  for (int t = 0; t < n; ++t) {
    std::vector<int> cand;
    for (int i = 0; i < d; ++i) {
      const int e = t * d + i;
      if (std::isfinite(x[e]) && std::fabs(double(x[e])) > std::min(double(thr[i]), head)) cand.push_back(e);
    }
    std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return std::fabs(double(x[a])) > std::fabs(double(x[b])); });
    const int free_entries = capacity - int(kept_elems.size()), rows_left = n - t;
    const int share = free_entries > 0 ? (free_entries + rows_left - 1) / rows_left : 0;
    const size_t row_start = kept_elems.size();
    for (size_t j = 0; j < cand.size(); ++j) {
      if (int(j) < share) {
        role[size_t(cand[j])] = 1;
        kept_elems.push_back(cand[j]);
      }
      cand_all.push_back(cand[j]);
    }
    std::sort(kept_elems.begin() + std::ptrdiff_t(row_start), kept_elems.end());  // a row's entries by channel
  }
  const size_t kept = kept_elems.size();
  const std::vector<int>& cand = cand_all;
  ASSERT_GT(cand.size(), 16u) << "the data should have more outliers than the smaller capacities";
  EXPECT_EQ(st.outliers, kept);
  EXPECT_EQ(st.overflowed, cand.size() - kept);
  EXPECT_EQ(st.nonfinite, 2u);
  EXPECT_EQ(st.values, uint64_t(n) * d);
  ASSERT_EQ(entries.size(), kept);
  for (size_t i = 0; i < kept; ++i) EXPECT_EQ(entries[i].index, kept_elems[i]) << "slot order, then channel order";

  uint64_t clipped = 0;
  for (int t = 0; t < n; ++t) {
    double amax = 0;
    for (int i = 0; i < d; ++i) {
      const size_t e = size_t(t) * d + i;
      if (role[e] == 0 && std::isfinite(x[e])) amax = std::max(amax, std::fabs(double(x[e])));
    }
    const double scale = scales[t];
    ASSERT_EQ(scale, double(float(amax / 7.0))) << "row " << t << ": the scale comes from the inliers";
    for (int i = 0; i < d; ++i) {
      const size_t e = size_t(t) * d + i;
      const int q = nibble(codes[e / 2], int(e % 2));
      if (role[e] == 1 || !std::isfinite(x[e])) {
        EXPECT_EQ(q, 0) << e;
        continue;
      }
      const double want = x[e] / scale;
      clipped += std::fabs(want) >= 7.5;
      ASSERT_LE(std::fabs(q - std::clamp(want, -7.0, 7.0)), 0.5 + 1e-5) << e;
    }
  }
  EXPECT_EQ(st.clipped, clipped);
  EXPECT_EQ(clipped, 0u) << "every value that is not an entry is inside its row's range";

  std::vector<float> y(size_t(n) * d);
  for (int t = 0; t < n; ++t) dequantize_row(Format::kInt4, codes.data() + size_t(t) * d / 2, d, scales[t], y.data() + size_t(t) * d);
  apply_outliers(entries.data(), int(entries.size()), n, d, y.data());
  for (size_t i = 0; i < entries.size(); ++i) {
    const OutlierEntry back = unpack_outlier(pack_outlier(entries[i]));
    EXPECT_TRUE(back.index == entries[i].index && back.value == entries[i].value);
  }
  for (int e = 0; e < n * d; ++e) {
    if (role[size_t(e)] != 1) continue;
    const double want = std::clamp(double(x[e]), -65504.0, 65504.0);
    EXPECT_LE(std::fabs(y[e] - want), std::fabs(want) * std::ldexp(1.0, -11)) << "fp16 keeps the outlier: " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Capacities, PageHead, ::testing::Values(0, 8, 16, 1000));

// What it is for: on rows with spikes, the error is far below plain per-token int4's.
TEST(PageHeadAccuracy, BeatsPlainInt4OnSpikyRows) {
  const int n = 16, d = 64;
  std::mt19937 rng(7);
  double plain = 0, sparse = 0;
  for (int rep = 0; rep < 20; ++rep) {
    const std::vector<float> x = heavy_rows(rng, n, d);
    ChannelStats stats(d);
    stats.update(x.data(), n);
    std::vector<float> thr(d);
    for (int i = 0; i < d; ++i) thr[i] = stats.threshold(i);
    std::vector<uint8_t> codes(size_t(n) * d / 2);
    std::vector<float> scales(n), y(size_t(n) * d), yp(size_t(n) * d);
    std::vector<OutlierEntry> entries;
    quantize_page_head(x.data(), n, d, thr.data(), n * kOutlierEntriesPerToken, codes.data(), scales.data(), &entries);
    for (int t = 0; t < n; ++t)
      dequantize_row(Format::kInt4, codes.data() + size_t(t) * d / 2, d, scales[t], y.data() + size_t(t) * d);
    apply_outliers(entries.data(), int(entries.size()), n, d, y.data());
    for (int t = 0; t < n; ++t) {
      const float* row = x.data() + size_t(t) * d;
      const float s = scale_for_amax(Format::kInt4, finite_amax(row, d));
      std::vector<uint8_t> c(d / 2);
      quantize_row(Format::kInt4, row, d, s, c.data(), nullptr);
      dequantize_row(Format::kInt4, c.data(), d, s, yp.data() + size_t(t) * d);
    }
    for (size_t e = 0; e < x.size(); ++e) {
      sparse += (double(y[e]) - x[e]) * (double(y[e]) - x[e]);
      plain += (double(yp[e]) - x[e]) * (double(yp[e]) - x[e]);
    }
  }
  std::printf("page-head int4 squared error: plain %.4g, with outliers %.4g (%.2fx)\n", plain, sparse, plain / sparse);
  EXPECT_LT(sparse, 0.8 * plain);
}

}  // namespace
}  // namespace kvq::quant
