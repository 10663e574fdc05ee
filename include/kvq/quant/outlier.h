#pragma once
// Outlier-aware int4 (`--kv-cache-dtype int4_outlier`, KVQuant-style dense + sparse): int4 codes
// per (token, head) as `int4`, plus a fixed-capacity side plane per (page, kv head) of sparse fp16
// entries for the values that would coarsen their row's grid.
//
// Thresholds (ChannelStats): per channel c (kv head x head dim) of one layer's K (or V, apart),
// the running RMS r_c over every finite value written to that layer's quantized pages so far,
// accumulated in double; thr_c = kOutlierRmsMultiple * r_c. A write updates the statistics with
// its rows *before* they are quantized, so the first write is judged by its own statistics. Until
// a channel has seen kOutlierWarmupValues values its threshold is +inf.
// A value is a candidate when |x| > min(thr_c, thr_head), thr_head being the RMS of the head's
// thr_c (the same multiple of the head's RMS over all channels): the channel term flags rare
// spikes, the head term the channels that are large in every token (no outliers of their own
// distribution, but what sets a per-token scale).
//
// A row (quantize_row_outliers) takes at most `room` candidates, largest |x| first (ties: the
// lower channel); its scale comes from its other values (amax / 7), so a kept outlier cannot
// coarsen the grid; it stores code 0 and its value as fp16 (saturated to +-65504).
// Capacity and overflow: a page head holds kOutlierEntriesPerToken * block_size entries; the row
// at slot t may take fair_share(free entries, block_size - t) of them (entries in write order).
// Candidates beyond that overflow: they stay ordinary values of their row (they enter its amax,
// so the row is plain int4 and nothing clips) and are counted (QuantStats::outlier_overflow).
// Non-finite values follow the cache's policy: code 0, never an outlier, counted.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common/macros.h"

namespace kvq::quant {

inline constexpr double kOutlierRmsMultiple = 4.0;
inline constexpr uint64_t kOutlierWarmupValues = 16;
inline constexpr int kOutlierEntriesPerToken = 1;  // page head capacity = block_size * this

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
  uint64_t overflowed = 0;  // candidates beyond the row's share: left as ordinary int4 values
  uint64_t clipped = 0;     // values whose int4 code saturated (0 unless the row is all outliers)
  uint64_t nonfinite = 0;   // NaN / inf: stored as 0
};

// Running per-channel statistics of one layer's K or V.
class ChannelStats {
 public:
  explicit ChannelStats(int channels = 0)
      : sum_sq_(static_cast<size_t>(channels), 0.0), count_(static_cast<size_t>(channels), 0) {}
  // rows: [n][channels]; non-finite values are skipped.
  void update(const float* rows, int n);
  // kOutlierRmsMultiple * running RMS of channel c; +inf before the warm-up.
  float threshold(int c) const;
  int channels() const { return static_cast<int>(sum_sq_.size()); }

 private:
  std::vector<double> sum_sq_;
  std::vector<uint64_t> count_;
};

// Entries a row may take: ceil(free_entries / rows_left) (rows_left: this row and the later slots
// of its page), 0 when nothing is free.
int fair_share(int free_entries, int rows_left);

// One row x [d] (d even) of slot `slot`: packed int4 codes (d / 2 bytes), its scale, and at most
// `room` entries appended to `entries`. thresholds: [d], this head's channels.
OutlierStats quantize_row_outliers(const float* x, int d, const float* thresholds, int slot, int room,
                                   uint8_t* codes, float* scale, std::vector<OutlierEntry>* entries);

// A whole page head, rows [n][d] in slot order sharing `capacity` entries by fair_share (the
// cache's rule, for tests and tools): codes [n][d / 2], scales [n], entries in write order.
OutlierStats quantize_page_head(const float* x, int n, int d, const float* thresholds, int capacity, uint8_t* codes,
                                float* scales, std::vector<OutlierEntry>* entries);

// Writes entry values over y, a page head's dequantized rows [n][d] (slot 0 first); entries of
// slots >= n are skipped.
void apply_outliers(const OutlierEntry* entries, int count, int n, int d, float* y);

}  // namespace kvq::quant
