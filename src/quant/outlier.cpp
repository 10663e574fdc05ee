#include "kvq/quant/outlier.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvq/format/bf16.h"
#include "kvq/format/integer.h"
#include "kvq/quant/policy.h"

namespace kvq::quant {
namespace {
constexpr float kFp16Max = 65504.f;  // an outlier beyond fp16's range is stored saturated
}  // namespace

void ChannelStats::update(const float* rows, int n) {
  const size_t c = sum_sq_.size();
  for (int t = 0; t < n; ++t) {
    for (size_t i = 0; i < c; ++i) {
      const float v = rows[static_cast<size_t>(t) * c + i];
      if (!is_finite_value(v)) continue;
      sum_sq_[i] += static_cast<double>(v) * v;
      ++count_[i];
    }
  }
}

float ChannelStats::threshold(int c) const {
  const size_t i = static_cast<size_t>(c);
  if (count_[i] < kOutlierWarmupValues) return std::numeric_limits<float>::infinity();
  return static_cast<float>(kOutlierRmsMultiple * std::sqrt(sum_sq_[i] / static_cast<double>(count_[i])));
}

OutlierStats quantize_row_outliers(const float* x, int d, const float* thresholds, int slot, int room,
                                   uint8_t* codes, float* scale, std::vector<OutlierEntry>* entries) {
  OutlierStats st;
  st.values = static_cast<uint64_t>(d);
  // The head's threshold: the same multiple of the RMS over all its channels. A channel that is
  // large in every token is no outlier of its own distribution, but it is what sets a per-token
  // scale: min(channel, head) flags both rare spikes and such channels.
  double head_sq = 0;
  for (int i = 0; i < d; ++i) head_sq += static_cast<double>(thresholds[i]) * thresholds[i];
  const float head = static_cast<float>(std::sqrt(head_sq / d));  // +inf while any channel warms up
  int cand[256];  // head_dim <= 256
  int n_cand = 0;
  for (int i = 0; i < d; ++i) {
    if (!is_finite_value(x[i])) {
      ++st.nonfinite;
      continue;
    }
    if (abs_value(x[i]) > std::min(thresholds[i], head)) cand[n_cand++] = i;
  }
  std::stable_sort(cand, cand + n_cand, [&](int a, int b) { return abs_value(x[a]) > abs_value(x[b]); });
  const int kept = std::clamp(room, 0, n_cand);
  st.outliers = static_cast<uint64_t>(kept);
  st.overflowed = static_cast<uint64_t>(n_cand - kept);
  // 1: kept as an entry. Overflowed candidates stay ordinary values: they enter the amax, so the
  // row is then plain int4 (never worse), and only the count tells.
  uint8_t role[256] = {};
  for (int j = 0; j < kept; ++j) role[cand[j]] = 1;

  float amax = 0.f;
  for (int i = 0; i < d; ++i)
    if (role[i] == 0) amax = std::max(amax, amax_term(x[i]));
  const float s = scale_for_amax(Format::kInt4, amax);
  *scale = s;
  float v[256];
  for (int i = 0; i < d; ++i) {
    v[i] = role[i] == 1 ? 0.f : x[i];
    if (role[i] != 1 && is_finite_value(x[i]) && clips(Format::kInt4, div_rn(x[i], s))) ++st.clipped;
    if (role[i] == 1) {
      const float kept_value = std::clamp(x[i], -kFp16Max, kFp16Max);
      entries->push_back({static_cast<uint16_t>(slot * d + i), format::float_to_fp16(kept_value)});
    }
  }
  for (int i = 0; i < d; i += 2) codes[i / 2] = quantize_int4_pair(v[i], v[i + 1], s);
  return st;
}

int fair_share(int free_entries, int rows_left) {
  if (free_entries <= 0 || rows_left <= 0) return 0;
  return (free_entries + rows_left - 1) / rows_left;
}

OutlierStats quantize_page_head(const float* x, int n, int d, const float* thresholds, int capacity, uint8_t* codes,
                                float* scales, std::vector<OutlierEntry>* entries) {
  OutlierStats total;
  entries->clear();
  for (int t = 0; t < n; ++t) {
    const int room = fair_share(capacity - static_cast<int>(entries->size()), n - t);
    const OutlierStats r = quantize_row_outliers(x + static_cast<size_t>(t) * d, d, thresholds, t, room,
                                                 codes + static_cast<size_t>(t) * d / 2, &scales[t], entries);
    total.values += r.values, total.outliers += r.outliers, total.overflowed += r.overflowed;
    total.clipped += r.clipped, total.nonfinite += r.nonfinite;
  }
  return total;
}

void apply_outliers(const OutlierEntry* entries, int count, int n, int d, float* y) {
  for (int j = 0; j < count; ++j) {
    if (entries[j].index / d >= n) continue;
    y[entries[j].index] = format::fp16_to_float(entries[j].value);
  }
}

}  // namespace kvq::quant
