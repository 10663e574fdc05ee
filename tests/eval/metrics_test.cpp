// Metric functions against direct float64/long-double evaluations of the textbook formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvq/eval/metrics.h"

namespace kvq::eval {
namespace {

std::vector<float> random_logits(std::mt19937& rng, int n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// softmax without the max shift, in long double: a different route to the same numbers (the
// logits used here are small enough not to overflow).
std::vector<long double> naive_softmax(const std::vector<float>& x) {
  long double s = 0;
  for (float v : x) s += std::exp(static_cast<long double>(v));
  std::vector<long double> p(x.size());
  for (size_t i = 0; i < x.size(); ++i) p[i] = std::exp(static_cast<long double>(x[i])) / s;
  return p;
}

TEST(Metrics, NllMatchesNaiveSoftmax) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 50 + trial * 97;
    auto x = random_logits(rng, n, 4.f);
    auto p = naive_softmax(x);
    const int target = static_cast<int>(rng() % n);
    const double want = -static_cast<double>(std::log(p[target]));
    EXPECT_NEAR(token_nll(x.data(), n, target), want, 1e-12 * std::max(1.0, want)) << "trial " << trial;
  }
}

TEST(Metrics, LogSumExpSurvivesLargeLogits) {
  std::vector<float> x = {1000.f, 1000.f, 999.f};
  const double want = 1000.0 + std::log(2.0 + std::exp(-1.0));
  EXPECT_NEAR(log_sum_exp(x.data(), 3), want, 1e-12);
  x[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(log_sum_exp(x.data(), 3)));
}

TEST(Metrics, KlMatchesNaiveSumAndIsNonNegative) {
  std::mt19937 rng(11);
  std::normal_distribution<float> noise(0.f, 0.3f);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1000 + trial * 31;
    auto a = random_logits(rng, n, 3.f);
    auto b = a;
    for (auto& v : b) v += noise(rng);
    auto p = naive_softmax(a), q = naive_softmax(b);
    long double want = 0;
    for (int i = 0; i < n; ++i) want += p[i] * std::log(p[i] / q[i]);
    const double got = kl_divergence(a.data(), b.data(), n);
    EXPECT_NEAR(got, static_cast<double>(want), 1e-12 + 1e-9 * static_cast<double>(want));
    EXPECT_GT(got, 0.0);
    // Not symmetric: KL(q||p) is a different number.
    EXPECT_NE(got, kl_divergence(b.data(), a.data(), n));
  }
}

TEST(Metrics, KlOfIdenticalRowsIsExactlyZero) {
  std::mt19937 rng(3);
  auto a = random_logits(rng, 49152, 5.f);
  EXPECT_EQ(kl_divergence(a.data(), a.data(), 49152), 0.0);
  RowStats s = row_stats(a.data(), 49152);
  RowComparison c = compare_rows(a.data(), s, a.data(), 49152, 17);
  EXPECT_EQ(c.kl, 0.0);
  EXPECT_EQ(c.base_nll, c.spec_nll);
  EXPECT_TRUE(c.top1_agree);
}

TEST(Metrics, KlIgnoresAShiftOfAllLogits) {
  std::mt19937 rng(5);
  auto a = random_logits(rng, 4096, 2.f);
  auto b = a;
  for (auto& v : b) v += 3.25f;  // exactly representable shift: same distribution
  EXPECT_NEAR(kl_divergence(a.data(), b.data(), 4096), 0.0, 1e-12);
}

TEST(Metrics, PerplexityOfUniformIsVocab) {
  for (int vocab : {2, 512, 49152}) {
    std::vector<float> x(vocab, 0.625f);
    const double nll = token_nll(x.data(), vocab, vocab / 3);
    EXPECT_NEAR(nll, std::log(static_cast<double>(vocab)), 1e-12);
    EXPECT_NEAR(perplexity(nll), vocab, 1e-9 * vocab);
  }
}

TEST(Metrics, ArgmaxTakesFirstOnTiesAndSkipsNan) {
  std::vector<float> x = {1.f, 3.f, 2.f, 3.f};
  EXPECT_EQ(argmax(x.data(), 4), 1);
  x[0] = std::numeric_limits<float>::quiet_NaN();
  x[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(argmax(x.data(), 4), 3);
  std::vector<float> neg = {-5.f, -std::numeric_limits<float>::infinity(), -1.f};
  EXPECT_EQ(argmax(neg.data(), 3), 2);
}

TEST(Metrics, CompareRowsAgreesWithSeparateFunctions) {
  std::mt19937 rng(13);
  std::normal_distribution<float> noise(0.f, 0.5f);
  int agree = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 300;
    auto a = random_logits(rng, n, 1.f);
    auto b = a;
    for (auto& v : b) v += noise(rng);
    const int target = static_cast<int>(rng() % n);
    RowComparison c = compare_rows(a.data(), row_stats(a.data(), n), b.data(), n, target);
    EXPECT_NEAR(c.kl, kl_divergence(a.data(), b.data(), n), 1e-13);
    EXPECT_NEAR(c.base_nll, token_nll(a.data(), n, target), 1e-12);
    EXPECT_NEAR(c.spec_nll, token_nll(b.data(), n, target), 1e-12);
    EXPECT_EQ(c.top1_agree, argmax(a.data(), n) == argmax(b.data(), n));
    agree += c.top1_agree;
  }
  // The noise is large enough that both outcomes occur, so the flag is really computed.
  EXPECT_GT(agree, 0);
  EXPECT_LT(agree, 200);
}

TEST(Metrics, AccumulatorMeansAndMerge) {
  Accumulator a, b;
  a.add({1.0, 2.0, 0.5, true});
  a.add({3.0, 4.0, 0.1, false});
  b.add({2.0, 2.0, 0.7, true});
  Accumulator all = a;
  all.merge(b);
  EXPECT_EQ(all.count, 3);
  EXPECT_DOUBLE_EQ(all.base_mean_nll(), 2.0);
  EXPECT_DOUBLE_EQ(all.spec_mean_nll(), 8.0 / 3);
  EXPECT_DOUBLE_EQ(all.mean_kl(), 1.3 / 3);
  EXPECT_DOUBLE_EQ(all.kl_max, 0.7);
  EXPECT_DOUBLE_EQ(all.top1_rate(), 2.0 / 3);
  EXPECT_TRUE(std::isnan(Accumulator{}.mean_kl()));
  // A NaN row must not vanish from the worst case.
  all.add({1.0, 1.0, std::numeric_limits<double>::quiet_NaN(), true});
  all.add({1.0, 1.0, 0.9, true});
  EXPECT_TRUE(std::isnan(all.kl_max));
}

TEST(Metrics, DeltaPpl) {
  EXPECT_NEAR(delta_ppl_pct(10.0, 10.3), 3.0, 1e-12);
  EXPECT_NEAR(delta_ppl_pct(10.0, 9.9), -1.0, 1e-12);
  EXPECT_EQ(delta_ppl_pct(4.0, 4.0), 0.0);
}

}  // namespace
}  // namespace kvq::eval

namespace kvq::eval {
namespace {

RowComparison row(double base_nll, double spec_nll, double kl) {
  RowComparison r;
  r.base_nll = base_nll, r.spec_nll = spec_nll, r.kl = kl;
  return r;
}

TEST(PositionBuckets, EdgesAndNames) {
  const int pos[] = {-1, 0, 255, 256, 1023, 1024, 4095, 4096, 8191, 1 << 20};
  const int want[] = {0, 0, 0, 1, 1, 2, 2, 3, 3, 3};
  for (size_t i = 0; i < std::size(pos); ++i) EXPECT_EQ(position_bucket(pos[i]), want[i]) << "position " << pos[i];
  EXPECT_EQ(position_bucket_name(0), "0-256");
  EXPECT_EQ(position_bucket_name(1), "256-1k");
  EXPECT_EQ(position_bucket_name(2), "1k-4k");
  EXPECT_EQ(position_bucket_name(3), "4k+");
}

// Sums worked out by hand: bucket 0 gets positions 3 and 255, bucket 1 position 256, bucket 3
// positions 4096 and 8000 (added through a merge); bucket 2 stays empty.
TEST(PositionBuckets, MatchHandComputedMeans) {
  PositionBuckets a, b;
  a.add(3, row(2.0, 2.5, 0.01));
  a.add(255, row(1.0, 1.1, 0.03));
  a.add(256, row(4.0, 3.0, 0.2));
  b.add(4096, row(0.5, 0.75, 0.004));
  b.add(8000, row(1.5, 1.25, 0.002));
  a.merge(b);
  const auto r = a.results();
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].predictions, 2);
  EXPECT_NEAR(r[0].kl_mean, 0.02, 1e-15);
  EXPECT_NEAR(r[0].kl_max, 0.03, 1e-15);
  EXPECT_NEAR(r[0].nll_delta, (0.5 + 0.1) / 2, 1e-15);
  EXPECT_EQ(r[1].predictions, 1);
  EXPECT_NEAR(r[1].kl_mean, 0.2, 1e-15);
  EXPECT_NEAR(r[1].nll_delta, -1.0, 1e-15);
  EXPECT_EQ(r[2].predictions, 0);
  EXPECT_TRUE(std::isnan(r[2].kl_mean));
  EXPECT_TRUE(std::isnan(r[2].nll_delta));
  EXPECT_TRUE(std::isnan(r[2].kl_max));
  EXPECT_EQ(r[3].predictions, 2);
  EXPECT_NEAR(r[3].kl_mean, 0.003, 1e-15);
  EXPECT_NEAR(r[3].kl_max, 0.004, 1e-15);
  EXPECT_NEAR(r[3].nll_delta, 0.0, 1e-15);
  EXPECT_EQ(r[0].begin, 0);
  EXPECT_EQ(r[1].end, 1024);
  EXPECT_EQ(r[3].end, -1);
}

// Over random rows, the buckets partition the positions: counts and count-weighted KL / NLL
// sums add up to the whole-window accumulator's.
TEST(PositionBuckets, PartitionTheWindow) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.0, 3.0);
  PositionBuckets pb;
  Accumulator all;
  for (int p = 0; p < 5000; p += 1 + static_cast<int>(rng() % 7)) {
    const RowComparison r = row(u(rng), u(rng), u(rng) * 1e-3);
    pb.add(p, r);
    all.add(r);
  }
  int64_t n = 0;
  double kl = 0, dnll = 0;
  for (const auto& b : pb.results()) {
    ASSERT_GT(b.predictions, 0) << b.name;
    n += b.predictions;
    kl += b.kl_mean * static_cast<double>(b.predictions);
    dnll += b.nll_delta * static_cast<double>(b.predictions);
  }
  EXPECT_EQ(n, all.count);
  EXPECT_NEAR(kl, all.kl_sum, 1e-9 * all.kl_sum);
  EXPECT_NEAR(dnll, all.spec_nll_sum - all.base_nll_sum, 1e-9 * all.base_nll_sum);
}

}  // namespace
}  // namespace kvq::eval
