// CPU decode and prefill with a bf16 recent window against a float64 reference that applies the
// per-query rule itself: a query at position t sees key j as bf16(input) when j is in the sink or
// j >= t + 1 - R, and as the dequantized stored codes otherwise (read_token: for int4_kivi a page
// reads back from its codes once they are final, else from its twin).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvq/attention/cpu.h"
#include "kvq/attention/reference.h"
#include "kvq/cache/paged_cache.h"

namespace kvq::attention {
namespace {

constexpr int kKvHeads = 2, kQHeads = 4, kDim = 16, kSink = 8;

struct Case {
  Format format;
  ScaleGranularity granularity;
  int recent;
};

class CpuRecentWindow : public ::testing::TestWithParam<Case> {};

float bf16(float x) { return format::bf16_to_float(format::float_to_bf16(x)); }

// Expected outputs of queries q[n_q] at positions [q_pos0, q_pos0 + n_q) of sequence `s`.
std::vector<double> expected(const cache::PagedKvCache& c, cache::SeqId s, const std::vector<float>& k_in,
                             const std::vector<float>& v_in, const float* q, int n_q, int q_pos0, int R) {
  const size_t row = static_cast<size_t>(kKvHeads) * kDim, qrow = static_cast<size_t>(kQHeads) * kDim;
  std::vector<double> out(static_cast<size_t>(n_q) * qrow);
  std::vector<float> codes_k(row), codes_v(row);
  for (int i = 0; i < n_q; ++i) {
    const int t = q_pos0 + i;
    std::vector<float> k(static_cast<size_t>(t + 1) * row), v(k.size());
    for (int j = 0; j <= t; ++j) {
      const bool bf16_key = j < kSink || j >= t + 1 - R;
      EXPECT_TRUE(c.read_token(s, 0, j, codes_k.data(), codes_v.data()).is_ok());
      for (size_t e = 0; e < row; ++e) {
        k[j * row + e] = bf16_key ? bf16(k_in[j * row + e]) : codes_k[e];
        v[j * row + e] = bf16_key ? bf16(v_in[j * row + e]) : codes_v[e];
      }
    }
    const DenseShape shape{t + 1, kKvHeads, kQHeads, kDim};
    EXPECT_TRUE(reference_attention(shape, k.data(), v.data(), q + i * qrow, 1, t, 1.0 / std::sqrt(kDim),
                                    out.data() + i * qrow, nullptr)
                    .is_ok());
  }
  return out;
}

void expect_close(const float* got, const std::vector<double>& want, const char* what, int pos) {
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 5e-5 * (1 + std::fabs(want[i]))) << what << " at position " << pos << ", element " << i;
}

// Two sequences grow by random chunks in an interleaved order (pages of both pools shuffled
// between them); every chunk is checked through prefill, every one-token step also through a
// batched decode of both sequences.
TEST_P(CpuRecentWindow, MatchesPerQueryFloat64Reference) {
  const Case cs = GetParam();
  cache::CacheConfig cfg;
  cfg.num_layers = 1, cfg.num_kv_heads = kKvHeads, cfg.head_dim = kDim;
  cfg.spec.format = cs.format;
  cfg.spec.granularity = cs.granularity;
  cfg.spec.sink_tokens = kSink;
  cfg.spec.recent_tokens = cs.recent;
  if (cs.format == Format::kInt4Kivi) cfg.spec.scale_dtype = ScaleDtype::kFp16;  // as parse_quant_spec sets it
  cfg.num_pages = 64, cfg.num_sink_pages = 4;
  cfg.num_recent_pages = 2 * cache::PagedKvCache::recent_pages_per_sequence(cs.recent, 21, 16);
  auto made = cache::PagedKvCache::create(cfg);
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  cache::PagedKvCache& c = *made.value();
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.5f);
  const size_t row = static_cast<size_t>(kKvHeads) * kDim, qrow = static_cast<size_t>(kQHeads) * kDim;
  cache::SeqId ids[2] = {c.add_sequence().value(), c.add_sequence().value()};
  std::vector<float> ks[2], vs[2];
  std::vector<float> q, out;
  int checked_recent = 0;
  for (int step = 0; step < 24; ++step) {
    const int which = std::uniform_int_distribution<int>(0, 1)(rng);
    const cache::SeqId s = ids[which];
    const int len = c.seq_len(s);
    const int n = step % 3 == 0 ? 1 : std::uniform_int_distribution<int>(2, 21)(rng);
    ASSERT_TRUE(c.extend(s, n).is_ok());
    std::vector<float> k(n * row), v(n * row);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    ASSERT_TRUE(c.write(s, 0, len, k.data(), v.data(), n).is_ok());
    ks[which].insert(ks[which].end(), k.begin(), k.end());
    vs[which].insert(vs[which].end(), v.begin(), v.end());
    q.resize(n * qrow);
    for (float& x : q) x = nd(rng);
    out.assign(q.size(), NAN);

    const auto tables = c.batch_tables({s});
    PrefillArgs pa;
    pa.geom = c.geometry();
    pa.layer = c.layer_view(0);
    pa.tables = tables.view();
    pa.q = q.data(), pa.out = out.data(), pa.n_q = n, pa.q_pos0 = len;
    pa.num_q_heads = kQHeads, pa.softmax_scale = 1.f / std::sqrt(static_cast<float>(kDim));
    ASSERT_TRUE(cpu::prefill(pa).is_ok());
    expect_close(out.data(), expected(c, s, ks[which], vs[which], q.data(), n, len, cs.recent), "prefill", len);
    checked_recent += len + n > kSink + 1;

    if (n == 1 && c.seq_len(ids[1 - which]) > 0) {  // both sequences' last tokens, as one decode batch
      const auto both = c.batch_tables({ids[0], ids[1]});
      std::vector<float> dq(2 * qrow), dout(2 * qrow, NAN);
      for (float& x : dq) x = nd(rng);
      DecodeArgs da;
      da.geom = c.geometry();
      da.layer = c.layer_view(0);
      da.tables = both.view();
      da.q = dq.data(), da.out = dout.data();
      da.num_q_heads = kQHeads, da.softmax_scale = pa.softmax_scale;
      ASSERT_TRUE(cpu::decode(da).is_ok());
      for (int i = 0; i < 2; ++i) {
        const int L = c.seq_len(ids[i]);
        const std::vector<double> want = expected(c, ids[i], ks[i], vs[i], dq.data() + i * qrow, 1, L - 1, cs.recent);
        expect_close(dout.data() + i * qrow, want, "decode", L - 1);
      }
    }
  }
  EXPECT_GT(checked_recent, 10);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, CpuRecentWindow,
    ::testing::Values(Case{Format::kInt8, ScaleGranularity::kPerTokenHead, 24},
                      Case{Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 17},
                      Case{Format::kFp8E4m3Fnuz, ScaleGranularity::kPerBlockHead, 33},
                      Case{Format::kInt8, ScaleGranularity::kPerTensor, 1},
                      Case{Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 1000},
                      // int4_kivi: pages quantized from their twins as they leave the window (R >= block);
                      // a query reading a page not yet quantized would see zero codes, not the reference.
                      Case{Format::kInt4Kivi, ScaleGranularity::kPerTokenHead, 16},
                      Case{Format::kInt4Kivi, ScaleGranularity::kPerTokenHead, 29}));

TEST(CpuRecentWindowArgs, MissingTwinTableIsRefused) {
  cache::CacheConfig cfg;
  cfg.num_layers = 1, cfg.num_kv_heads = kKvHeads, cfg.head_dim = kDim;
  cfg.spec.format = Format::kInt8;
  cfg.spec.sink_tokens = 0;
  cfg.spec.recent_tokens = 8;
  cfg.num_pages = 8, cfg.num_recent_pages = 4;
  auto c = cache::PagedKvCache::create(cfg).value();
  const cache::SeqId s = c->add_sequence().value();
  ASSERT_TRUE(c->extend(s, 5).is_ok());
  std::vector<float> kv(5 * kKvHeads * kDim, 0.5f), q(kQHeads * kDim, 1.f), out(q.size());
  ASSERT_TRUE(c->write(s, 0, 0, kv.data(), kv.data(), 5).is_ok());
  const auto tables = c->batch_tables({s});
  DecodeArgs da;
  da.geom = c->geometry();
  da.layer = c->layer_view(0);
  da.tables = tables.view();
  da.tables.recent_tables = nullptr;
  da.q = q.data(), da.out = out.data(), da.num_q_heads = kQHeads, da.softmax_scale = 0.25f;
  const Status st = cpu::decode(da);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("recent"), std::string::npos);
}

}  // namespace
}  // namespace kvq::attention
