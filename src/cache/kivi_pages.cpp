// int4_kivi pages of the host cache: quantized once, from the bf16 twin, when they leave the
// recent window (paged_cache.h has the contract, quant/kivi_policy.h the rule).
#include <algorithm>
#include <string>

#include "kvq/cache/paged_cache.h"
#include "kvq/format/bf16.h"
#include "kvq/quant/kivi_policy.h"

namespace kvq::cache {

Status PagedKvCache::check_kivi_twins(const Sequence& s, int pos0, int end) const {
  const int bs = geom_.block_size, cap = s.sink_capacity;
  for (int b = (std::max(pos0, cap) - cap) / bs; end > cap && b <= (end - 1 - cap) / bs; ++b)
    if (static_cast<size_t>(b) >= s.recent_blocks.size() || s.recent_blocks[static_cast<size_t>(b)] < 0)
      return invalid_argument("int4_kivi: writing tokens [" + std::to_string(pos0) + ", " + std::to_string(end) +
                              ") reaches main page " + std::to_string(b) +
                              ", which has left the recent window (its bf16 copy is released and its codes are "
                              "final); write every layer's tokens before extending the sequence past them");
  return Status::ok();
}

Status PagedKvCache::kivi_pages_made_final(SeqId seq, int pos0, int n,
                                           std::vector<std::pair<int32_t, int32_t>>& out) const {
  if (seq_len(seq) < 0) return invalid_argument("int4_kivi: unknown sequence " + std::to_string(seq));
  const int bs = geom_.block_size, R = recent_tokens(), cap = sink_capacity(seq);
  const std::vector<int32_t>& blocks = block_table(seq);
  const std::vector<int32_t>& twins = recent_table(seq);
  const int first = kivi_final_page_count(pos0 - cap, bs, R);
  const int end = std::min(kivi_final_page_count(pos0 + n - cap, bs, R), static_cast<int>(blocks.size()));
  for (int b = first; b < end; ++b) {
    if (static_cast<size_t>(b) >= twins.size() || twins[static_cast<size_t>(b)] < 0)
      return invalid_argument("int4_kivi: main page " + std::to_string(b) + " of sequence " + std::to_string(seq) +
                              " must be quantized from its bf16 twin, which was released; write every layer's "
                              "tokens before extending the sequence past them");
    out.emplace_back(blocks[static_cast<size_t>(b)], twins[static_cast<size_t>(b)]);
  }
  return Status::ok();
}

void PagedKvCache::finalize_kivi_pages(Sequence& s, int layer, const std::function<bool(int)>& final_page) {
  const int bs = geom_.block_size;
  int& done = s.kivi_final[static_cast<size_t>(layer)];
  const int main_written = s.written[static_cast<size_t>(layer)] - s.sink_capacity;
  while (static_cast<size_t>(done) < s.blocks.size() && final_page(done) && (done + 1) * bs <= main_written) {
    quantize_kivi_page(layer, s.blocks[static_cast<size_t>(done)], s.recent_blocks[static_cast<size_t>(done)]);
    ++done;
  }
}

void PagedKvCache::quantize_kivi_page(int layer, int32_t page, int32_t twin) {
  const int bs = geom_.block_size, d = geom_.head_dim;
  Planes& pl = layers_[static_cast<size_t>(layer)];
  float x[32 * 256];  // one page head: block <= 32 tokens of head_dim <= 256
  for (int kv = 0; kv < 2; ++kv) {
    const CacheGeometry g = plane_geom(layer, kv);
    const uint16_t* src = (kv == 0 ? pl.k_recent : pl.v_recent).data();
    uint8_t* codes = (kv == 0 ? pl.k_codes : pl.v_codes).data();
    void* params = (kv == 0 ? pl.k_scales : pl.v_scales).data();
    for (int h = 0; h < geom_.num_kv_heads; ++h) {
      for (int t = 0; t < bs; ++t)
        for (int c = 0; c < d; ++c)
          x[t * d + c] = format::bf16_to_float(src[geom_.elem_index(twin, h, t) + static_cast<size_t>(c)]);
      // K groups a channel over the page's tokens, V a token's channels (CacheGeometry::kivi_groups).
      quant::KiviParams p[256];
      for (int grp = 0; grp < g.kivi_groups(); ++grp) {
        quant::KiviRange r;
        for (int j = 0; j < (kv == 0 ? bs : d); ++j) r.add(kv == 0 ? x[j * d + grp] : x[grp * d + j]);
        p[grp] = quant::kivi_params(r);
        stats_.scale_clamped += quant::kivi_scale_clamped(r);
        store_scale(params, g.kivi_param_index(page, h, grp, false), p[grp].scale, g.scale_dtype);
        store_scale(params, g.kivi_param_index(page, h, grp, true), p[grp].zero, g.scale_dtype);
      }
      for (int t = 0; t < bs; ++t) {
        uint8_t* row = codes + g.code_offset(page, h, t);
        const float* xr = x + t * d;
        for (int c = 0; c < d; c += 2) {
          const quant::KiviParams& lo = kv == 0 ? p[c] : p[t];
          const quant::KiviParams& hi = kv == 0 ? p[c + 1] : p[t];
          row[c / 2] = quant::kivi_code_pair(xr[c], xr[c + 1], lo, hi);
          stats_.saturated += quant::kivi_clips(xr[c], lo) + quant::kivi_clips(xr[c + 1], hi);
        }
      }
    }
  }
}

Status PagedKvCache::read_kivi_token(const Sequence& s, int layer, int u, float* k, float* v) const {
  const int bs = geom_.block_size, d = geom_.head_dim, b = u / bs, slot = u % bs;
  const Planes& pl = layers_[static_cast<size_t>(layer)];
  const int32_t page = s.blocks[static_cast<size_t>(b)];
  const bool coded = b < s.kivi_final[static_cast<size_t>(layer)];
  const int32_t twin = static_cast<size_t>(b) < s.recent_blocks.size() ? s.recent_blocks[static_cast<size_t>(b)] : -1;
  if (!coded && twin < 0)
    return invalid_argument("int4_kivi: token " + std::to_string(s.sink_capacity + u) + " of layer " +
                            std::to_string(layer) + " lies in a page that left the recent window before this layer "
                            "wrote it in full, so it was never quantized");
  for (int kv = 0; kv < 2; ++kv) {
    const CacheGeometry g = plane_geom(layer, kv);
    float* out = kv == 0 ? k : v;
    for (int h = 0; h < geom_.num_kv_heads; ++h) {
      float* o = out + static_cast<size_t>(h) * d;
      if (!coded) {  // still in the window: what a recent query reads
        const uint16_t* src = (kv == 0 ? pl.k_recent : pl.v_recent).data() + geom_.elem_index(twin, h, slot);
        for (int c = 0; c < d; ++c) o[c] = format::bf16_to_float(src[c]);
        continue;
      }
      const uint8_t* row = (kv == 0 ? pl.k_codes : pl.v_codes).data() + g.code_offset(page, h, slot);
      const void* params = (kv == 0 ? pl.k_scales : pl.v_scales).data();
      for (int c = 0; c < d; ++c) {
        const int grp = kv == 0 ? c : slot;
        const quant::KiviParams p{load_scale(params, g.kivi_param_index(page, h, grp, false), g.scale_dtype),
                                  load_scale(params, g.kivi_param_index(page, h, grp, true), g.scale_dtype)};
        o[c] = quant::kivi_value(format::uint4_at(row, static_cast<size_t>(c)), p);
      }
    }
  }
  return Status::ok();
}

}  // namespace kvq::cache
