#pragma once
// Test helpers for attention backends (CPU and CUDA tests include this; no gtest dependency).
//
// Data and the oracle live in the library (kvq/attention/synthetic.h: heavy-tailed KV generator and
// paged-cache builder with scrambled block tables; kvq/attention/reference.h: float64 dense
// attention), because the benchmark and `kvq report` need them too. This header adds what only
// tests need: canaries, guarded output buffers, read-back of the cache as stored, error metrics
// and the per-format error budgets.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/attention/reference.h"
#include "kvq/attention/synthetic.h"
#include "kvq/cache/paged_cache.h"
#include "kvq/common/status.h"

namespace kvq::attention::testing {

// ---- error metrics ------------------------------------------------------------------------------

// ||got - ref|| / ||ref|| over n values.
inline double relative_l2(const float* got, const double* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(got[i]) - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline double relative_l2(const float* got, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(got[i]) - ref[i];
    num += e * e;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline double max_abs_diff(const float* got, const double* ref, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(e <= m)) m = e;  // NaN wins
  }
  return m;
}

inline bool all_finite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

// Budget for the relative L2 error of one test case's attention outputs against float64 attention
// over the *original* (unquantized) values, on heavy-tailed data (HeavyTailOptions defaults:
// 4 K channels per head at 20-100x; queries with logit std 2). Backend bugs are caught by the
// tight comparison with the stored values; this bounds what the format itself costs.
// Orders of magnitude come from the formats: bf16 keeps 8 significant bits (2^-9 = 2e-3 per value),
// E4M3 4 bits (2^-4 = 6% worst, ~2.5% RMS per value), int8 a step of amax/127, which for a K row
// holding a 100x channel is as large as the ordinary channels themselves. The errors of K act
// through the logits, where the outlier channels' absolute errors dominate; the relative output
// error grows when attention is diffuse (the output is then a small average of zero-mean V).
// Budgets are 1.5-2x the worst case measured over 40 seeds of the whole sweep (decode; prefill
// chunk of 9 queries): bf16 0.006; 0.011, fp8 per_token_head 0.059; 0.056, per_block_head
// 0.055; 0.079, int8 per_token_head 0.052; 0.081, per_block_head 0.049; 0.113.
// per_tensor is loose on purpose: its scale is fixed by the first write and later values clip, and
// the clipped K values are precisely the extreme ones that dominate the logits (worst 0.14 decode,
// 0.42 prefill). That is why it is the rejected baseline; a wrong scale still shows as error ~1.
inline double attention_error_budget(Format f, ScaleGranularity g) {
  if (!is_quantized(f)) return 2e-2;
  // int4: 15 levels instead of 255 (steps 18x int8's). Provisional: set from one run of the sweep
  // and the harness (passing), not yet the 40-seed calibration the other budgets had.
  // int4_kivi: the same 15 steps, over each K channel's / V row's own [min, max] (provisional too).
  if (f == Format::kInt4Kivi) return 0.5;
  if (f == Format::kInt4) {
    switch (g) {
      case ScaleGranularity::kPerTokenHead: return 0.5;
      case ScaleGranularity::kPerBlockHead: return 0.6;
      case ScaleGranularity::kPerTensor: return 0.9;
    }
  }
  const bool fp8 = f == Format::kFp8E4m3 || f == Format::kFp8E4m3Fnuz;
  switch (g) {
    case ScaleGranularity::kPerTokenHead: return fp8 ? 0.10 : 0.12;
    case ScaleGranularity::kPerBlockHead: return fp8 ? 0.12 : 0.17;
    case ScaleGranularity::kPerTensor: return 0.6;
  }
  return 0;
}

// ---- the cache as stored --------------------------------------------------------------------------

// Dequantized K and V of one sequence ([len][num_kv_heads][head_dim] each) read back through
// PagedKvCache::read_token: the exact values an attention backend must attend over.
inline Status read_back_sequence(const cache::PagedKvCache& c, cache::SeqId seq, int layer, std::vector<float>& k,
                                 std::vector<float>& v) {
  const int len = c.seq_len(seq);
  const size_t row = static_cast<size_t>(c.geometry().num_kv_heads) * c.geometry().head_dim;
  k.assign(len * row, 0.f);
  v.assign(len * row, 0.f);
  for (int t = 0; t < len; ++t) KVQ_RETURN_IF_ERROR(c.read_token(seq, layer, t, &k[t * row], &v[t * row]));
  return Status::ok();
}

// The values a query at `q_pos` attends to (cache/layout.h): read_back_sequence, with the main
// tokens inside its bf16 recent window replaced by their twins. The twins must be held.
inline Status read_back_for_query(const cache::PagedKvCache& c, cache::SeqId seq, int layer, int q_pos,
                                  std::vector<float>& k, std::vector<float>& v) {
  KVQ_RETURN_IF_ERROR(read_back_sequence(c, seq, layer, k, v));
  const cache::CacheGeometry& g = c.geometry();
  const int sink = c.sink_len(seq), len = c.seq_len(seq), bs = g.block_size, d = g.head_dim;
  const auto& p = c.planes(layer);
  for (int t = sink; t < len; ++t) {
    if (!cache::uses_recent(t, q_pos, g.recent_tokens)) continue;
    const int u = t - sink;
    const int32_t twin = c.recent_table(seq)[static_cast<size_t>(u / bs)];
    if (twin < 0) return invalid_argument("read_back_for_query: token " + std::to_string(t) + " has no bf16 twin");
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const size_t e = g.elem_index(twin, h, u % bs), o = (static_cast<size_t>(t) * g.num_kv_heads + h) * d;
      for (int i = 0; i < d; ++i) {
        k[o + i] = format::bf16_to_float(p.k_recent[e + i]);
        v[o + i] = format::bf16_to_float(p.v_recent[e + i]);
      }
    }
  }
  return Status::ok();
}

// The first query position of `seq` whose bf16 window the cache still holds (every later one's
// too: windows only move forward); seq_len when none.
inline int first_servable_query(const cache::PagedKvCache& c, cache::SeqId seq) {
  const cache::CacheGeometry& g = c.geometry();
  const int sink = c.sink_len(seq), len = c.seq_len(seq);
  const auto& twins = c.recent_table(seq);
  for (int q = 0; q < len; ++q) {
    const int first = cache::recent_first_main(q, sink, len - sink, g.recent_tokens);
    bool held = true;
    for (int b = first / g.block_size; held && b * g.block_size < len - sink; ++b)
      held = static_cast<size_t>(b) < twins.size() && twins[static_cast<size_t>(b)] >= 0;
    if (held) return q;
  }
  return len;
}

// ---- block tables -------------------------------------------------------------------------------------

// True when some sequence's pages are not consecutive ascending ids, i.e. a backend that assumed
// contiguous pages would read wrong data.
inline bool tables_scrambled(const cache::PagedKvCache& c, const std::vector<cache::SeqId>& seqs) {
  for (cache::SeqId s : seqs) {
    for (const auto* table : {&c.block_table(s), &c.sink_table(s)})
      for (size_t j = 1; j < table->size(); ++j)
        if ((*table)[j] != (*table)[j - 1] + 1) return true;
  }
  return false;
}

// ---- canaries ---------------------------------------------------------------------------------------

// A value no correct read may see: NaN where the format has one, else the largest code (int8).
inline uint8_t poison_code_byte(Format f, size_t byte_index) {
  switch (f) {
    case Format::kFp8E4m3: return 0x7F;       // NaN
    case Format::kFp8E4m3Fnuz: return 0x80;   // NaN
    case Format::kInt8: return 0x7F;          // 127: no NaN in int8; a read shows as a large error
    case Format::kInt4: return 0x77;          // both nibbles +7 (qmax): no NaN either
    case Format::kInt4Kivi: return 0xFF;      // both nibbles 15 (its parameters are poisoned to NaN)
    case Format::kBf16: return byte_index % 2 == 0 ? 0xC0 : 0x7F;  // 0x7FC0 little-endian: NaN
    case Format::kFp16: return byte_index % 2 == 0 ? 0x00 : 0x7E;  // 0x7E00: NaN
    default: return 0xFF;
  }
}
inline constexpr uint16_t kPoisonBf16 = 0x7FC0;

// Fills every element no live sequence owns with poison: whole free pages of both pools (codes,
// scales, sink) and the unused slots at the end of each live sequence's last page. A backend that
// reads past a sequence's end or follows a wrong page id then produces NaN (or, for int8 with
// per_tensor scales, a large error). Call after the cache is fully written: later writes would
// overwrite the poison and per_block_head growth reads old codes.
inline Status poison_unowned(cache::PagedKvCache& c, const std::vector<cache::SeqId>& live) {
  const cache::CacheGeometry& g = c.geometry();
  const int bs = g.block_size, hkv = g.num_kv_heads, d = g.head_dim;
  const float nan = std::nanf("");
  const bool per_slot_scales = g.has_scales() && !g.kivi() && g.granularity == ScaleGranularity::kPerTokenHead;
  const bool per_page_scales = g.has_scales() && g.granularity == ScaleGranularity::kPerBlockHead;
  // Slots [from, bs) of main page `page` (from = 0: the whole page).
  auto poison_main = [&](const cache::LayerView& lv, int page, int from) {
    for (int h = 0; h < hkv; ++h) {
      const size_t b0 = g.code_offset(page, h, from);
      const size_t b1 = g.code_offset(page, h, bs - 1) + g.row_code_bytes();
      for (size_t b = b0; b < b1; ++b) lv.k_codes[b] = lv.v_codes[b] = poison_code_byte(g.format, b);
      auto poison_scale = [&](size_t i) {  // int4_outlier's K has channel scales instead (no plane)
        if (lv.k_scales != nullptr) cache::store_scale(lv.k_scales, i, nan, g.scale_dtype);
        cache::store_scale(lv.v_scales, i, nan, g.scale_dtype);
      };
      if (per_slot_scales)
        for (int s = from; s < bs; ++s) poison_scale(g.scale_index(page, h, s));
      if (per_page_scales && from == 0) poison_scale(g.scale_index(page, h, 0));
      if (g.kivi() && from == 0)  // a partial page is never final, so only free pages' parameters
        for (int kv = 0; kv < 2; ++kv) {
          const cache::CacheGeometry pg = g.plane(kv);
          for (int grp = 0; grp < pg.kivi_groups(); ++grp)
            for (bool zero : {false, true})
              cache::store_scale(kv == 0 ? lv.k_scales : lv.v_scales, pg.kivi_param_index(page, h, grp, zero), nan,
                                 g.scale_dtype);
        }
    }
  };
  auto poison_bf16 = [&](uint16_t* k, uint16_t* v, int page, int from) {
    for (int h = 0; h < hkv; ++h)
      for (size_t e = g.elem_index(page, h, from); e < g.elem_index(page, h, bs - 1) + d; ++e) k[e] = v[e] = kPoisonBf16;
  };
  auto poison_sink = [&](const cache::LayerView& lv, int page, int from) { poison_bf16(lv.k_sink, lv.v_sink, page, from); };
  for (int layer = 0; layer < g.num_layers; ++layer) {
    const cache::LayerView lv = c.layer_view(layer);
    for (int p = 0; p < g.num_pages; ++p)
      if (c.pool().refcount(p) == 0) poison_main(lv, p, 0);
    for (int p = 0; p < g.num_sink_pages; ++p)
      if (c.sink_pool().refcount(p) == 0) poison_sink(lv, p, 0);
    for (int p = 0; p < g.num_recent_pages; ++p)  // free twins (released ones included)
      if (c.recent_pool().refcount(p) == 0) poison_bf16(lv.k_recent, lv.v_recent, p, 0);
    for (cache::SeqId s : live) {
      const int len = c.seq_len(s), sink = c.sink_len(s), quant = len - sink;
      if (quant % bs != 0 && !c.block_table(s).empty()) poison_main(lv, c.block_table(s).back(), quant % bs);
      if (sink % bs != 0 && !c.sink_table(s).empty()) poison_sink(lv, c.sink_table(s).back(), sink % bs);
      if (quant % bs != 0 && !c.recent_table(s).empty() && c.recent_table(s).back() >= 0)
        poison_bf16(lv.k_recent, lv.v_recent, c.recent_table(s).back(), quant % bs);
    }
  }
  return Status::ok();
}

// Byte-exact copy of every layer's planes, to prove a backend did not write the cache.
inline std::vector<cache::PagedKvCache::Planes> snapshot(const cache::PagedKvCache& c) {
  std::vector<cache::PagedKvCache::Planes> out;
  for (int l = 0; l < c.geometry().num_layers; ++l) out.push_back(c.planes(l));
  return out;
}

inline bool same_planes(const std::vector<cache::PagedKvCache::Planes>& a,
                        const std::vector<cache::PagedKvCache::Planes>& b) {
  auto eq = [](const auto& x, const auto& y) {
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  };
  if (a.size() != b.size()) return false;
  for (size_t l = 0; l < a.size(); ++l) {
    if (!eq(a[l].k_codes, b[l].k_codes) || !eq(a[l].v_codes, b[l].v_codes) || !eq(a[l].k_scales, b[l].k_scales) ||
        !eq(a[l].v_scales, b[l].v_scales) || !eq(a[l].k_sink, b[l].k_sink) || !eq(a[l].v_sink, b[l].v_sink) ||
        !eq(a[l].k_recent, b[l].k_recent) || !eq(a[l].v_recent, b[l].v_recent))
      return false;
  }
  return true;
}

// ---- guarded output -----------------------------------------------------------------------------------

// n floats with sentinel guards on both sides; the payload starts filled with a sentinel too, so
// an element a backend forgot to write is visible.
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr float kSentinel = -31337.25f;
  explicit GuardedBuffer(size_t n) : n_(n), buf_(n + 2 * kGuard, kSentinel) {}
  float* data() { return buf_.data() + kGuard; }
  const float* data() const { return buf_.data() + kGuard; }
  size_t size() const { return n_; }
  bool guards_intact() const {
    for (size_t i = 0; i < kGuard; ++i)
      if (buf_[i] != kSentinel || buf_[kGuard + n_ + i] != kSentinel) return false;
    return true;
  }
  bool fully_written() const {
    for (size_t i = 0; i < n_; ++i)
      if (buf_[kGuard + i] == kSentinel) return false;
    return true;
  }

 private:
  size_t n_;
  std::vector<float> buf_;
};

}  // namespace kvq::attention::testing
