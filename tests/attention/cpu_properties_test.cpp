// Properties of the CPU backend that the sweep does not pin down: the sink/quantized LSE merge is
// exact, page placement and batch composition do not change results, and the canaries used by
// every attention test really catch a wrong read.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/attention/bind.h"
#include "kvq/attention/cpu.h"
#include "testing/attention_testing.h"

namespace kvq::attention {
namespace {

using testing::GuardedBuffer;

SyntheticCacheOptions small_options(Format f, int sink, bool shuffle) {
  SyntheticCacheOptions o;
  o.spec.format = f;
  o.spec.granularity = ScaleGranularity::kPerTokenHead;
  o.spec.block_size = 16;
  o.spec.sink_tokens = sink;
  o.kv.num_kv_heads = 2;
  o.kv.head_dim = 64;
  o.seq_lens = {1, 16, 31, 32, 33, 47, 100, 257};
  o.seed = 42;
  o.shuffle = shuffle;
  return o;
}

struct DecodeRun {
  std::vector<float> out, lse;
};

DecodeRun run_decode(cache::PagedKvCache& kv, const std::vector<cache::SeqId>& seqs, const std::vector<float>& q,
                     int hq, float scale) {
  DecodeRun r;
  r.out.assign(q.size(), 0.f);
  r.lse.assign(seqs.size() * hq, 0.f);
  const auto tables = kv.batch_tables(seqs);
  const Status st = cpu::decode(bind_decode(kv, 0, tables, q.data(), r.out.data(), hq, scale, r.lse.data()));
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return r;
}

std::vector<float> queries(const KvProfile& p, int hq, int n, float scale, uint64_t seed) {
  std::vector<float> q(static_cast<size_t>(n) * hq * p.head_dim);
  std::mt19937_64 rng(seed);
  sample_queries(p, hq, n, scale, 2.f, rng, q.data());
  return q;
}

// bf16 values are stored identically in the sink and in bf16 pages, so moving the first 32 tokens
// into the sink changes only float rounding: the two-part softmax with its LSE merge must equal the
// single softmax over the whole sequence.
TEST(CpuAttention, SinkMergeEqualsSingleSoftmax) {
  const int hq = 8;
  const float scale = 0.125f;
  auto whole = build_synthetic_cache(small_options(Format::kBf16, 0, true));
  auto split = build_synthetic_cache(small_options(Format::kBf16, 32, true));
  ASSERT_TRUE(whole.is_ok() && split.is_ok()) << whole.status().to_string() << split.status().to_string();
  ASSERT_EQ(whole->k[0][6], split->k[0][6]) << "same seed must give the same data";
  const auto q = queries(whole->profiles[0], hq, 8, scale, 5);
  const DecodeRun a = run_decode(*whole->cache, whole->seqs, q, hq, scale);
  const DecodeRun b = run_decode(*split->cache, split->seqs, q, hq, scale);
  EXPECT_EQ(split->cache->sink_len(split->seqs[7]), 32);
  EXPECT_LT(testing::relative_l2(b.out.data(), a.out.data(), a.out.size()), 2e-6);
  for (size_t i = 0; i < a.lse.size(); ++i) EXPECT_NEAR(a.lse[i], b.lse[i], 2e-5) << i;

  // Prefill over the whole of the longest sequence: every query straddles the sink boundary.
  const int len = 257, id = 7;
  const auto qp = queries(whole->profiles[0], hq, len, scale, 6);
  std::vector<float> oa(qp.size()), ob(qp.size()), la(len * hq), lb(len * hq);
  const auto ta = whole->cache->batch_tables({whole->seqs[id]});
  const auto tb = split->cache->batch_tables({split->seqs[id]});
  ASSERT_TRUE(cpu::prefill(bind_prefill(*whole->cache, 0, ta, qp.data(), oa.data(), len, 0, hq, scale, la.data())).is_ok());
  ASSERT_TRUE(cpu::prefill(bind_prefill(*split->cache, 0, tb, qp.data(), ob.data(), len, 0, hq, scale, lb.data())).is_ok());
  EXPECT_LT(testing::relative_l2(ob.data(), oa.data(), oa.size()), 2e-6);
  for (size_t i = 0; i < la.size(); ++i) ASSERT_NEAR(la[i], lb[i], 2e-5) << i;
}

// Where the pages sit must not matter: the same data written in order and scrambled (with holes)
// gives bit-identical results for formats whose codes do not depend on write chunking.
TEST(CpuAttention, PagePlacementDoesNotChangeResults) {
  for (Format f : {Format::kBf16, Format::kFp8E4m3, Format::kInt8, Format::kInt4}) {
    auto ordered = build_synthetic_cache(small_options(f, 20, false));
    auto scrambled = build_synthetic_cache(small_options(f, 20, true));
    ASSERT_TRUE(ordered.is_ok() && scrambled.is_ok());
    ASSERT_FALSE(testing::tables_scrambled(*ordered->cache, ordered->seqs));
    ASSERT_TRUE(testing::tables_scrambled(*scrambled->cache, scrambled->seqs));
    const float scale = 0.125f;
    const auto q = queries(ordered->profiles[0], 4, 8, scale, 9);
    const DecodeRun a = run_decode(*ordered->cache, ordered->seqs, q, 4, scale);
    const DecodeRun b = run_decode(*scrambled->cache, scrambled->seqs, q, 4, scale);
    EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float))) << format_name(f);
    EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float))) << format_name(f);
  }
}

// A sequence's result does not depend on what else is in the batch or where it sits in it.
TEST(CpuAttention, BatchCompositionDoesNotChangeResults) {
  auto built = build_synthetic_cache(small_options(Format::kFp8E4m3Fnuz, 16, true));
  ASSERT_TRUE(built.is_ok());
  const int hq = 4, d = 64;
  const float scale = 0.125f;
  const auto q = queries(built->profiles[0], hq, 8, scale, 3);
  const DecodeRun all = run_decode(*built->cache, built->seqs, q, hq, scale);
  std::vector<cache::SeqId> reversed(built->seqs.rbegin(), built->seqs.rend());
  std::vector<float> q_rev(q.size());
  for (int s = 0; s < 8; ++s)
    std::memcpy(&q_rev[static_cast<size_t>(7 - s) * hq * d], &q[static_cast<size_t>(s) * hq * d], hq * d * sizeof(float));
  const DecodeRun rev = run_decode(*built->cache, reversed, q_rev, hq, scale);
  for (int s = 0; s < 8; ++s) {
    std::vector<float> q1(q.begin() + s * hq * d, q.begin() + (s + 1) * hq * d);
    const DecodeRun one = run_decode(*built->cache, {built->seqs[s]}, q1, hq, scale);
    EXPECT_EQ(0, std::memcmp(one.out.data(), &all.out[static_cast<size_t>(s) * hq * d], hq * d * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(one.out.data(), &rev.out[static_cast<size_t>(7 - s) * hq * d], hq * d * sizeof(float)));
  }
}

// The canaries must be able to fail: a backend that followed a wrong page id (simulated here by
// pointing a block table entry at a free, poisoned page) or read past a sequence's end must
// produce non-finite output.
TEST(CpuAttention, CanariesCatchWrongReads) {
  for (Format f : {Format::kBf16, Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4}) {
    auto built = build_synthetic_cache(small_options(f, 16, true));
    ASSERT_TRUE(built.is_ok());
    cache::PagedKvCache& kv = *built->cache;
    ASSERT_TRUE(testing::poison_unowned(kv, built->seqs).is_ok());
    int free_page = -1;
    for (int p = 0; p < kv.geometry().num_pages && free_page < 0; ++p)
      if (kv.pool().refcount(p) == 0) free_page = p;
    ASSERT_GE(free_page, 0);
    const int hq = 2;
    const float scale = 0.125f;
    const auto q = queries(built->profiles[0], hq, 8, scale, 1);
    const DecodeRun clean = run_decode(kv, built->seqs, q, hq, scale);
    EXPECT_TRUE(testing::all_finite(clean.out.data(), clean.out.size())) << format_name(f);

    auto tables = kv.batch_tables(built->seqs);
    tables.block_tables[static_cast<size_t>(6) * tables.max_blocks] = free_page;  // seq 6: 100 tokens
    std::vector<float> out(q.size());
    ASSERT_TRUE(cpu::decode(bind_decode(kv, 0, tables, q.data(), out.data(), hq, scale)).is_ok());
    EXPECT_FALSE(testing::all_finite(&out[static_cast<size_t>(6) * hq * 64], hq * 64)) << format_name(f);

    // One token more than seq 5 (47 tokens: 16 in the sink, 31 quantized) holds reads a poisoned slot.
    auto longer = kv.batch_tables(built->seqs);
    longer.seq_lens[5] += 1;
    ASSERT_TRUE(cpu::decode(bind_decode(kv, 0, longer, q.data(), out.data(), hq, scale)).is_ok());
    EXPECT_FALSE(testing::all_finite(&out[static_cast<size_t>(5) * hq * 64], hq * 64)) << format_name(f);
  }
}

TEST(CpuAttention, WorkspaceSizeCoversLongestSequence) {
  auto built = build_synthetic_cache(small_options(Format::kInt8, 0, true));
  ASSERT_TRUE(built.is_ok());
  const auto tables = built->cache->batch_tables(built->seqs);
  std::vector<float> q(8 * 4 * 64), out(q.size());
  const DecodeArgs args = bind_decode(*built->cache, 0, tables, q.data(), out.data(), 4, 0.125f);
  EXPECT_GE(cpu::workspace_size(args), size_t{257} * 2 * 64 * sizeof(float));
}

}  // namespace
}  // namespace kvq::attention
