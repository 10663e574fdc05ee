#pragma once
// Test support for the paged cache: configs, random K/V rows and a float64 shadow model that knows
// what each sequence holds and how far a read-back may be from it.
//
// Error bounds (derived from the formats' grids, see tests/quant/quantize_test.cpp): a value x
// stored at scale s reads back within max(rel * |x|, abs * s) plus float32 rounding slack, with
//   fp8 E4M3: rel 2^-4, abs 2^-10 (OCP) / 2^-11 (FNUZ)   int8: abs 0.5
//   bf16: rel 2^-8                                      fp16: rel 2^-11, abs 2^-25
// per_block_head growth re-encodes old tokens at the larger scale; each of the r growth events a
// token lived through adds one more rounding at a scale no larger than the final one, so its bound
// is (r + 1) times the bound at the final scale. per_tensor values beyond qmax * s read back as
// +-qmax * s (saturation), so they are compared with the clamped value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "kvq/cache/paged_cache.h"

namespace kvq::cache::testing {

inline CacheConfig make_config(Format f, ScaleGranularity g, int block_size, int layers, int heads, int dim,
                               int pages, int sink_pages, int sink_tokens) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_kv_heads = heads;
  c.head_dim = dim;
  c.spec.format = f;
  c.spec.granularity = g;
  c.spec.block_size = block_size;
  c.spec.sink_tokens = sink_tokens;
  c.num_pages = pages;
  c.num_sink_pages = sink_pages;
  return c;
}

struct GridBound {
  double rel, abs;
};

inline GridBound grid_bound(Format f) {
  switch (f) {
    case Format::kFp8E4m3: return {std::ldexp(1.0, -4), std::ldexp(1.0, -10)};
    case Format::kFp8E4m3Fnuz: return {std::ldexp(1.0, -4), std::ldexp(1.0, -11)};
    case Format::kInt8: case Format::kInt4: case Format::kInt4Kivi: return {0.0, 0.5};
    case Format::kBf16: return {std::ldexp(1.0, -8), std::ldexp(1.0, -134)};
    case Format::kFp16: return {std::ldexp(1.0, -11), std::ldexp(1.0, -25)};
  }
  return {0, 0};
}

// Bound for a value that went through `rounds` extra re-encodings at scales <= s.
inline double allowed_error(Format f, double x, double s, int rounds = 0) {
  const GridBound b = grid_bound(f);
  double ax = std::fabs(x);
  for (int r = 0; r < rounds; ++r) ax *= 1 + b.rel;  // each re-encoding may grow |x| by rel
  const double slack = std::ldexp(1.0, -22);
  return (rounds + 1) * (std::max(b.rel * ax, b.abs * (is_quantized(f) ? s : 1.0)) * (1 + slack) + slack * ax);
}

// The scale the library should pick, computed in float64 from the float amax. fp16 planes: the
// fp32 scale rounded up onto the binary16 grid (step 2^(e - 10), e >= -14), clamped to
// [2^-24, 65504] (quant/policy.h).
inline double expected_scale(Format f, float amax, ScaleDtype sd = ScaleDtype::kFp32) {
  if (!is_quantized(f) || !(amax > 0.f) || !std::isfinite(amax)) return 1.0;
  const double s = std::max(static_cast<double>(static_cast<float>(static_cast<double>(amax) / format_qmax(f))),
                            static_cast<double>(FLT_MIN));
  if (sd == ScaleDtype::kFp32) return s;
  if (s >= 65504.0) return 65504.0;
  const double step = std::ldexp(1.0, std::max(std::ilogb(s), -14) - 10);
  return std::max(std::ceil(s / step) * step, std::ldexp(1.0, -24));
}

inline float finite_abs_max(const float* x, size_t n) {
  float m = 0.f;
  for (size_t i = 0; i < n; ++i) {
    if (std::isfinite(x[i])) m = std::max(m, std::fabs(x[i]));
  }
  return m;
}

// n tokens of [heads][dim] floats: each (token, head) row has its own magnitude 2^U(lo, hi), and a
// fraction `bad` of the values is NaN or +-inf.
inline std::vector<float> random_rows(std::mt19937& rng, int n, int heads, int dim, float lo = -4.f, float hi = 4.f,
                                      double bad = 0.0) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> expo(lo, hi);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::vector<float> x(static_cast<size_t>(n) * heads * dim);
  for (size_t r = 0; r < static_cast<size_t>(n) * heads; ++r) {
    const float mag = std::exp2(expo(rng));
    for (int i = 0; i < dim; ++i) {
      float v = normal(rng) * mag;
      if (bad > 0 && u01(rng) < bad) {
        const double w = u01(rng);
        v = w < 0.4 ? std::numeric_limits<float>::quiet_NaN()
                    : (w < 0.7 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity());
      }
      x[r * dim + i] = v;
    }
  }
  return x;
}

// What each sequence holds, in float64 terms, and the scale history needed for the bounds.
class Shadow {
 public:
  explicit Shadow(const CacheConfig& cfg)
      : f_(cfg.spec.format), g_(cfg.spec.granularity), sd_(cfg.spec.scale_dtype), layers_(cfg.num_layers), heads_(cfg.num_kv_heads),
        dim_(cfg.head_dim), bs_(cfg.spec.block_size),
        tensor_scale_(static_cast<size_t>(cfg.num_layers) * 2, -1.0) {}

  void add(SeqId id, int sink_capacity) {
    Seq s;
    s.cap = sink_capacity;
    s.layers.resize(static_cast<size_t>(layers_));
    s.block_amax.resize(static_cast<size_t>(layers_));
    seqs_[id] = s;
  }
  void fork(SeqId parent, SeqId child) { seqs_[child] = seqs_.at(parent); }
  // The child holds the parent's first n tokens (whole pages; block amax of the main pages kept).
  void share_prefix(SeqId parent, SeqId child, int n) {
    Seq s = seqs_.at(parent);
    s.len = n;
    for (auto& l : s.layers) l.resize(std::min(l.size(), static_cast<size_t>(n)));
    const size_t main_blocks = static_cast<size_t>(std::max(0, n - s.cap) / bs_);
    for (auto& l : s.block_amax) l.resize(std::min(l.size(), main_blocks));
    seqs_[child] = s;
  }
  void free(SeqId id) { seqs_.erase(id); }
  void extend(SeqId id, int n) { seqs_.at(id).len += n; }
  bool has(SeqId id) const { return seqs_.count(id) != 0; }
  int len(SeqId id) const { return seqs_.at(id).len; }
  int cap(SeqId id) const { return seqs_.at(id).cap; }
  int written(SeqId id, int layer) const {
    return static_cast<int>(seqs_.at(id).layers[static_cast<size_t>(layer)].size());
  }
  std::vector<SeqId> ids() const {
    std::vector<SeqId> v;
    for (const auto& kv : seqs_) v.push_back(kv.first);
    return v;
  }

  uint64_t values = 0, nonfinite = 0, requantized = 0;

  // Mirrors PagedKvCache::write (tokens [pos0, pos0 + n), pos0 <= written).
  void write(SeqId id, int layer, int pos0, const float* k, const float* v, int n) {
    Seq& s = seqs_.at(id);
    auto& toks = s.layers[static_cast<size_t>(layer)];
    const size_t row = static_cast<size_t>(heads_) * dim_;
    const int old_written = static_cast<int>(toks.size());
    const int end = pos0 + n;
    values += static_cast<uint64_t>(n) * row * 2;
    for (size_t i = 0; i < static_cast<size_t>(n) * row; ++i) {
      nonfinite += !std::isfinite(k[i]);
      nonfinite += !std::isfinite(v[i]);
    }
    if (g_ == ScaleGranularity::kPerTensor && is_quantized(f_) && end > s.cap) {
      const int t0 = std::max(pos0, s.cap);
      for (int kv = 0; kv < 2; ++kv) {
        double& ts = tensor_scale_[static_cast<size_t>(layer) * 2 + kv];
        if (ts >= 0) continue;
        const float* src = (kv == 0 ? k : v) + static_cast<size_t>(t0 - pos0) * row;
        ts = expected_scale(f_, finite_abs_max(src, static_cast<size_t>(end - t0) * row), sd_);
      }
    }
    if (g_ == ScaleGranularity::kPerBlockHead && is_quantized(f_) && end > s.cap) {
      auto& amax = s.block_amax[static_cast<size_t>(layer)];
      for (int t = std::max(pos0, s.cap); t < end;) {
        const int block = (t - s.cap) / bs_;
        const int page_t0 = s.cap + block * bs_, page_t1 = page_t0 + bs_;
        const int w1 = std::min(end, page_t1);
        if (amax.size() <= static_cast<size_t>(block)) amax.resize(static_cast<size_t>(block) + 1, std::vector<float>(2 * heads_, 0.f));
        for (int kv = 0; kv < 2; ++kv) {
          for (int h = 0; h < heads_; ++h) {
            float a = 0.f;
            for (int u = t; u < w1; ++u) {
              const float* r = (kv == 0 ? k : v) + static_cast<size_t>(u - pos0) * row + static_cast<size_t>(h) * dim_;
              a = std::max(a, finite_abs_max(r, static_cast<size_t>(dim_)));
            }
            float& pa = amax[static_cast<size_t>(block)][static_cast<size_t>(kv * heads_ + h)];
            std::vector<int> kept;
            for (int u = page_t0; u < std::min(old_written, page_t1); ++u) {
              if (u < t || u >= w1) kept.push_back(u);
            }
            if (kept.empty()) {
              pa = a;
            } else if (a > pa) {
              for (int u : kept) ++toks[static_cast<size_t>(u)].rounds[static_cast<size_t>(kv * heads_ + h)];
              ++requantized;
              pa = a;
            }
          }
        }
        t = w1;
      }
    }
    if (static_cast<int>(toks.size()) < end) toks.resize(static_cast<size_t>(end));
    for (int t = pos0; t < end; ++t) {
      Tok& tk = toks[static_cast<size_t>(t)];
      tk.k.assign(k + static_cast<size_t>(t - pos0) * row, k + static_cast<size_t>(t - pos0 + 1) * row);
      tk.v.assign(v + static_cast<size_t>(t - pos0) * row, v + static_cast<size_t>(t - pos0 + 1) * row);
      tk.rounds.assign(static_cast<size_t>(2 * heads_), 0);
    }
  }

  // Reads written tokens of `id` back from the cache (all layers, or `only_layer`; tokens
  // [t0, t1)) and checks them against the bound.
  ::testing::AssertionResult check(const PagedKvCache& c, SeqId id, int only_layer = -1, int t0 = 0,
                                   int t1 = std::numeric_limits<int>::max()) const {
    const Seq& s = seqs_.at(id);
    if (c.seq_len(id) != s.len) return ::testing::AssertionFailure() << "seq " << id << " len " << c.seq_len(id) << " vs " << s.len;
    if (c.sink_len(id) != std::min(s.len, s.cap)) return ::testing::AssertionFailure() << "seq " << id << " sink_len";
    const size_t row = static_cast<size_t>(heads_) * dim_;
    std::vector<float> k(row), v(row);
    for (int l = 0; l < layers_; ++l) {
      if (only_layer >= 0 && l != only_layer) continue;
      const auto& toks = s.layers[static_cast<size_t>(l)];
      if (c.written(id, l) != static_cast<int>(toks.size())) return ::testing::AssertionFailure() << "written";
      for (int t = std::max(t0, 0); t < std::min(t1, static_cast<int>(toks.size())); ++t) {
        Status st = c.read_token(id, l, t, k.data(), v.data());
        if (!st.is_ok()) return ::testing::AssertionFailure() << st.to_string();
        const Tok& tk = toks[static_cast<size_t>(t)];
        for (int kv = 0; kv < 2; ++kv) {
          for (int h = 0; h < heads_; ++h) {
            const float* want = (kv == 0 ? tk.k.data() : tk.v.data()) + static_cast<size_t>(h) * dim_;
            const float* got = (kv == 0 ? k.data() : v.data()) + static_cast<size_t>(h) * dim_;
            double scale = 1.0;
            int rounds = 0;
            Format f = f_;
            bool clamp = false;
            if (t < s.cap) {
              f = Format::kBf16;
            } else if (is_quantized(f_)) {
              if (g_ == ScaleGranularity::kPerTokenHead) {
                scale = expected_scale(f_, finite_abs_max(want, static_cast<size_t>(dim_)), sd_);
              } else if (g_ == ScaleGranularity::kPerBlockHead) {
                const int block = (t - s.cap) / bs_;
                scale = expected_scale(f_, s.block_amax[static_cast<size_t>(l)][static_cast<size_t>(block)][static_cast<size_t>(kv * heads_ + h)], sd_);
                rounds = tk.rounds[static_cast<size_t>(kv * heads_ + h)];
              } else {
                scale = tensor_scale_[static_cast<size_t>(l) * 2 + kv];
                clamp = true;
              }
            }
            for (int i = 0; i < dim_; ++i) {
              double x = want[i];
              if (!std::isfinite(x)) x = 0;
              if (clamp) x = std::clamp(x, -format_qmax(f) * scale, format_qmax(f) * scale);
              const double err = std::fabs(got[i] - x);
              const double bound = allowed_error(f, x, scale, rounds);
              if (!(err <= bound)) {
                return ::testing::AssertionFailure()
                       << "seq " << id << " layer " << l << " token " << t << (kv ? " V" : " K") << " head " << h
                       << " dim " << i << ": stored " << want[i] << " read " << got[i] << " err " << err
                       << " > bound " << bound << " (scale " << scale << ", rounds " << rounds << ")";
              }
            }
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  struct Tok {
    std::vector<float> k, v;
    std::vector<int> rounds;  // [kv][head] growth events lived through
  };
  struct Seq {
    int len = 0, cap = 0;
    std::vector<std::vector<Tok>> layers;                       // written tokens per layer
    std::vector<std::vector<std::vector<float>>> block_amax;    // [layer][block][kv * heads + h]
  };
  Format f_;
  ScaleGranularity g_;
  ScaleDtype sd_;
  int layers_, heads_, dim_, bs_;
  std::vector<double> tensor_scale_;  // [layer][kv]; < 0 until the first quantized write
  std::map<SeqId, Seq> seqs_;
};

}  // namespace kvq::cache::testing
