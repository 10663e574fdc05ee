// CPU attention over a per-layer mix in which K and V of a layer use different formats: decode and
// prefill against float64 attention over the values as stored (tight: a wrong format for either
// plane shows at once) and over the original values (the formats' own budgets).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kvq/attention/bind.h"
#include "kvq/attention/cpu.h"
#include "testing/attention_testing.h"

namespace kvq::attention {
namespace {

struct Mix {
  Format k, v;
};

class CpuMixedKv : public ::testing::TestWithParam<ScaleGranularity> {};

TEST_P(CpuMixedKv, DecodeAndPrefillMatchFloat64) {
  const std::vector<Mix> layers = {{Format::kInt8, Format::kFp8E4m3},
                                   {Format::kBf16, Format::kInt8},
                                   {Format::kFp8E4m3Fnuz, Format::kBf16},
                                   {Format::kInt4, Format::kInt8}};
  SyntheticCacheOptions o;
  o.spec.granularity = GetParam();
  o.spec.sink_tokens = 16;
  for (const Mix& m : layers) o.spec.plane_formats.insert(o.spec.plane_formats.end(), {m.k, m.v});
  o.spec.format = o.spec.plane_formats.front();
  o.num_layers = static_cast<int>(layers.size());
  o.kv.num_kv_heads = 2;
  o.kv.head_dim = 64;
  o.seq_lens = {3, 33, 100, 190};
  o.seed = 99;
  auto built = build_synthetic_cache(o);
  ASSERT_TRUE(built.is_ok()) << built.status().to_string();
  SyntheticCache& sc = built.value();
  cache::PagedKvCache& kv = *sc.cache;
  ASSERT_TRUE(testing::tables_scrambled(kv, sc.seqs));

  const int hq = 4, d = 64, hk = 2;
  const float scale = 0.125f;
  const DenseShape shape_of{0, hk, hq, d};
  std::mt19937_64 rng(5);
  for (int l = 0; l < o.num_layers; ++l) {
    const double budget = std::max(testing::attention_error_budget(layers[l].k, o.spec.granularity),
                                   testing::attention_error_budget(layers[l].v, o.spec.granularity));
    // Decode: every sequence at once.
    std::vector<float> q(sc.seqs.size() * hq * d), out(q.size());
    sample_queries(sc.profiles[l], hq, static_cast<int>(sc.seqs.size()), scale, 2.f, rng, q.data());
    const auto tables = kv.batch_tables(sc.seqs);
    ASSERT_TRUE(cpu::decode(bind_decode(kv, l, tables, q.data(), out.data(), hq, scale)).is_ok());
    for (size_t s = 0; s < sc.seqs.size(); ++s) {
      std::vector<float> ks, vs;
      ASSERT_TRUE(testing::read_back_sequence(kv, sc.seqs[s], l, ks, vs).is_ok());
      DenseShape sh = shape_of;
      sh.n_tokens = kv.seq_len(sc.seqs[s]);
      std::vector<double> stored(hq * d), original(hq * d);
      const float* qs = q.data() + s * hq * d;
      ASSERT_TRUE(reference_attention(sh, ks.data(), vs.data(), qs, 1, sh.n_tokens - 1, scale, stored.data(), nullptr).is_ok());
      ASSERT_TRUE(reference_attention(sh, sc.k[l][s].data(), sc.v[l][s].data(), qs, 1, sh.n_tokens - 1, scale,
                                      original.data(), nullptr).is_ok());
      const float* os = out.data() + s * hq * d;
      EXPECT_LT(testing::relative_l2(os, stored.data(), stored.size()), 1e-5) << "layer " << l << " seq " << s;
      EXPECT_LT(testing::relative_l2(os, original.data(), original.size()), budget) << "layer " << l << " seq " << s;
    }
    // Prefill: the last 9 tokens of the longest sequence.
    const size_t last = sc.seqs.size() - 1;
    const int len = kv.seq_len(sc.seqs[last]), nq = 9;
    std::vector<float> pq(static_cast<size_t>(nq) * hq * d), pout(pq.size());
    sample_queries(sc.profiles[l], hq, nq, scale, 2.f, rng, pq.data());
    const auto one = kv.batch_tables({sc.seqs[last]});
    ASSERT_TRUE(cpu::prefill(bind_prefill(kv, l, one, pq.data(), pout.data(), nq, len - nq, hq, scale)).is_ok());
    std::vector<float> ks, vs;
    ASSERT_TRUE(testing::read_back_sequence(kv, sc.seqs[last], l, ks, vs).is_ok());
    DenseShape sh = shape_of;
    sh.n_tokens = len;
    std::vector<double> stored(pq.size());
    ASSERT_TRUE(reference_attention(sh, ks.data(), vs.data(), pq.data(), nq, len - nq, scale, stored.data(), nullptr).is_ok());
    EXPECT_LT(testing::relative_l2(pout.data(), stored.data(), stored.size()), 1e-5) << "prefill layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Granularities, CpuMixedKv,
                         ::testing::Values(ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead));

}  // namespace
}  // namespace kvq::attention
