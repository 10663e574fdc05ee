// CPU decode and prefill over the sampled sweep (testing/cases.h), each case checked two ways:
//  - tight: against float64 attention over the values *as stored* (read back from the cache), which
//    isolates the backend from quantization: only float32 rounding may differ;
//  - budget: against float64 attention over the *original* values, which bounds the end-to-end
//    error a format x granularity costs (testing/attention_testing.h explains the budgets).
// Every case also poisons all cache memory no sequence owns, checks the cache is unchanged
// afterwards and that the output buffers were written exactly (guards).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvq/attention/bind.h"
#include "kvq/attention/cpu.h"
#include "testing/attention_testing.h"
#include "testing/cases.h"

namespace kvq::attention {
namespace {

using testing::AttnCase;
using testing::GuardedBuffer;

// float32 accumulation vs float64 over the same stored values, head_dim <= 256, logits of a few
// units: observed <= 2e-6 relative; 3e-5 leaves room without hiding a wrong token or scale
// (those are >= 1e-3).
constexpr double kStoredTolerance = 3e-5;
constexpr double kLseTolerance = 1e-4;  // absolute, LSE values are O(10)

struct Built {
  SyntheticCache sc;
  std::vector<cache::PagedKvCache::Planes> before;
};

Built build(const AttnCase& c) {
  Built b;
  auto r = build_synthetic_cache(c.cache_options());
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  if (!r.is_ok()) return b;
  b.sc = std::move(r).value();
  EXPECT_TRUE(testing::poison_unowned(*b.sc.cache, b.sc.seqs).is_ok());
  b.before = testing::snapshot(*b.sc.cache);
  return b;
}

class CpuSweep : public ::testing::TestWithParam<AttnCase> {};

TEST_P(CpuSweep, DecodeMatchesFloat64) {
  const AttnCase& c = GetParam();
  Built b = build(c);
  ASSERT_TRUE(b.sc.cache);
  cache::PagedKvCache& kv = *b.sc.cache;
  const int n_seqs = static_cast<int>(b.sc.seqs.size()), hq = c.num_q_heads(), d = c.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::mt19937_64 rng(c.seed + 7);
  std::vector<float> q(static_cast<size_t>(n_seqs) * hq * d);
  sample_queries(b.sc.profiles[0], hq, n_seqs, scale, 2.f, rng, q.data());

  const auto tables = kv.batch_tables(b.sc.seqs);
  GuardedBuffer out(q.size()), lse(static_cast<size_t>(n_seqs) * hq);
  const DecodeArgs args = bind_decode(kv, 0, tables, q.data(), out.data(), hq, scale, lse.data());
  ASSERT_TRUE(cpu::can_implement(args).is_ok()) << cpu::can_implement(args).to_string();
  ASSERT_TRUE(cpu::decode(args).is_ok());
  EXPECT_TRUE(out.guards_intact() && lse.guards_intact()) << "decode wrote outside its outputs";
  EXPECT_TRUE(out.fully_written() && lse.fully_written()) << "decode left outputs unwritten";
  ASSERT_TRUE(testing::all_finite(out.data(), out.size())) << "non-finite output: a poisoned (unowned) element was read";
  EXPECT_TRUE(testing::same_planes(b.before, testing::snapshot(kv))) << "decode modified the cache";

  double err_num = 0, err_den = 0;
  const DenseShape base{0, c.num_kv_heads, hq, d};
  for (int s = 0; s < n_seqs; ++s) {
    const int len = kv.seq_len(b.sc.seqs[s]);
    DenseShape shape = base;
    shape.n_tokens = len;
    const float* qs = q.data() + static_cast<size_t>(s) * hq * d;
    const float* os = out.data() + static_cast<size_t>(s) * hq * d;
    std::vector<float> ks, vs;
    ASSERT_TRUE(testing::read_back_sequence(kv, b.sc.seqs[s], 0, ks, vs).is_ok());
    std::vector<double> ref(static_cast<size_t>(hq) * d), ref_lse(hq);
    ASSERT_TRUE(reference_attention(shape, ks.data(), vs.data(), qs, 1, len - 1, scale, ref.data(), ref_lse.data()).is_ok());
    EXPECT_LT(testing::relative_l2(os, ref.data(), ref.size()), kStoredTolerance) << "seq " << s << " len " << len;
    EXPECT_LT(testing::max_abs_diff(lse.data() + static_cast<size_t>(s) * hq, ref_lse.data(), hq), kLseTolerance)
        << "seq " << s << " len " << len;

    const auto& k0 = b.sc.k[0][s];
    const auto& v0 = b.sc.v[0][s];
    ASSERT_TRUE(reference_attention(shape, k0.data(), v0.data(), qs, 1, len - 1, scale, ref.data(), nullptr).is_ok());
    for (size_t i = 0; i < ref.size(); ++i) {
      err_num += (os[i] - ref[i]) * (os[i] - ref[i]);
      err_den += ref[i] * ref[i];
    }
  }
  const double err = std::sqrt(err_num / err_den);
  RecordProperty("rel_l2_vs_original", std::to_string(err));
  EXPECT_LT(err, testing::attention_error_budget(c.format, c.granularity));
}

TEST_P(CpuSweep, PrefillMatchesFloat64) {
  const AttnCase& c = GetParam();
  Built b = build(c);
  ASSERT_TRUE(b.sc.cache);
  cache::PagedKvCache& kv = *b.sc.cache;
  const int hq = c.num_q_heads(), d = c.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::mt19937_64 rng(c.seed + 11);
  double err_num = 0, err_den = 0;
  for (size_t s = 0; s < b.sc.seqs.size(); ++s) {
    const cache::SeqId id = b.sc.seqs[s];
    const int len = kv.seq_len(id);
    // A trailing chunk (chunked prefill over a cached prefix), and the whole prompt when short.
    std::vector<std::pair<int, int>> chunks = {{len - std::min(len, 9), std::min(len, 9)}};
    if (len <= 64 && len > 9) chunks.push_back({0, len});
    const auto tables = kv.batch_tables({id});
    std::vector<float> ks, vs;
    ASSERT_TRUE(testing::read_back_sequence(kv, id, 0, ks, vs).is_ok());
    for (auto [pos0, n_q] : chunks) {
      std::vector<float> q(static_cast<size_t>(n_q) * hq * d);
      sample_queries(b.sc.profiles[0], hq, n_q, scale, 2.f, rng, q.data());
      GuardedBuffer out(q.size()), lse(static_cast<size_t>(n_q) * hq);
      const PrefillArgs args = bind_prefill(kv, 0, tables, q.data(), out.data(), n_q, pos0, hq, scale, lse.data());
      ASSERT_TRUE(cpu::prefill(args).is_ok()) << cpu::can_implement(args).to_string();
      EXPECT_TRUE(out.guards_intact() && lse.guards_intact() && out.fully_written() && lse.fully_written());
      ASSERT_TRUE(testing::all_finite(out.data(), out.size())) << "seq " << s << ": poisoned element read";

      const DenseShape shape{len, c.num_kv_heads, hq, d};
      std::vector<double> ref(q.size()), ref_lse(lse.size());
      ASSERT_TRUE(reference_attention(shape, ks.data(), vs.data(), q.data(), n_q, pos0, scale, ref.data(), ref_lse.data()).is_ok());
      EXPECT_LT(testing::relative_l2(out.data(), ref.data(), ref.size()), kStoredTolerance)
          << "seq " << s << " len " << len << " chunk [" << pos0 << ", " << pos0 + n_q << ")";
      EXPECT_LT(testing::max_abs_diff(lse.data(), ref_lse.data(), ref_lse.size()), kLseTolerance);

      ASSERT_TRUE(reference_attention(shape, b.sc.k[0][s].data(), b.sc.v[0][s].data(), q.data(), n_q, pos0, scale,
                                      ref.data(), nullptr).is_ok());
      for (size_t i = 0; i < ref.size(); ++i) {
        err_num += (out.data()[i] - ref[i]) * (out.data()[i] - ref[i]);
        err_den += ref[i] * ref[i];
      }
    }
  }
  EXPECT_TRUE(testing::same_planes(b.before, testing::snapshot(kv))) << "prefill modified the cache";
  const double err = std::sqrt(err_num / err_den);
  RecordProperty("rel_l2_vs_original", std::to_string(err));
  EXPECT_LT(err, testing::attention_error_budget(c.format, c.granularity));
}

INSTANTIATE_TEST_SUITE_P(Sweep, CpuSweep, ::testing::ValuesIn(testing::sampled_sweep()),
                         [](const ::testing::TestParamInfo<AttnCase>& info) { return info.param.name(); });

}  // namespace
}  // namespace kvq::attention
