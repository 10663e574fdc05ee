// int4_outlier's part of the host cache (quant/outlier.h has the rule): K per channel with scales
// fixed when a page is opened, V per token, both with fp16 sparse entries per page head. Rows are
// taken one token at a time in position order, so statistics, page scales and entries come out
// the same however a sequence's tokens are split into writes.
#include <algorithm>

#include "kvq/cache/paged_cache.h"
#include "kvq/format/bf16.h"
#include "kvq/quant/outlier.h"

namespace kvq::cache {

void PagedKvCache::write_outlier_tokens(Sequence& s, int layer, int pos0, int end, const float* k, const float* v) {
  const int bs = geom_.block_size, heads = geom_.num_kv_heads, d = geom_.head_dim, cap = s.sink_capacity;
  const size_t row_stride = static_cast<size_t>(heads) * d;
  const CacheGeometry kg = plane_geom(layer, 0);
  quant::ChannelStats& ks = key_stats_[static_cast<size_t>(layer)];
  quant::ChannelStats& vs = channel_stats_[static_cast<size_t>(layer)];
  uint32_t* k_words = layers_[static_cast<size_t>(layer)].k_outliers.data();
  const int written_before = s.written[static_cast<size_t>(layer)];
  float thr[quant::kOutlierMaxHeadDim];
  for (int t = pos0; t < end; ++t) {
    const float* krow = k + static_cast<size_t>(t - pos0) * row_stride;
    const float* vrow = v + static_cast<size_t>(t - pos0) * row_stride;
    if (t < cap) {  // a sink row: bf16, but K's statistics count it
      ks.update(krow, 1);
      continue;
    }
    const int u = t - cap, slot = u % bs;
    const int32_t page = s.blocks[static_cast<size_t>(u / bs)];
    const int filled = std::clamp(written_before - (cap + u / bs * bs), 0, bs);
    bool counted = false;
    if (slot == 0) {  // the page opens: its K channel scales come from the rows before it
      if (ks.empty()) {  // none: it bootstraps from its own first row
        ks.update(krow, 1);
        counted = true;
      }
      for (int h = 0; h < heads; ++h)
        for (int c = 0; c < d; ++c)
          store_scale(k_words, kg.channel_scale_index(page, h) + c, ks.key_scale(h * d + c), ScaleDtype::kFp16);
    }
    if (!counted) ks.update(krow, 1);
    vs.update(vrow, 1);  // a V row is judged after it is counted
    for (int h = 0; h < heads; ++h) {
      for (int c = 0; c < d; ++c) thr[c] = load_scale(k_words, kg.channel_scale_index(page, h) + c, ScaleDtype::kFp16);
      write_outlier_row(layer, 0, page, h, slot, filled, krow + static_cast<size_t>(h) * d, thr);
      for (int c = 0; c < d; ++c) thr[c] = vs.threshold(h * d + c);
      write_outlier_row(layer, 1, page, h, slot, filled, vrow + static_cast<size_t>(h) * d, thr);
    }
  }
}

// The page head's entries of other slots that hold data (below `filled`, the slots the page had
// before this write, or below `slot`, those this write has filled) are kept in order; then the row
// takes its fair share of what is free. A device writer appends (filled == slot).
void PagedKvCache::write_outlier_row(int layer, int kv, int32_t page, int h, int slot, int filled, const float* x,
                                     const float* thr) {
  const CacheGeometry g = plane_geom(layer, kv);
  const int d = g.head_dim;
  Planes& pl = layers_[static_cast<size_t>(layer)];
  uint32_t* plane = (kv == 0 ? pl.k_outliers.data() : pl.v_outliers.data()) + g.outlier_index(page, h);
  uint32_t* words = plane + 1;  // plane[0]: the count
  const int keep_below = std::max(filled, slot);
  int count = 0;
  for (uint32_t j = 0; j < plane[0]; ++j) {
    const int es = quant::unpack_outlier(words[j]).index / d;
    if (es != slot && es < keep_below) words[count++] = words[j];
  }
  const int room = quant::fair_share(g.outlier_capacity - count, g.block_size - slot);
  uint8_t* codes = (kv == 0 ? pl.k_codes.data() : pl.v_codes.data()) + g.code_offset(page, h, slot);
  const quant::OutlierStats st =
      kv == 0 ? quant::key_row(x, d, thr, slot, room, codes, words, &count)
              : quant::value_row(x, d, thr, slot, room, codes, &pl.v_scales[g.scale_index(page, h, slot)], words, &count);
  plane[0] = static_cast<uint32_t>(count);
  stats_.values += st.values, stats_.nonfinite += st.nonfinite, stats_.saturated += st.clipped;
  stats_.outliers += st.outliers, stats_.outlier_overflow += st.overflowed;
}

void PagedKvCache::read_outliers(const CacheGeometry& g, const uint32_t* words, int32_t page, int h, int slot,
                                 float* out) {
  const int d = g.head_dim;
  if (g.channel_scales) {
    for (int c = 0; c < d; ++c) out[c] *= load_scale(words, g.channel_scale_index(page, h) + c, ScaleDtype::kFp16);
  }
  const uint32_t* plane = words + g.outlier_index(page, h);
  for (uint32_t j = 0; j < plane[0]; ++j) {
    const quant::OutlierEntry e = quant::unpack_outlier(plane[1 + j]);
    if (e.index / d == slot) out[e.index % d] = format::fp16_to_float(e.value);
  }
}

}  // namespace kvq::cache
