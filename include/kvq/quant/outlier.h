#pragma once
// Outlier-aware int4 (`--kv-cache-dtype int4_outlier`, KVQuant-style dense + sparse): int4 codes,
// K scaled per channel and V per (token, head), plus a fixed-capacity side plane per (page, kv head)
// of sparse fp16 entries for the values the grid would serve badly.
//
// V thresholds (ChannelStats): per channel c (kv head x head dim) of one layer's V, the running
// RMS r_c over every finite value of the rows written to that layer's quantized pages so far,
// accumulated in double, one row at a time in write order; thr_c = kOutlierRmsMultiple * r_c. A row
// is judged after it has been counted. Until a channel has seen kOutlierWarmupValues values its
// threshold is +inf.
// A value is a candidate when |x| > min(thr_c, thr_head), thr_head being the RMS of the head's
// thr_c (the same multiple of the head's RMS over all channels): the channel term flags rare
// spikes, the head term the channels that are large in every token (no outliers of their own
// distribution, but what sets a per-token scale).
//
// A V row (value_row) takes at most `room` candidates, largest |x| first (ties: the
// lower channel); its scale comes from its other values (amax / 7), so a kept outlier cannot
// coarsen the grid; it stores code 0 and its value as fp16 (saturated to +-65504).
// Capacity and overflow: a page head holds kOutlierEntriesPerToken * block_size entries; the row
// at slot t may take fair_share(free entries, block_size - t) of them (entries in write order).
// Candidates beyond that overflow: they stay ordinary values of their row (they enter its amax,
// so the row is plain int4 and nothing clips) and are counted (QuantStats::outlier_overflow).
// Non-finite values follow the cache's policy: code 0, never an outlier, counted.
// (This V rule is the one int4_outlier had before K became per channel, except that the statistics
// now advance row by row rather than write by write, so a write's split into chunks does not
// change its codes.)
//
// K is quantized per channel (KVQuant's per-channel keys), V per token as above:
// - Statistics (sum of squares and count per channel c of the layer's K, every
//   finite value of every row written to the layer, sink rows included, one row at a time in
//   write order) give the running RMS r_c.
// - A page head's channel scales are fixed when its slot 0 is written (the page is opened), from
//   the statistics of the rows written before that row: s_c = kKeyChannelRmsMultiple * r_c / 7
//   rounded up to fp16 (key_channel_scale), stored as fp16 per (page, head, channel). When the layer has
//   no row yet (no sink, first page) the opening row is counted first, so the page bootstraps
//   from its own first token. Because a page's scales depend only on rows before it, chunked
//   prefill and token-by-token decode give the same pages (for one sequence; the statistics are
//   the layer's, so other sequences' rows written earlier count too).
// - A value whose code would clip (|x / s_c| > 7.5) is a candidate; a row keeps at most `room`
//   of them (the same fair share of the page head's capacity as V), the largest clipping error
//   |x| - 7 s_c first (ties: the lower channel), as fp16 entries with code 0. Candidates beyond
//   the share are clipped to +-7 and counted (outlier_overflow and clipped): the grid of the
//   other rows and channels never changes after the page is opened.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/macros.h"
#include "kvq/format/bf16.h"
#include "kvq/quant/policy.h"

namespace kvq::quant {

inline constexpr double kOutlierRmsMultiple = 4.0;
inline constexpr uint64_t kOutlierWarmupValues = 16;
inline constexpr int kOutlierEntriesPerToken = 1;  // page head capacity = block_size * this
// Measured on SmolLM2 (bench/results/2026-12-01-cpu-int4-outlier.md): 2 beats 1.5, 2.5, 3 and 4;
// a finer grid is worth more than the values it sends to the sparse entries or clips.
inline constexpr double kKeyChannelRmsMultiple = 2.0;
inline constexpr int kOutlierMaxHeadDim = 256;

// One sparse entry: index = slot * head_dim + channel (< 2^16: slot < 32, head_dim <= 256), the
// value as fp16 bits. Stored as one 32-bit word, index in the low half.
struct OutlierEntry {
  uint16_t index = 0;
  uint16_t value = 0;
};
KVQ_HD uint32_t pack_outlier(OutlierEntry e) { return uint32_t(e.index) | (uint32_t(e.value) << 16); }
KVQ_HD OutlierEntry unpack_outlier(uint32_t w) {
  return {static_cast<uint16_t>(w & 0xffffu), static_cast<uint16_t>(w >> 16)};
}

struct OutlierStats {
  uint64_t values = 0;      // values encoded
  uint64_t outliers = 0;    // kept as sparse entries
  uint64_t overflowed = 0;  // candidates beyond the row's share (V: left as ordinary values; K: clipped)
  uint64_t clipped = 0;     // values whose int4 code saturated
  uint64_t nonfinite = 0;   // NaN / inf: stored as 0
};

// ---- host + device primitives (the host cache and the CUDA writer run these same functions) -----

// Running statistics of `channels` channels: sum of squares and count of finite values per channel
// (count[channels] counts the rows). The product of two floats is exact in double, so only the sum
// rounds, and an FMA gives the same result: host and device agree bit for bit.
KVQ_HD void stats_add_row(double* sum_sq, uint64_t* count, const float* row, int channels) {
  for (int i = 0; i < channels; ++i) {
    if (!is_finite_value(row[i])) continue;
    sum_sq[i] += static_cast<double>(row[i]) * static_cast<double>(row[i]);
    ++count[i];
  }
  ++count[channels];
}
// V: kOutlierRmsMultiple * the running RMS; +inf before the warm-up.
KVQ_HD float value_threshold(double sum_sq, uint64_t count) {
  if (count < kOutlierWarmupValues) return __builtin_huge_valf();
  return static_cast<float>(kOutlierRmsMultiple * sqrt(sum_sq / static_cast<double>(count)));
}
// The fp16 K channel scale of a page opened after `count` values with sum of squares `sum_sq`:
// amax = float(kKeyChannelRmsMultiple * sqrt(sum_sq / count)) in double, then int4's scale for that
// amax rounded up to fp16 (quant/policy.h; count 0 or amax 0 give 1).
KVQ_HD float key_channel_scale(double sum_sq, uint64_t count) {
  const double rms = count > 0 ? sqrt(sum_sq / static_cast<double>(count)) : 0.0;
  return scale_for_amax(Format::kInt4, static_cast<float>(kKeyChannelRmsMultiple * rms), ScaleDtype::kFp16);
}
// Whether K value x (finite) needs a sparse entry under channel scale s: its code would clip.
KVQ_HD bool key_clips(float x, float s) { return clips(Format::kInt4, div_rn(x, s)); }
// What clipping x to the grid's edge would cost: |x| - 7 s (7 s is exact: s is an fp16 value).
KVQ_HD float key_clip_error(float x, float s) { return abs_value(x) - format_qmax(Format::kInt4) * s; }

// Entries a row may take: ceil(free_entries / rows_left) (rows_left: this row and the later slots
// of its page), 0 when nothing is free.
KVQ_HD int fair_share(int free_entries, int rows_left) {
  if (free_entries <= 0 || rows_left <= 0) return 0;
  return (free_entries + rows_left - 1) / rows_left;
}

// Orders cand[0, n) by key[cand[i]] descending, stable (insertion sort: n <= head_dim).
KVQ_HD void sort_candidates(int* cand, int n, const float* key) {
  for (int i = 1; i < n; ++i) {
    const int c = cand[i];
    int j = i;
    while (j > 0 && key[cand[j - 1]] < key[c]) {
      cand[j] = cand[j - 1];
      --j;
    }
    cand[j] = c;
  }
}

// Appends the entries of a row's kept channels (cand[0, kept)) in channel order, values as fp16
// (saturated to +-65504).
KVQ_HD void append_entries(const float* x, const int* cand, int kept, int d, int slot, uint32_t* words, int* count) {
  bool is_kept[kOutlierMaxHeadDim];
  for (int i = 0; i < d; ++i) is_kept[i] = false;
  for (int j = 0; j < kept; ++j) is_kept[cand[j]] = true;
  for (int i = 0; i < d; ++i) {
    if (!is_kept[i]) continue;
    const float v = x[i] < -65504.f ? -65504.f : (x[i] > 65504.f ? 65504.f : x[i]);
    words[(*count)++] = pack_outlier({static_cast<uint16_t>(slot * d + i), format::float_to_fp16(v)});
  }
}

// One V row x [d] (d even) of slot `slot`: packed int4 codes (d / 2 bytes), its scale, and at most
// `room` entries appended at words[*count] (++*count each). thresholds: [d], this head's channels.
KVQ_HD OutlierStats value_row(const float* x, int d, const float* thresholds, int slot, int room, uint8_t* codes,
                              float* scale, uint32_t* words, int* count) {
  OutlierStats st;
  st.values = static_cast<uint64_t>(d);
  // The head's threshold: the same multiple of the RMS over all its channels. A channel that is
  // large in every token is no outlier of its own distribution, but it is what sets a per-token
  // scale: min(channel, head) flags both rare spikes and such channels.
  double head_sq = 0;
  for (int i = 0; i < d; ++i) head_sq += static_cast<double>(thresholds[i]) * static_cast<double>(thresholds[i]);
  const float head = static_cast<float>(sqrt(head_sq / d));  // +inf while any channel warms up
  int cand[kOutlierMaxHeadDim];
  float key[kOutlierMaxHeadDim];
  int n_cand = 0;
  for (int i = 0; i < d; ++i) {
    key[i] = abs_value(x[i]);
    if (!is_finite_value(x[i])) {
      ++st.nonfinite;
      continue;
    }
    const float thr = thresholds[i] < head ? thresholds[i] : head;
    if (key[i] > thr) cand[n_cand++] = i;
  }
  sort_candidates(cand, n_cand, key);
  const int kept = room < 0 ? 0 : (room < n_cand ? room : n_cand);
  st.outliers = static_cast<uint64_t>(kept);
  st.overflowed = static_cast<uint64_t>(n_cand - kept);
  // Kept values are 0 in the codes; overflowed candidates stay ordinary values: they enter the
  // amax, so the row is then plain int4 (never worse), and only the count tells.
  float v[kOutlierMaxHeadDim];
  for (int i = 0; i < d; ++i) v[i] = x[i];
  for (int j = 0; j < kept; ++j) v[cand[j]] = 0.f;
  append_entries(x, cand, kept, d, slot, words, count);
  float amax = 0.f;
  for (int i = 0; i < d; ++i) amax = amax_term(v[i]) > amax ? amax_term(v[i]) : amax;
  const float s = scale_for_amax(Format::kInt4, amax);
  *scale = s;
  for (int i = 0; i < d; ++i)
    if (is_finite_value(v[i]) && clips(Format::kInt4, div_rn(v[i], s))) ++st.clipped;
  for (int i = 0; i < d; i += 2) codes[i / 2] = quantize_int4_pair(v[i], v[i + 1], s);
  return st;
}

// One K row under the page head's channel scales [d]: codes and at most `room` entries (the rule above).
KVQ_HD OutlierStats key_row(const float* x, int d, const float* scales, int slot, int room, uint8_t* codes,
                            uint32_t* words, int* count) {
  OutlierStats st;
  st.values = static_cast<uint64_t>(d);
  int cand[kOutlierMaxHeadDim];
  float key[kOutlierMaxHeadDim], q[kOutlierMaxHeadDim];
  int n_cand = 0;
  for (int i = 0; i < d; ++i) {
    q[i] = 0.f;
    if (!is_finite_value(x[i])) {
      ++st.nonfinite;
      continue;
    }
    q[i] = div_rn(x[i], scales[i]);
    key[i] = key_clip_error(x[i], scales[i]);
    if (clips(Format::kInt4, q[i])) cand[n_cand++] = i;
  }
  sort_candidates(cand, n_cand, key);
  const int kept = room < 0 ? 0 : (room < n_cand ? room : n_cand);
  st.outliers = static_cast<uint64_t>(kept);
  st.overflowed = st.clipped = static_cast<uint64_t>(n_cand - kept);
  for (int j = 0; j < kept; ++j) q[cand[j]] = 0.f;
  append_entries(x, cand, kept, d, slot, words, count);
  // x / s is already divided: encoding it with scale 1 divides by 1, exactly.
  for (int i = 0; i < d; i += 2) codes[i / 2] = quantize_int4_pair(q[i], q[i + 1], 1.f);
  return st;
}

// ---- host conveniences (tests, tools) ----------------------------------------------------------

// Running V statistics of one layer (stats_add_row over owned arrays).
class ChannelStats {
 public:
  explicit ChannelStats(int channels = 0)
      : sum_sq_(static_cast<size_t>(channels), 0.0), count_(static_cast<size_t>(channels) + 1, 0) {}
  // rows: [n][channels]; non-finite values are skipped.
  void update(const float* rows, int n) {
    for (int t = 0; t < n; ++t) stats_add_row(sum_sq_.data(), count_.data(), rows + static_cast<size_t>(t) * channels(), channels());
  }
  float threshold(int c) const { return value_threshold(sum_sq_[static_cast<size_t>(c)], count_[static_cast<size_t>(c)]); }
  float key_scale(int c) const { return key_channel_scale(sum_sq_[static_cast<size_t>(c)], count_[static_cast<size_t>(c)]); }
  bool empty() const { return count_.back() == 0; }
  int channels() const { return static_cast<int>(sum_sq_.size()); }
  double* sum_sq() { return sum_sq_.data(); }
  uint64_t* count() { return count_.data(); }  // [channels + 1], the row count last

 private:
  std::vector<double> sum_sq_;
  std::vector<uint64_t> count_;
};

// value_row with the entries appended to a vector.
OutlierStats quantize_row_outliers(const float* x, int d, const float* thresholds, int slot, int room,
                                   uint8_t* codes, float* scale, std::vector<OutlierEntry>* entries);

// A whole V page head, rows [n][d] in slot order sharing `capacity` entries by fair_share (the
// cache's rule, for tests and tools): codes [n][d / 2], scales [n], entries in write order.
OutlierStats quantize_page_head(const float* x, int n, int d, const float* thresholds, int capacity, uint8_t* codes,
                                float* scales, std::vector<OutlierEntry>* entries);

// Writes entry values over y, a page head's dequantized rows [n][d] (slot 0 first); entries of
// slots >= n are skipped.
void apply_outliers(const OutlierEntry* entries, int count, int n, int d, float* y);

}  // namespace kvq::quant
