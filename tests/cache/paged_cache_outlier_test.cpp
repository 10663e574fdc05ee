// int4_outlier in the host cache against a float64 model of its rule (quant/outlier.h) that shares
// no code with it: K per channel with scales fixed when a page opens from the layer's running
// statistics, V per token with running-RMS thresholds, fp16 sparse entries with a fair share of a
// fixed capacity. Data with planted large channels and spikes, sequences interleaved so pages are
// shuffled, a sink-less sequence (bootstrap), chunked vs token-by-token writes, fork, overflow.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "cache/cache_test_util.h"
#include "kvq/format/bf16.h"

namespace kvq::cache {
namespace {

using testing::expected_scale;
using testing::make_config;

// Rows [n][heads][dim]: channel 3 of each head large in every token (mean 8), channel 5 twice the
// others, and rare spikes (2% of values at 10-60x) anywhere.
std::vector<float> planted_rows(std::mt19937& rng, int n, int heads, int dim) {
  std::normal_distribution<float> z(0.f, 1.f);
  std::uniform_real_distribution<float> spike(10.f, 60.f);
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<float> x(static_cast<size_t>(n) * heads * dim);
  for (size_t r = 0; r < x.size(); ++r) {
    const int ch = static_cast<int>(r % dim);
    float v = ch == 3 ? 8.f + z(rng) : z(rng) * (ch == 5 ? 2.f : 1.f);
    if (pick(rng) < 2) v *= spike(rng);
    x[r] = v;
  }
  return x;
}

CacheConfig outlier_config(int layers, int heads, int dim, int pages, int sink = 16) {
  CacheConfig c = make_config(Format::kInt4, ScaleGranularity::kPerTokenHead, 16, layers, heads, dim, pages, 4, sink);
  c.spec.outliers = true;
  return c;
}

double fp16_of(double x) { return format::fp16_to_float(format::float_to_fp16(static_cast<float>(x))); }

// The rule in float64, fed the same writes in the same order (appends only).
class Model {
 public:
  struct Head {  // one page head of one plane
    std::vector<double> ch_scale;                  // K
    std::vector<int> codes;                        // [bs][d]
    std::vector<double> scale;                     // V: [bs]
    std::vector<std::pair<int, double>> entries;   // (slot * d + channel, value), write order
  };
  Model(int layers, int heads, int dim, int bs) : heads_(heads), d_(dim), bs_(bs) {
    for (int i = 0; i < 2 * layers; ++i) {
      sum_.emplace_back(static_cast<size_t>(heads) * dim, 0.0);
      cnt_.emplace_back(static_cast<size_t>(heads) * dim, 0.0);
      rows_.push_back(0);
    }
  }
  void write(const PagedKvCache& c, SeqId s, int layer, int pos0, int n, const float* k, const float* v) {
    const int cap = c.sink_capacity(s);
    const size_t stride = static_cast<size_t>(heads_) * d_;
    for (int t = pos0; t < pos0 + n; ++t) {
      const float* kr = k + static_cast<size_t>(t - pos0) * stride;
      const float* vr = v + static_cast<size_t>(t - pos0) * stride;
      if (t < cap) {
        add(2 * layer, kr);
        continue;
      }
      const int u = t - cap, slot = u % bs_, page = c.block_table(s)[static_cast<size_t>(u / bs_)];
      bool counted = false;
      if (slot == 0) {
        if (rows_[2 * layer] == 0) add(2 * layer, kr), counted = true;
        for (int h = 0; h < heads_; ++h) {
          Head& hk = head(layer, 0, page, h);
          hk.ch_scale.resize(d_);
          for (int i = 0; i < d_; ++i) {
            const double cn = cnt_[2 * layer][h * d_ + i];
            const double rms = cn > 0 ? std::sqrt(sum_[2 * layer][h * d_ + i] / cn) : 0.0;
            hk.ch_scale[i] = expected_scale(Format::kInt4, static_cast<float>(2.0 * rms), ScaleDtype::kFp16);
          }
        }
      }
      if (!counted) add(2 * layer, kr);
      add(2 * layer + 1, vr);
      for (int h = 0; h < heads_; ++h) {
        key_row(head(layer, 0, page, h), slot, kr + static_cast<size_t>(h) * d_);
        value_row(layer, head(layer, 1, page, h), slot, h, vr + static_cast<size_t>(h) * d_);
      }
    }
  }
  Head& head(int layer, int kv, int page, int h) {
    Head& r = heads_map_[{layer, kv, page, h}];
    if (r.codes.empty()) r.codes.assign(static_cast<size_t>(bs_) * d_, 0), r.scale.assign(bs_, 0.0);
    return r;
  }
  uint64_t kept = 0, overflow = 0;

 private:
  void add(int plane, const float* row) {
    for (size_t i = 0; i < sum_[plane].size(); ++i) {
      if (!std::isfinite(row[i])) continue;
      sum_[plane][i] += double(row[i]) * row[i];
      cnt_[plane][i] += 1;
    }
    ++rows_[plane];
  }
  // Drops entries of this slot and later ones (appends), then picks candidates by `key`, largest first.
  std::vector<int> pick(Head& hd, int slot, std::vector<int> cand, const std::vector<double>& key) {
    hd.entries.erase(std::remove_if(hd.entries.begin(), hd.entries.end(), [&](auto& e) { return e.first / d_ >= slot; }),
                     hd.entries.end());
    std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return key[a] > key[b]; });
    const int free = bs_ - static_cast<int>(hd.entries.size()), left = bs_ - slot;  // capacity = bs
    const int room = free <= 0 ? 0 : (free + left - 1) / left;
    const int n_kept = std::min<int>(room, static_cast<int>(cand.size()));
    kept += n_kept, overflow += cand.size() - n_kept;
    cand.resize(n_kept);
    std::sort(cand.begin(), cand.end());  // a row's entries are stored in channel order
    return cand;
  }
  void key_row(Head& hd, int slot, const float* x) {
    std::vector<int> cand;
    std::vector<double> key(d_);
    for (int i = 0; i < d_; ++i) {
      key[i] = std::fabs(double(x[i])) - 7 * hd.ch_scale[i];
      if (std::fabs(x[i] / hd.ch_scale[i]) > 7.5) cand.push_back(i);
    }
    const std::vector<int> kept_ch = pick(hd, slot, cand, key);
    for (int i = 0; i < d_; ++i) {
      const bool k = std::find(kept_ch.begin(), kept_ch.end(), i) != kept_ch.end();
      hd.codes[size_t(slot) * d_ + i] = k ? 0 : int(std::nearbyint(std::clamp(x[i] / hd.ch_scale[i], -7.0, 7.0)));
    }
    for (int i : kept_ch) hd.entries.push_back({slot * d_ + i, fp16_of(x[i])});
  }
  void value_row(int layer, Head& hd, int slot, int h, const float* x) {
    std::vector<double> thr(d_);
    double head_sq = 0;
    for (int i = 0; i < d_; ++i) {
      const double cn = cnt_[2 * layer + 1][h * d_ + i];
      thr[i] = cn < 16 ? std::numeric_limits<double>::infinity()
                       : double(float(4.0 * std::sqrt(sum_[2 * layer + 1][h * d_ + i] / cn)));
      head_sq += thr[i] * thr[i];
    }
    const double head_thr = double(float(std::sqrt(head_sq / d_)));
    std::vector<int> cand;
    std::vector<double> key(d_);
    for (int i = 0; i < d_; ++i) {
      key[i] = std::fabs(double(x[i]));
      if (key[i] > std::min(thr[i], head_thr)) cand.push_back(i);
    }
    const std::vector<int> kept_ch = pick(hd, slot, cand, key);
    double amax = 0;
    for (int i = 0; i < d_; ++i)
      if (std::find(kept_ch.begin(), kept_ch.end(), i) == kept_ch.end()) amax = std::max(amax, key[i]);
    const double s = expected_scale(Format::kInt4, float(amax));
    hd.scale[slot] = s;
    for (int i = 0; i < d_; ++i) {
      const bool k = std::find(kept_ch.begin(), kept_ch.end(), i) != kept_ch.end();
      hd.codes[size_t(slot) * d_ + i] = k ? 0 : int(std::nearbyint(std::clamp(x[i] / s, -7.0, 7.0)));
    }
    for (int i : kept_ch) hd.entries.push_back({slot * d_ + i, fp16_of(x[i])});
  }
  int heads_, d_, bs_;
  std::vector<std::vector<double>> sum_, cnt_;
  std::vector<uint64_t> rows_;
  std::map<std::tuple<int, int, int, int>, Head> heads_map_;
};

int nibble(uint8_t b, int hi) {
  const int v = hi ? b / 16 : b % 16;
  return v >= 8 ? v - 16 : v;
}

// Every written main slot of `s`: codes, scales and entries against the model.
void expect_planes_match(const PagedKvCache& c, Model& m, SeqId s, int layer) {
  const int bs = c.geometry().block_size, d = c.geometry().head_dim, heads = c.geometry().num_kv_heads;
  const int main_len = c.written(s, layer) - c.sink_capacity(s);
  const auto& p = c.planes(layer);
  for (int b = 0; b * bs < main_len; ++b) {
    const int page = c.block_table(s)[static_cast<size_t>(b)], n = std::min(bs, main_len - b * bs);
    for (int kv = 0; kv < 2; ++kv) {
      const CacheGeometry g = c.layer_geometry(layer).plane(kv);
      const uint32_t* words = (kv == 0 ? p.k_outliers : p.v_outliers).data();
      for (int h = 0; h < heads; ++h) {
        const Model::Head& want = m.head(layer, kv, page, h);
        for (int i = 0; kv == 0 && i < d; ++i)
          ASSERT_EQ(load_scale(words, g.channel_scale_index(page, h) + i, ScaleDtype::kFp16), want.ch_scale[i])
              << "K channel scale, page " << page << " head " << h << " channel " << i;
        for (int t = 0; t < n; ++t) {
          if (kv == 1) {
            ASSERT_EQ(p.v_scales[g.scale_index(page, h, t)], want.scale[t]) << "V scale slot " << t;
          }
          const uint8_t* row = (kv == 0 ? p.k_codes : p.v_codes).data() + g.code_offset(page, h, t);
          for (int i = 0; i < d; ++i)
            ASSERT_EQ(nibble(row[i / 2], i % 2), want.codes[size_t(t) * d + i])
                << (kv ? "V" : "K") << " code, page " << page << " head " << h << " slot " << t << " channel " << i;
        }
        const uint32_t* plane = words + g.outlier_index(page, h);
        ASSERT_EQ(plane[0], want.entries.size()) << (kv ? "V" : "K") << " entries of page " << page << " head " << h;
        for (size_t j = 0; j < want.entries.size(); ++j) {
          const quant::OutlierEntry e = quant::unpack_outlier(plane[1 + j]);
          EXPECT_EQ(e.index, want.entries[j].first);
          EXPECT_EQ(double(format::fp16_to_float(e.value)), want.entries[j].second);
        }
      }
    }
  }
}

TEST(Int4OutlierCache, PlanesMatchAFloat64ModelOfTheRule) {
  const int layers = 2, heads = 2, dim = 32, bs = 16;
  auto created = PagedKvCache::create(outlier_config(layers, heads, dim, 24));
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  PagedKvCache& c = *created.value();
  ASSERT_EQ(c.geometry().outlier_capacity, bs);
  Model m(layers, heads, dim, bs);
  std::mt19937 rng(5);
  std::vector<SeqId> seqs = {c.add_sequence(0).value(), c.add_sequence().value(), c.add_sequence().value()};
  std::vector<std::vector<float>> k_in(3), v_in(3);
  auto grow = [&](int i, int n) {
    const SeqId s = seqs[static_cast<size_t>(i)];
    ASSERT_TRUE(c.extend(s, n).is_ok());
    const auto k = planted_rows(rng, n, heads, dim), v = planted_rows(rng, n, heads, dim);
    for (int l = 0; l < layers; ++l) {
      m.write(c, s, l, c.written(s, l), n, k.data(), v.data());
      ASSERT_TRUE(c.write(s, l, c.written(s, l), k.data(), v.data(), n).is_ok());
    }
    k_in[size_t(i)].insert(k_in[size_t(i)].end(), k.begin(), k.end());
    v_in[size_t(i)].insert(v_in[size_t(i)].end(), v.begin(), v.end());
  };
  // Sequence 0 has no sink: its first page bootstraps from its first row.
  grow(0, 40), grow(1, 23), grow(2, 50), grow(1, 30);
  ASSERT_TRUE(c.free_sequence(seqs[2]).is_ok());
  seqs[2] = c.add_sequence().value();
  k_in[2].clear(), v_in[2].clear();
  grow(2, 45), grow(0, 25);
  for (int i = 0; i < 12; ++i) grow(i % 3, 1);  // decode-style single tokens
  bool out_of_order = false;
  for (SeqId s : seqs) {
    const auto& t = c.block_table(s);
    out_of_order |= !std::is_sorted(t.begin(), t.end()) || (t.size() > 1 && t[1] != t[0] + 1);
  }
  EXPECT_TRUE(out_of_order) << "pages were allocated in order; the test would not catch a wrong address";
  for (SeqId s : seqs)
    for (int l = 0; l < layers; ++l) ASSERT_NO_FATAL_FAILURE(expect_planes_match(c, m, s, l));
  const quant::QuantStats& st = c.stats();
  std::printf("values %llu: outliers %llu, overflow %llu\n", (unsigned long long)st.values,
              (unsigned long long)st.outliers, (unsigned long long)st.outlier_overflow);
  EXPECT_EQ(st.outliers, m.kept);
  EXPECT_EQ(st.outlier_overflow, m.overflow);
  EXPECT_GT(st.outliers, 100u) << "spikes should become sparse entries";
  EXPECT_GT(st.outlier_overflow, 0u) << "the data should also overflow some rows' share";

  // Read-back: a value is its code times its scale, or its entry (K: channel scale, V: row scale).
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqId s = seqs[i];
    std::vector<float> k(static_cast<size_t>(heads) * dim), v(k.size());
    for (int t = c.sink_capacity(s); t < c.seq_len(s); ++t) {
      ASSERT_TRUE(c.read_token(s, 1, t, k.data(), v.data()).is_ok());
      const int u = t - c.sink_capacity(s), page = c.block_table(s)[size_t(u / bs)], slot = u % bs;
      for (int h = 0; h < heads; ++h)
        for (int kv = 0; kv < 2; ++kv) {
          const Model::Head& hd = m.head(1, kv, page, h);
          for (int e = 0; e < dim; ++e) {
            double want = hd.codes[size_t(slot) * dim + e] * (kv == 0 ? hd.ch_scale[e] : hd.scale[slot]);
            for (const auto& en : hd.entries)
              if (en.first == slot * dim + e) want = en.second;
            ASSERT_EQ(double((kv == 0 ? k : v)[size_t(h) * dim + e]), double(float(want)));
          }
        }
    }
  }

  // A fork copies the partial last page with its channel scales and entries; both read the same.
  const SeqId child = c.fork(seqs[1]).value();
  std::vector<float> a(static_cast<size_t>(heads) * dim), b(a.size()), a2(a.size()), b2(a.size());
  for (int pos = 0; pos < c.seq_len(seqs[1]); ++pos) {
    ASSERT_TRUE(c.read_token(seqs[1], 1, pos, a.data(), b.data()).is_ok());
    ASSERT_TRUE(c.read_token(child, 1, pos, a2.data(), b2.data()).is_ok());
    ASSERT_EQ(a, a2);
    ASSERT_EQ(b, b2);
  }
}

// A sequence written in one chunk and the same sequence written token by token give the same
// planes: a page's scales depend only on the rows before it.
TEST(Int4OutlierCache, ChunkedWritesEqualTokenByToken) {
  const int heads = 3, dim = 64, n = 77;
  std::mt19937 rng(17);
  const auto k = planted_rows(rng, n, heads, dim), v = planted_rows(rng, n, heads, dim);
  std::vector<std::unique_ptr<PagedKvCache>> caches;
  for (int chunk : {n, 1, 13}) {
    auto c = PagedKvCache::create(outlier_config(1, heads, dim, 8)).value();
    const SeqId s = c->add_sequence().value();
    for (int t = 0; t < n; t += chunk) {
      const int m = std::min(chunk, n - t);
      ASSERT_TRUE(c->extend(s, m).is_ok());
      const size_t off = static_cast<size_t>(t) * heads * dim;
      ASSERT_TRUE(c->write(s, 0, t, k.data() + off, v.data() + off, m).is_ok());
    }
    caches.push_back(std::move(c));
  }
  for (size_t i = 1; i < caches.size(); ++i) {
    const auto &a = caches[0]->planes(0), &b = caches[i]->planes(0);
    EXPECT_TRUE(a.k_codes == b.k_codes && a.v_codes == b.v_codes) << "codes, chunking " << i;
    EXPECT_TRUE(a.v_scales == b.v_scales && a.k_outliers == b.k_outliers && a.v_outliers == b.v_outliers)
        << "scales and side planes, chunking " << i;
  }
}

TEST(Int4OutlierCache, OverflowIsCountedNotSilent) {
  // A page of small values sets the K statistics; in the next page, token j spikes K channels j
  // (+50) and j + 8 (-60): two candidates per token and a fair share of one entry per token. The
  // -60 (larger clipping error) is kept, the +50 is clipped to the grid's edge and counted.
  const int heads = 1, dim = 16;
  auto c = PagedKvCache::create(outlier_config(1, heads, dim, 4, 0)).value();
  const SeqId s = c->add_sequence().value();
  ASSERT_TRUE(c->extend(s, 32).is_ok());
  std::vector<float> k(static_cast<size_t>(32) * dim), v(k.size());
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  // The second page's ordinary values stay well inside every channel's grid (7.5 s_c > 0.5).
  for (size_t i = 16 * dim; i < k.size(); ++i) k[i] *= 0.25f;
  for (int j = 0; j < 16; ++j) {
    k[static_cast<size_t>(16 + j) * dim + j % 16] = 50.f;
    k[static_cast<size_t>(16 + j) * dim + (j + 8) % 16] = -60.f;
  }
  ASSERT_TRUE(c->write(s, 0, 0, k.data(), v.data(), 16).is_ok());
  const quant::QuantStats before = c->stats();
  ASSERT_TRUE(c->write(s, 0, 16, k.data() + 16 * dim, v.data() + 16 * dim, 16).is_ok());
  EXPECT_EQ(c->stats().outliers - before.outliers, 16u);
  EXPECT_EQ(c->stats().outlier_overflow - before.outlier_overflow, 16u);
  EXPECT_EQ(c->stats().saturated - before.saturated, 16u) << "the overflowed K values clip";
  const CacheGeometry kg = c->geometry().plane(0);
  const int page = c->block_table(s)[1];
  std::vector<float> rk(dim), rv(dim);
  for (int j : {0, 8}) {
    ASSERT_TRUE(c->read_token(s, 0, 16 + j, rk.data(), rv.data()).is_ok());
    EXPECT_EQ(rk[(j + 8) % 16], -60.f) << "kept exactly";
    const float s_c = load_scale(c->planes(0).k_outliers.data(), kg.channel_scale_index(page, 0) + j % 16, ScaleDtype::kFp16);
    EXPECT_EQ(rk[j % 16], 7.f * s_c) << "clipped to the channel's grid edge";
  }
}

TEST(Int4OutlierCache, SpecAndBytes) {
  QuantOptions o;
  o.kv_cache_dtype = "int4_outlier";
  auto spec = parse_quant_spec(o);
  ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
  EXPECT_TRUE(spec->outliers);
  EXPECT_EQ(spec->format, Format::kInt4);
  EXPECT_EQ(spec->to_string(), "int4_outlier/per_token_head/b16/sink256");
  o.granularity = "per_block_head";
  EXPECT_EQ(parse_quant_spec(o).status().code(), StatusCode::kUnsupported);
  // SmolLM2 (30 layers, 3 kv heads x 64), per page head: K 512 code bytes + 4 * (1 + 16 + 32) side
  // words (count, entries, 64 fp16 channel scales); V 512 + 16 fp32 scales + 4 * 17. Per token:
  // 30 * 3 * (708 + 644) / 16 = 7605 bytes, 0.330x bf16's 23040.
  EXPECT_EQ(bytes_per_token(spec.value(), 30, 3, 64), 7605u);
  CacheConfig bad = outlier_config(1, 1, 16, 2);
  bad.spec.granularity = ScaleGranularity::kPerTensor;
  EXPECT_EQ(PagedKvCache::create(bad).status().code(), StatusCode::kUnsupported);
}

}  // namespace
}  // namespace kvq::cache
