#pragma once
// One token of one kv head, read from the paged cache as stored and dequantized element by element,
// the same way on host and device: where the token lives (bf16 sink, bf16 recent twin or the codes
// of a main page, cache/layout.h's rules) and what each of its elements is worth (code value times
// its scale; int4_kivi's (code - zero) * scale; int4_outlier's per-channel K scales and sparse fp16
// entries). The CUDA generic attention kernel and the reproducible attention of every backend
// (attention/reproducible.h) read tokens only through here, so they cannot disagree on a value.
//
// `P` is any parameter struct with members `geom` (cache::CacheGeometry), `layer`
// (cache::LayerView) and `tables` (cache::BatchTablesView).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/cache/layout.h"
#include "kvq/common/macros.h"
#include "kvq/format/bf16.h"
#include "kvq/format/format.h"
#include "kvq/format/integer.h"
#include "kvq/quant/kivi_policy.h"
#include "kvq/quant/outlier.h"

namespace kvq::attention {

enum : int { kTokCodes = 0, kTokSink = 1, kTokRecent = 2 };

// The minimal `P`: one layer's planes and the batch's tables.
struct TokenSource {
  cache::CacheGeometry geom;
  cache::LayerView layer;
  cache::BatchTablesView tables;
};

// Where token j of one kv head lives: its dim 0 as an element index into the bf16 sink or recent-twin
// plane, or a byte offset into the codes plane (code_offset), and its K and V scales (1 for bf16
// and 16-bit tokens). Looked up once per token.
struct TokRef {
  unsigned long long elem;
  float ks, vs;
  int where;             // kTokCodes | kTokSink | kTokRecent
  int page, head, slot;  // codes: where int4_kivi's parameters and int4_outlier's side planes are
};

// 16-bit element i of a plane (bf16 / fp16 bits). The host copies bytes (no type punning).
KVQ_HD uint16_t load_u16(const void* plane, size_t i) {
#if defined(__CUDA_ARCH__)
  return static_cast<const uint16_t*>(plane)[i];
#else
  uint16_t h;
  std::memcpy(&h, static_cast<const unsigned char*>(plane) + i * 2, 2);
  return h;
#endif
}

// Token j of sequence `seq` (row of the tables) for a query at q_pos; sink_len is the sequence's
// sink length clamped to its length.
template <Format F, class P>
KVQ_HD TokRef token_ref(const P& p, int seq, int j, int sink_len, int kvh, int q_pos) {
  const cache::CacheGeometry& g = p.geom;
  const int bs = g.block_size;
  if (j < sink_len) {
    const int page = p.tables.sink_tables[size_t(seq) * p.tables.max_sink_blocks + j / bs];
    return {g.elem_index(page, kvh, j % bs), 1.f, 1.f, kTokSink, 0, 0, 0};
  }
  const int u = j - sink_len;
  if (cache::uses_recent(j, q_pos, g.recent_tokens)) {
    const int page = p.tables.recent_tables[size_t(seq) * p.tables.max_blocks + u / bs];
    return {g.elem_index(page, kvh, u % bs), 1.f, 1.f, kTokRecent, 0, 0, 0};
  }
  const int page = p.tables.block_tables[size_t(seq) * p.tables.max_blocks + u / bs], slot = u % bs;
  TokRef t{g.code_offset(page, kvh, slot), 1.f, 1.f, kTokCodes, page, kvh, slot};
  if constexpr (F != Format::kBf16 && F != Format::kFp16 && F != Format::kInt4Kivi) {
    const size_t si = g.scale_index(page, kvh, slot);  // per_tensor: 0
    if (g.outlier_capacity == 0) t.ks = cache::load_scale(p.layer.k_scales, si, g.scale_dtype);  // else per channel
    t.vs = cache::load_scale(p.layer.v_scales, si, g.scale_dtype);
  }
  return t;
}

// Element i of a token, dequantized as the host's dequantize_row does (code value * scale).
template <Format F, class P>
KVQ_HD float token_value(const P& p, bool is_v, const TokRef& t, int i) {
  if (t.where == kTokSink) return format::bf16_to_float(load_u16(is_v ? p.layer.v_sink : p.layer.k_sink, t.elem + i));
  if (t.where == kTokRecent)
    return format::bf16_to_float(load_u16(is_v ? p.layer.v_recent : p.layer.k_recent, t.elem + i));
  const uint8_t* c = is_v ? p.layer.v_codes : p.layer.k_codes;
  if constexpr (F == Format::kBf16) return format::bf16_to_float(load_u16(c + t.elem, size_t(i)));
  else if constexpr (F == Format::kFp16) return format::fp16_to_float(load_u16(c + t.elem, size_t(i)));
  else if constexpr (F == Format::kInt4) {
    const float code = float(format::int4_at(c + t.elem, size_t(i)));
    if (p.geom.outlier_capacity == 0) return code * (is_v ? t.vs : t.ks);
    // int4_outlier (as the CPU's TileLoader): K per channel, V per token, then the entries.
    const cache::CacheGeometry g = p.geom.plane(is_v ? 1 : 0);
    const uint32_t* words = is_v ? p.layer.v_outliers : p.layer.k_outliers;
    const uint32_t* plane = words + g.outlier_index(t.page, t.head);
    for (uint32_t j = 0; j < plane[0]; ++j) {
      const quant::OutlierEntry e = quant::unpack_outlier(plane[1 + j]);
      if (e.index == t.slot * g.head_dim + i) return format::fp16_to_float(e.value);
    }
    return is_v ? code * t.vs : code * cache::load_scale(words, g.channel_scale_index(t.page, t.head) + i, ScaleDtype::kFp16);
  }
  else if constexpr (F == Format::kInt4Kivi) {  // K's parameters per channel, V's per token
    const cache::CacheGeometry g = p.geom.plane(is_v ? 1 : 0);
    const void* prm = is_v ? p.layer.v_scales : p.layer.k_scales;
    const int grp = is_v ? t.slot : i;
    const quant::KiviParams q{cache::load_scale(prm, g.kivi_param_index(t.page, t.head, grp, false), g.scale_dtype),
                              cache::load_scale(prm, g.kivi_param_index(t.page, t.head, grp, true), g.scale_dtype)};
    return quant::kivi_value(format::uint4_at(c + t.elem, size_t(i)), q);
  }
  else return kvq::decode_byte(F, c[t.elem + i]) * (is_v ? t.vs : t.ks);
}

}  // namespace kvq::attention
