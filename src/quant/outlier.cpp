#include "kvq/quant/outlier.h"

namespace kvq::quant {

OutlierStats quantize_row_outliers(const float* x, int d, const float* thresholds, int slot, int room,
                                   uint8_t* codes, float* scale, std::vector<OutlierEntry>* entries) {
  uint32_t words[kOutlierMaxHeadDim];
  int count = 0;
  const OutlierStats st = value_row(x, d, thresholds, slot, room, codes, scale, words, &count);
  for (int j = 0; j < count; ++j) entries->push_back(unpack_outlier(words[j]));
  return st;
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
