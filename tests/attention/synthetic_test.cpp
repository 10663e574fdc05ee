// The test infrastructure itself: the float64 reference against closed forms, the heavy-tailed
// generator's statistics, and the cache builder's scrambling.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvq/attention/reference.h"
#include "kvq/attention/synthetic.h"
#include "testing/attention_testing.h"

namespace kvq::attention {
namespace {

TEST(Reference, SingleTokenReturnsItsValue) {
  const DenseShape s{1, 1, 2, 4};
  const std::vector<float> k = {1, 2, 3, 4}, v = {-1, 0.5f, 2, 8}, q = {1, 0, 0, 0, 0, 1, 0, 0};
  std::vector<double> out(8), lse(2);
  ASSERT_TRUE(reference_attention(s, k.data(), v.data(), q.data(), 1, 0, 0.5, out.data(), lse.data()).is_ok());
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(out[h * 4 + c], v[c]);
  EXPECT_DOUBLE_EQ(lse[0], 0.5);  // 0.5 * q.k = 0.5 * 1
  EXPECT_DOUBLE_EQ(lse[1], 1.0);  // 0.5 * 2
}

TEST(Reference, TwoTokensClosedFormAndCausality) {
  // Logits 0 and log(3): weights 1/4 and 3/4.
  const DenseShape s{2, 1, 1, 2};
  const float l3 = static_cast<float>(std::log(3.0));
  const std::vector<float> k = {0, 0, l3, 0}, v = {4, 0, 0, 8}, q = {1, 0, 1, 0};
  std::vector<double> out(4), lse(2);
  ASSERT_TRUE(reference_attention(s, k.data(), v.data(), q.data(), 2, 0, 1.0, out.data(), lse.data()).is_ok());
  EXPECT_DOUBLE_EQ(out[0], 4);  // query 0 sees token 0 only
  EXPECT_DOUBLE_EQ(out[1], 0);
  EXPECT_NEAR(out[2], 1.0, 1e-7);
  EXPECT_NEAR(out[3], 6.0, 1e-6);
  EXPECT_NEAR(lse[1], std::log(1.0 + 3.0), 1e-7);
}

TEST(Reference, GqaMapsQueryHeadsToTheirKvHead) {
  // Two kv heads with different values, four q heads: heads 0-1 read kv 0, heads 2-3 kv 1.
  const DenseShape s{1, 2, 4, 1};
  const std::vector<float> k = {1, 1}, v = {10, 20}, q = {1, 1, 1, 1};
  std::vector<double> out(4);
  ASSERT_TRUE(reference_attention(s, k.data(), v.data(), q.data(), 1, 0, 1.0, out.data(), nullptr).is_ok());
  EXPECT_EQ(out, (std::vector<double>{10, 10, 20, 20}));
}

TEST(Reference, RejectsBadShapes) {
  const std::vector<float> x(16, 1.f);
  std::vector<double> out(16);
  EXPECT_FALSE(reference_attention({4, 2, 3, 2}, x.data(), x.data(), x.data(), 1, 3, 1, out.data(), nullptr).is_ok());
  EXPECT_FALSE(reference_attention({4, 1, 1, 2}, x.data(), x.data(), x.data(), 2, 3, 1, out.data(), nullptr).is_ok());
}

TEST(Synthetic, ProfileHasTheRequestedOutlierChannels) {
  HeavyTailOptions o;
  o.num_kv_heads = 4;
  o.head_dim = 64;
  auto p = make_kv_profile(o, 3);
  ASSERT_TRUE(p.is_ok());
  for (int h = 0; h < 4; ++h) {
    int k_out = 0, v_out = 0;
    for (int c = 0; c < 64; ++c) {
      const float kg = p->k_gain[h * 64 + c], vg = p->v_gain[h * 64 + c];
      if (kg != 1.f) {
        ++k_out;
        EXPECT_TRUE(kg >= 20.f && kg <= 100.f) << kg;
      }
      if (vg != 1.f) {
        ++v_out;
        EXPECT_TRUE(vg >= 2.f && vg <= 5.f) << vg;
      }
    }
    EXPECT_EQ(k_out, 4);
    EXPECT_EQ(v_out, 2);
  }
  HeavyTailOptions bad = o;
  bad.k_outlier_min = 200.f;
  EXPECT_FALSE(make_kv_profile(bad, 3).is_ok());
}

TEST(Synthetic, SamplesFollowTheProfile) {
  HeavyTailOptions o;
  o.num_kv_heads = 2;
  o.head_dim = 32;
  auto p = make_kv_profile(o, 5);
  ASSERT_TRUE(p.is_ok());
  const int n = 4000, row = 64;
  std::vector<float> k(n * row), v(n * row);
  std::mt19937_64 rng(1);
  sample_kv(p.value(), n, rng, k.data(), v.data());
  for (int c = 0; c < row; ++c) {
    double mean = 0, sq = 0;
    for (int t = 0; t < n; ++t) mean += k[t * row + c];
    mean /= n;
    for (int t = 0; t < n; ++t) sq += (k[t * row + c] - mean) * (k[t * row + c] - mean);
    const double sd = std::sqrt(sq / n);
    EXPECT_NEAR(sd / p->k_gain[c], 1.0, 0.06) << c;
    EXPECT_NEAR(mean / p->k_gain[c], p->k_mean[c], 0.06) << c;
  }
  // Queries: the logits' spread over tokens is close to the requested one.
  const float scale = 1.f / std::sqrt(32.f);
  std::vector<float> q(4 * 32);
  sample_queries(p.value(), 4, 1, scale, 2.f, rng, q.data());
  double spread = 0;
  for (int h = 0; h < 4; ++h) {
    const int g = h / 2;
    std::vector<double> lg(n);
    double m = 0;
    for (int t = 0; t < n; ++t) {
      double acc = 0;
      for (int c = 0; c < 32; ++c) acc += q[h * 32 + c] * k[t * row + g * 32 + c];
      lg[t] = scale * acc;
      m += lg[t] / n;
    }
    double var = 0;
    for (double x : lg) var += (x - m) * (x - m) / n;
    spread += std::sqrt(var) / 4;
  }
  EXPECT_GT(spread, 1.0);  // one random q: loose bounds around the target 2
  EXPECT_LT(spread, 4.0);
}

TEST(Synthetic, BuilderScramblesPagesAndLeavesHoles) {
  SyntheticCacheOptions o;
  o.spec.format = Format::kInt8;
  o.spec.block_size = 16;
  o.spec.sink_tokens = 32;
  o.kv.num_kv_heads = 2;
  o.kv.head_dim = 16;
  o.seq_lens = {1, 16, 32, 33, 100, 200, 65};
  o.seed = 8;
  auto r = build_synthetic_cache(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const cache::PagedKvCache& c = *r->cache;
  EXPECT_TRUE(testing::tables_scrambled(c, r->seqs));
  int max_used = -1, holes = 0;
  for (cache::SeqId s : r->seqs) {
    for (int32_t p : c.block_table(s)) max_used = std::max(max_used, static_cast<int>(p));
  }
  for (int p = 0; p < max_used; ++p) holes += c.pool().refcount(p) == 0;
  EXPECT_GT(holes, 0) << "no free page between live ones";
  for (size_t s = 0; s < r->seqs.size(); ++s) {
    EXPECT_EQ(c.seq_len(r->seqs[s]), o.seq_lens[s]);
    EXPECT_EQ(c.sink_len(r->seqs[s]), std::min(o.seq_lens[s], 32));
    // What the cache returns is close to what was written (int8 per token: within half a step).
    std::vector<float> k, v;
    ASSERT_TRUE(testing::read_back_sequence(c, r->seqs[s], 0, k, v).is_ok());
    EXPECT_LT(testing::relative_l2(k.data(), r->k[0][s].data(), k.size()), 0.02);
  }
}

}  // namespace
}  // namespace kvq::attention
