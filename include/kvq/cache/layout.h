#pragma once
// Page geometry and raw views of the paged KV cache, shared by the CPU reference and the CUDA
// kernels (DESIGN §4). Everything here is plain data so it can be passed to a kernel by value.
//
// Per layer, K and V each have:
//   codes  [num_pages][num_kv_heads][block_size][head_dim]   elements of `format` (head-major);
//          int4 packs two per byte (element 2i in the low nibble), so a row is head_dim / 2 bytes.
//          Always address codes through code_offset / row_code_bytes, never elem_index * bytes.
//   scales plane, separate and 128-byte aligned, elements of the spec's scale dtype (fp32, or fp16
//   bits; quant/policy.h says how an fp16 scale is chosen); read and written only through
//   load_scale / store_scale below:
//     per_token_head: [num_pages][num_kv_heads][block_size]
//     per_block_head: [num_pages][num_kv_heads]
//     per_tensor:     [1]                       (0 until the first write)
//     int4_kivi:      [num_pages][num_kv_heads][2][groups] fp16: scales then zero points, K one
//                     group per channel (head_dim), V one per slot (block_size); kivi_param_index
//     bf16/fp16:      none
//   sink   [num_sink_pages][num_kv_heads][block_size][head_dim] bf16
//   outliers (int4_outlier only): [num_pages][num_kv_heads][outlier_stride()] uint32: a count,
//          then that many sparse entries (quant/outlier.h: slot * head_dim + channel, fp16 value)
//          in a room of outlier_capacity words; the K plane then holds head_dim fp16 channel scales
//          (two a word, channel 2i in the low half) and has no scale plane (per-channel K)
//   recent [num_recent_pages][num_kv_heads][block_size][head_dim] bf16 (bf16 recent window)
// One block table per sequence is shared by all layers: page p is page p in every layer's pool.
// Token t of a sequence lives in the sink when t < sink_len (sink page sink_table[t / bs]),
// otherwise at u = t - sink_len in page block_table[u / bs], slot u % bs.
// Recent window (recent_tokens R > 0): main page block_table[b] may have a bf16 twin
// recent_table[b] (same slots; -1 once the page has left the window). A query at position q reads
// key t >= sink_len from the twin iff t >= q + 1 - R (uses_recent), otherwise from the codes.
// int4_kivi writes a page's codes only once, from its twin, when the page's first token leaves the
// window of the last query written (kivi_page_final): before that the page's codes are unset.
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include "kvq/common/macros.h"
#include "kvq/format/bf16.h"
#include "kvq/format/format.h"
#include "kvq/quant/outlier.h"
#include "kvq/quant/spec.h"

namespace kvq::cache {

inline constexpr size_t kPlaneAlignment = 128;

KVQ_HD size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct CacheGeometry {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  int num_pages = 0;       // quantized pages per layer (the main pool)
  int num_sink_pages = 0;  // bf16 sink pages per layer
  int num_recent_pages = 0;  // bf16 recent-window pages per layer
  int recent_tokens = 0;     // R of the recent window (0 = off; always 0 for unquantized formats)
  Format format = Format::kBf16;
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  int outlier_capacity = 0;  // sparse entries per page head (int4_outlier); 0: no outlier plane
  ScaleDtype scale_dtype = ScaleDtype::kFp32;
  // One layer of a per-layer mix (QuantSpec::plane_formats) may store V in another format than K:
  // then mixed_kv is set, `format` is K's and v_format V's. The size and index functions below
  // describe one plane of `format`; code that reads both planes asks plane(kv) for each.
  Format v_format = Format::kBf16;
  bool mixed_kv = false;
  // The plane (0 = K, 1 = V) a geometry from plane(kv) describes: int4_kivi groups K and V apart,
  // so its parameter planes differ in size. 0 (K's shape) in the cache-wide geometry.
  int plane_kv = 0;
  // Set by plane(0) of an int4_outlier geometry: K's scales are per (page, head, channel), fp16, kept in
  // the K outlier plane after the entries (channel_scale_index); such a plane has no scale plane.
  bool channel_scales = false;

  KVQ_HD Format plane_format(int kv) const { return kv == 1 && mixed_kv ? v_format : format; }
  KVQ_HD CacheGeometry plane(int kv) const {
    CacheGeometry g = *this;
    g.format = plane_format(kv);
    g.mixed_kv = false;
    g.plane_kv = kv;
    g.channel_scales = kv == 0 && outlier_capacity > 0;
    return g;
  }
  // int4_kivi (quant/kivi_policy.h): a (scale, zero point) pair per group of a page head, K one per
  // channel, V one per slot. Its scale plane is [page][head][scale | zero][group] in the scale
  // dtype (fp16), addressed through kivi_param_index only.
  KVQ_HD bool kivi() const { return format == Format::kInt4Kivi; }
  KVQ_HD int kivi_groups() const { return plane_kv == 1 ? block_size : head_dim; }
  KVQ_HD size_t kivi_param_index(int page, int head, int group, bool zero) const {
    return ((static_cast<size_t>(page) * num_kv_heads + head) * 2 + (zero ? 1 : 0)) * kivi_groups() + group;
  }

  KVQ_HD size_t elems_per_head_tile() const { return static_cast<size_t>(block_size) * head_dim; }
  KVQ_HD size_t elems_per_page() const { return elems_per_head_tile() * num_kv_heads; }
  KVQ_HD size_t bytes_per_page() const { return elems_per_page() * format_bits(format) / 8; }
  KVQ_HD size_t bytes_per_sink_page() const { return elems_per_page() * 2; }
  // Element index of (page, head, slot, dim 0) in a codes (or sink) array.
  KVQ_HD size_t elem_index(int page, int head, int slot) const {
    return ((static_cast<size_t>(page) * num_kv_heads + head) * block_size + slot) * head_dim;
  }
  // Byte offset of (page, head, slot, dim 0) in a codes plane. head_dim is a multiple of 8, so a
  // packed int4 row starts on a whole byte.
  KVQ_HD size_t code_offset(int page, int head, int slot) const {
    return elem_index(page, head, slot) * format_bits(format) / 8;
  }
  // Bytes of one (token, head) row of codes.
  KVQ_HD size_t row_code_bytes() const { return static_cast<size_t>(head_dim) * format_bits(format) / 8; }
  // Whether the plane has a scale plane (per_token_head / per_block_head / per_tensor scales).
  KVQ_HD bool has_scales() const { return is_quantized(format) && !channel_scales; }
  KVQ_HD size_t scale_bytes() const { return scale_dtype == ScaleDtype::kFp16 ? 2 : 4; }
  // Number of scales per page (0 for per_tensor and unquantized formats; int4_kivi: scales and
  // zero points).
  KVQ_HD size_t scales_per_page() const {
    if (!has_scales()) return 0;
    if (kivi()) return static_cast<size_t>(num_kv_heads) * 2 * kivi_groups();
    switch (granularity) {
      case ScaleGranularity::kPerTokenHead: return static_cast<size_t>(num_kv_heads) * block_size;
      case ScaleGranularity::kPerBlockHead: return static_cast<size_t>(num_kv_heads);
      default: return 0;
    }
  }
  // Index into the scale plane for (page, head, slot); per_tensor always 0. Not for int4_kivi.
  KVQ_HD size_t scale_index(int page, int head, int slot) const {
    switch (granularity) {
      case ScaleGranularity::kPerTokenHead:
        return (static_cast<size_t>(page) * num_kv_heads + head) * block_size + slot;
      case ScaleGranularity::kPerBlockHead:
        return static_cast<size_t>(page) * num_kv_heads + head;
      default: return 0;
    }
  }
  KVQ_HD size_t scale_plane_bytes() const {
    if (!has_scales()) return 0;
    size_t n = granularity == ScaleGranularity::kPerTensor ? 1 : scales_per_page() * num_pages;
    return align_up(n * scale_bytes(), kPlaneAlignment);
  }
  // Outlier plane: per page head the count, `capacity` entry words and, on a channel_scales (K)
  // plane, head_dim / 2 words of fp16 channel scales.
  KVQ_HD size_t outlier_stride() const {
    return static_cast<size_t>(1 + outlier_capacity) + (channel_scales ? static_cast<size_t>(head_dim) / 2 : 0);
  }
  KVQ_HD size_t outlier_words_per_page() const {
    return outlier_capacity > 0 ? static_cast<size_t>(num_kv_heads) * outlier_stride() : 0;
  }
  KVQ_HD size_t outlier_index(int page, int head) const {
    return (static_cast<size_t>(page) * num_kv_heads + head) * outlier_stride();
  }
  // fp16 element index (load_scale / store_scale with kFp16 over the outlier plane) of channel 0's
  // scale of (page, head); channel c's is this + c.
  KVQ_HD size_t channel_scale_index(int page, int head) const {
    return 2 * (outlier_index(page, head) + 1 + static_cast<size_t>(outlier_capacity));
  }
  KVQ_HD size_t outlier_plane_bytes() const {
    return align_up(outlier_words_per_page() * num_pages * sizeof(uint32_t), kPlaneAlignment);
  }
  KVQ_HD size_t code_plane_bytes() const { return align_up(bytes_per_page() * num_pages, kPlaneAlignment); }
  KVQ_HD size_t sink_plane_bytes() const {
    return align_up(bytes_per_sink_page() * num_sink_pages, kPlaneAlignment);
  }
  KVQ_HD size_t recent_plane_bytes() const {
    return align_up(bytes_per_sink_page() * num_recent_pages, kPlaneAlignment);
  }
};

// Whether a query at position `q_pos` reads main-pool key `key_pos` from its bf16 recent twin.
KVQ_HD bool uses_recent(int key_pos, int q_pos, int recent_tokens) {
  return recent_tokens > 0 && key_pos >= q_pos + 1 - recent_tokens;
}
// int4_kivi: whether main page `block` (first main-part index block * bs) must hold its final
// codes once main-part indices [0, main_written) are written, i.e. whether the last of those
// queries (main index main_written - 1) reads its first token from the codes. R >= block_size
// makes such a page complete.
KVQ_HD bool kivi_page_final(int block, int block_size, int main_written, int recent_tokens) {
  return block * block_size < main_written - recent_tokens;
}
// How many leading main pages kivi_page_final says are final once main-part indices
// [0, main_written) are written (the page count is not capped here). A write that takes main_written
// from `before` to `after` makes pages [count(before), count(after)) final, each exactly once.
KVQ_HD int kivi_final_page_count(int main_written, int block_size, int recent_tokens) {
  const int u = main_written - recent_tokens;
  return u > 0 ? (u + block_size - 1) / block_size : 0;
}
// The first main-part index u (key position sink_len + u) that a query at `q_pos` reads in bf16;
// main_len when none (the window is off or lies inside the sink).
KVQ_HD int recent_first_main(int q_pos, int sink_len, int main_len, int recent_tokens) {
  if (recent_tokens <= 0) return main_len;
  const int u = q_pos + 1 - recent_tokens - sink_len;
  return u < 0 ? 0 : (u > main_len ? main_len : u);
}
// Element i of a scale plane of dtype d, widened to float. fp16 planes hold the bits of values
// quant::stored_scale made exactly representable, so store then load returns the same float.
// The host copies bytes (its planes are float storage whatever the dtype: no type punning); the
// device widens fp16 with the hardware conversion, exact like fp16_to_float. The template form is
// what a kernel's inner loop calls once it has dispatched on the dtype (a run-time choice there
// costs a branch per scale read).
template <ScaleDtype D>
KVQ_HD float load_scale(const void* plane, size_t i) {
#if defined(__CUDA_ARCH__)
  if constexpr (D == ScaleDtype::kFp16) return __half2float(static_cast<const __half*>(plane)[i]);
  return static_cast<const float*>(plane)[i];
#else
  const auto* b = static_cast<const unsigned char*>(plane);
  if constexpr (D == ScaleDtype::kFp16) {
    uint16_t h;
    std::memcpy(&h, b + i * 2, 2);
    return format::fp16_to_float(h);
  }
  float f;
  std::memcpy(&f, b + i * 4, 4);
  return f;
#endif
}
KVQ_HD float load_scale(const void* plane, size_t i, ScaleDtype d) {
  return d == ScaleDtype::kFp16 ? load_scale<ScaleDtype::kFp16>(plane, i) : load_scale<ScaleDtype::kFp32>(plane, i);
}
KVQ_HD void store_scale(void* plane, size_t i, float s, ScaleDtype d) {
#if defined(__CUDA_ARCH__)
  if (d == ScaleDtype::kFp16) {
    static_cast<uint16_t*>(plane)[i] = format::float_to_fp16(s);
  } else {
    static_cast<float*>(plane)[i] = s;
  }
#else
  auto* b = static_cast<unsigned char*>(plane);
  if (d == ScaleDtype::kFp16) {
    const uint16_t h = format::float_to_fp16(s);
    std::memcpy(b + i * 2, &h, 2);
  } else {
    std::memcpy(b + i * 4, &s, 4);
  }
#endif
}

// Destination of one token row in a cache write (backend::CacheWriteArgs::slot_mapping): a main
// pool slot is page * block_size + slot (>= 0), a bf16 sink slot -(sink_page * block_size + slot) - 1.
KVQ_HD int32_t encode_main_slot(int32_t page, int slot, int block_size) { return page * block_size + slot; }
KVQ_HD int32_t encode_sink_slot(int32_t sink_page, int slot, int block_size) {
  return -(sink_page * block_size + slot) - 1;
}
// The slot of token position `pos` of a sequence, by the rule at the top of this file: positions
// below `sink_capacity` go to its sink pages, the rest to its main pages (PagedKvCache's tables).
// `pos` must be inside the pages the tables hold.
KVQ_HD int32_t position_slot(int pos, int sink_capacity, const int32_t* main_pages, const int32_t* sink_pages,
                             int block_size) {
  if (pos < sink_capacity) return encode_sink_slot(sink_pages[pos / block_size], pos % block_size, block_size);
  const int u = pos - sink_capacity;
  return encode_main_slot(main_pages[u / block_size], u % block_size, block_size);
}
KVQ_HD bool slot_is_sink(int32_t s) { return s < 0; }
KVQ_HD int32_t slot_page(int32_t s, int block_size) { return (s < 0 ? -s - 1 : s) / block_size; }
KVQ_HD int slot_in_page(int32_t s, int block_size) { return (s < 0 ? -s - 1 : s) % block_size; }

// Pointers to one layer's planes. Valid on the host or on the device, depending on the owner.
struct LayerView {
  uint8_t* k_codes = nullptr;
  uint8_t* v_codes = nullptr;
  void* k_scales = nullptr;  // geometry's scale_dtype (load_scale / store_scale); null when unscaled
  void* v_scales = nullptr;
  uint16_t* k_sink = nullptr;  // bf16 bits; null when the cache has no sink pages
  uint16_t* v_sink = nullptr;
  uint32_t* k_outliers = nullptr;  // null unless the geometry has an outlier plane
  uint32_t* v_outliers = nullptr;
  uint16_t* k_recent = nullptr;  // bf16 bits; null when the cache has no recent window
  uint16_t* v_recent = nullptr;
};

// Sparse entries per page head that a spec asks for (int4_outlier), 0 for every other spec.
inline int outlier_capacity_of(const QuantSpec& s) {
  return s.outliers ? s.block_size * quant::kOutlierEntriesPerToken : 0;
}

// Block tables of a batch, padded to a rectangle (row-major, unused entries -1).
struct BatchTablesView {
  int num_seqs = 0;
  const int32_t* seq_lens = nullptr;      // [num_seqs] tokens in the cache for each sequence
  const int32_t* sink_lens = nullptr;     // [num_seqs] tokens of each sequence held in the sink
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks]
  int max_blocks = 0;
  const int32_t* sink_tables = nullptr;   // [num_seqs][max_sink_blocks]
  int max_sink_blocks = 0;
  // [num_seqs][max_blocks], column b the bf16 twin of block_tables' column b (-1: none). Needed
  // when geometry.recent_tokens > 0, ignored otherwise.
  const int32_t* recent_tables = nullptr;
};

// Memory accounting of the main (quantized) pool. Shapes are assumed valid (PagedKvCache::create
// checks them); a non-positive dimension gives 0. Sink tokens are bf16 and not counted here (see
// PagedKvCache::memory_report), nor is the plane padding to 128 bytes (< 128 bytes per plane).
//
// Exact bytes of one page index across all layers, K and V: codes plus scales (plus the outlier
// planes of int4_outlier: 4 * num_kv_heads * (1 + block_size) more per layer for V, that plus
// 2 * num_kv_heads * head_dim for K, whose per-channel fp16 scales replace its scale plane), summed over the
// 2 * num_layers planes (each with its own format when spec.mixed()), each
//   num_kv_heads * block_size * head_dim * bits / 8 + scales_per_page * scale bytes
// with scales_per_page = num_kv_heads * block_size (per_token_head), num_kv_heads
// (per_block_head), 0 (per_tensor: one scale per layer, a constant; bf16/fp16: none).
size_t bytes_per_page(const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim);
// Bytes of KV per token across all layers, K and V, scale metadata included:
// bytes_per_page / block_size, rounded up. The division is exact except for per_block_head when
// 2 * scale bytes * num_layers * num_kv_heads is not a multiple of block_size (the per-page scales do not split
// into whole bytes per token); use bytes_per_page for exact totals.
size_t bytes_per_token(const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim);
// Tokens that fit in `bytes` of page memory with this spec (whole pages only):
// floor(bytes / bytes_per_page) * block_size.
size_t capacity(size_t bytes, const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim);

}  // namespace kvq::cache
