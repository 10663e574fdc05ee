#include "kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <cblas.h>

#include "kvq/format/bf16.h"
#include "kvq/format/format.h"
#include "kvq/quant/kivi_policy.h"
#include "kvq/quant/outlier.h"

namespace kvq::attention::cpu::detail {
namespace {

std::string str(long long v) { return std::to_string(v); }

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Block-table row checks for one part of one sequence.
Status check_table_row(const char* what, int seq, int n_tokens, int block_size, const int32_t* table,
                       int row_len, int pool_pages) {
  const int needed = ceil_div(n_tokens, block_size);
  if (needed == 0) return Status::ok();
  if (needed > row_len)
    return invalid_argument("attention: sequence " + str(seq) + " has " + str(n_tokens) + " " + what +
                            " tokens, needing " + str(needed) + " pages of " + str(block_size) +
                            ", but its " + what + " table row has only " + str(row_len) + " entries");
  if (table == nullptr)
    return invalid_argument(std::string("attention: ") + what + " table pointer is null but sequence " +
                            str(seq) + " has " + what + " tokens");
  const int32_t* row = table + static_cast<size_t>(seq) * row_len;
  for (int j = 0; j < needed; ++j) {
    if (row[j] < 0 || row[j] >= pool_pages)
      return invalid_argument("attention: sequence " + str(seq) + ", " + what + " table entry " + str(j) +
                              " is page " + str(row[j]) + ", outside the " + what + " pool [0, " +
                              str(pool_pages) + ")");
  }
  return Status::ok();
}

// Dot product with eight independent lanes: the compiler turns it into SIMD without -ffast-math
// (head_dim is a multiple of 8, checked by can_implement).
inline float dot(const float* a, const float* b, int n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace

Status check_problem(const Problem& p, const float* q, const float* out, int prefill_q_pos0) {
  const cache::CacheGeometry& g = p.geom;
  if (g.num_kv_heads < 1)
    return invalid_argument("attention: geometry has " + str(g.num_kv_heads) + " kv heads; need at least 1");
  if (g.head_dim < 8 || g.head_dim > 256 || g.head_dim % 8 != 0)
    return unsupported("attention: head_dim " + str(g.head_dim) +
                       " is not supported; the CPU backend takes 8..256 in multiples of 8");
  if (g.block_size != 16 && g.block_size != 32)
    return unsupported("attention: block_size " + str(g.block_size) + " is not supported; use 16 or 32");
  for (int kv = 0; kv < 2; ++kv)
    if (!format_traits(g.plane_format(kv)).cache_ready)
      return unsupported(std::string("attention: the CPU backend does not read ") + format_name(g.plane_format(kv)) +
                         " caches yet; use int8, int4 or fp8");
  if (g.num_pages < 0 || g.num_sink_pages < 0)
    return invalid_argument("attention: negative page count in the cache geometry");
  if (p.num_q_heads < 1 || p.num_q_heads % g.num_kv_heads != 0)
    return invalid_argument("attention: num_q_heads (" + str(p.num_q_heads) +
                            ") must be a positive multiple of num_kv_heads (" + str(g.num_kv_heads) + ")");
  if (!(p.softmax_scale > 0.f) || !std::isfinite(p.softmax_scale))
    return invalid_argument("attention: softmax_scale must be positive and finite (usually 1/sqrt(head_dim)); got " +
                            std::to_string(p.softmax_scale));
  if (q == nullptr) return invalid_argument("attention: query pointer q is null");
  if (out == nullptr) return invalid_argument("attention: output pointer out is null");

  const cache::BatchTablesView& t = p.tables;
  if (t.num_seqs < 0) return invalid_argument("attention: num_seqs is negative (" + str(t.num_seqs) + ")");
  if (t.num_seqs == 0) return Status::ok();
  if (t.seq_lens == nullptr || t.sink_lens == nullptr)
    return invalid_argument("attention: seq_lens and sink_lens must not be null");
  if (t.max_blocks < 0 || t.max_sink_blocks < 0)
    return invalid_argument("attention: block table widths must not be negative");

  bool any_sink = false, any_quantized = false, any_recent = false;
  for (int s = 0; s < t.num_seqs; ++s) {
    const int len = t.seq_lens[s], sink = t.sink_lens[s];
    if (len < 1)
      return invalid_argument("attention: sequence " + str(s) + " has " + str(len) +
                              " cached tokens; write the query token's K/V before attending");
    if (sink < 0 || sink > len)
      return invalid_argument("attention: sequence " + str(s) + " has sink_len " + str(sink) +
                              " outside [0, seq_len = " + str(len) + "]");
    KVQ_RETURN_IF_ERROR(
        check_table_row("sink", s, sink, g.block_size, t.sink_tables, t.max_sink_blocks, g.num_sink_pages));
    KVQ_RETURN_IF_ERROR(
        check_table_row("block", s, len - sink, g.block_size, t.block_tables, t.max_blocks, g.num_pages));
    any_sink |= sink > 0;
    any_quantized |= len > sink;
    if (g.recent_tokens > 0) {
      // Main tokens [first, len - sink) are read from their bf16 twins by some query.
      const int q0 = prefill_q_pos0 >= 0 ? prefill_q_pos0 : len - 1;
      const int first = cache::recent_first_main(q0, sink, len - sink, g.recent_tokens);
      if (first < len - sink) {
        any_recent = true;
        if (t.recent_tables == nullptr)
          return invalid_argument("attention: the cache has a bf16 recent window but recent_tables is null");
        const int32_t* row = t.recent_tables + static_cast<size_t>(s) * t.max_blocks;
        for (int b = first / g.block_size; b < ceil_div(len - sink, g.block_size); ++b)
          if (row[b] < 0 || row[b] >= g.num_recent_pages)
            return invalid_argument("attention: sequence " + str(s) + ", recent table entry " + str(b) + " is page " +
                                    str(row[b]) + ", outside the recent pool [0, " + str(g.num_recent_pages) +
                                    "); its queries read that page's tokens in bf16");
      }
    }
  }
  if (any_recent && (p.layer.k_recent == nullptr || p.layer.v_recent == nullptr))
    return invalid_argument("attention: the batch reads its recent window but the layer's recent planes are null");
  if (any_sink && (p.layer.k_sink == nullptr || p.layer.v_sink == nullptr))
    return invalid_argument("attention: the batch has sink tokens but the layer's sink planes are null");
  if (any_quantized) {
    if (p.layer.k_codes == nullptr || p.layer.v_codes == nullptr)
      return invalid_argument("attention: the layer's K/V code planes are null");
    if (g.outlier_capacity > 0 && (p.layer.k_outliers == nullptr || p.layer.v_outliers == nullptr))
      return invalid_argument("attention: the cache has outlier side planes but the layer's pointers to them are null");
    for (int kv = 0; kv < 2; ++kv)
      if (g.plane(kv).has_scales() && (kv == 0 ? p.layer.k_scales : p.layer.v_scales) == nullptr)
        return invalid_argument(std::string("attention: format ") + format_name(g.plane_format(kv)) +
                                " needs scale planes, but the layer's " + (kv == 0 ? "K" : "V") +
                                " scale pointer is null");
  }
  return Status::ok();
}

TileLoader::TileLoader(const Problem& p)
    : p_(p), k_geom_(p.geom.plane(0)), v_geom_(p.geom.plane(1)), k_scaled_(k_geom_.has_scales()),
      v_scaled_(v_geom_.has_scales()) {
  for (int kv = 0; kv < 2; ++kv) {
    const Format f = p.geom.plane_format(kv);
    for (int c = 0; c < 256; ++c)
      lut_[kv][c] = (is_quantized(f) && format_bits(f) == 8) ? decode_byte(f, static_cast<uint8_t>(c)) : 0.f;
  }
}

void TileLoader::decode_row(int kv, const uint8_t* plane, size_t offset, float* out) const {
  const int d = p_.geom.head_dim;
  const uint8_t* src = plane + offset;
  const Format f = p_.geom.plane_format(kv);
  switch (f) {
    case Format::kBf16:
    case Format::kFp16: {
      const bool bf16 = f == Format::kBf16;
      for (int i = 0; i < d; ++i) {
        // Little-endian 2-byte values in a byte plane (as quant::quantize_row stores them).
        const uint16_t bits = static_cast<uint16_t>(src[2 * i] | (src[2 * i + 1] << 8));
        out[i] = bf16 ? format::bf16_to_float(bits) : format::fp16_to_float(bits);
      }
      break;
    }
    case Format::kInt4:
      for (int i = 0; i < d; i += 2) {
        out[i] = static_cast<float>(format::unpack_int4_lo(src[i / 2]));
        out[i + 1] = static_cast<float>(format::unpack_int4_hi(src[i / 2]));
      }
      break;
    default:
      for (int i = 0; i < d; ++i) out[i] = lut_[kv][src[i]];
  }
}

void TileLoader::load_kivi_row(int page, int head, int slot, float* k, float* v) const {
  const int d = p_.geom.head_dim;
  for (int kv = 0; kv < 2; ++kv) {
    const cache::CacheGeometry& g = kv == 0 ? k_geom_ : v_geom_;
    const uint8_t* row = (kv == 0 ? p_.layer.k_codes : p_.layer.v_codes) + g.code_offset(page, head, slot);
    const void* params = kv == 0 ? p_.layer.k_scales : p_.layer.v_scales;
    float* out = kv == 0 ? k : v;
    for (int c = 0; c < d; ++c) {
      const int grp = kv == 0 ? c : slot;  // K per channel, V per token
      const quant::KiviParams q{cache::load_scale(params, g.kivi_param_index(page, head, grp, false), g.scale_dtype),
                                cache::load_scale(params, g.kivi_param_index(page, head, grp, true), g.scale_dtype)};
      out[c] = quant::kivi_value(format::uint4_at(row, static_cast<size_t>(c)), q);
    }
  }
}

namespace {

// Sizes `tile` for n tokens with unit scales (the scales of bf16 tokens).
void start_tile(PartTile& tile, int n, int d) {
  tile.n = n;
  tile.k.resize(static_cast<size_t>(n) * d);
  tile.v.resize(static_cast<size_t>(n) * d);
  tile.k_scale.assign(n, 1.f);
  tile.v_scale.assign(n, 1.f);
}

// bf16 tokens [u0, u0 + n) of one table row (page u / bs, slot u % bs), kv head `head`.
void load_bf16_tokens(const cache::CacheGeometry& g, const int32_t* row, const uint16_t* k, const uint16_t* v,
                      int head, int u0, int n, PartTile& tile) {
  const int d = g.head_dim, bs = g.block_size;
  start_tile(tile, n, d);
  for (int i = 0; i < n; ++i) {
    const int u = u0 + i;
    const size_t e = g.elem_index(row[u / bs], head, u % bs);
    for (int c = 0; c < d; ++c) {
      tile.k[static_cast<size_t>(i) * d + c] = format::bf16_to_float(k[e + c]);
      tile.v[static_cast<size_t>(i) * d + c] = format::bf16_to_float(v[e + c]);
    }
  }
}

}  // namespace

void TileLoader::load_sink(int seq, int head, int n, PartTile& tile) const {
  // With n == 0 the table may be null: the row pointer is never read then.
  const int32_t* row = n > 0 ? p_.tables.sink_tables + static_cast<size_t>(seq) * p_.tables.max_sink_blocks : nullptr;
  load_bf16_tokens(p_.geom, row, p_.layer.k_sink, p_.layer.v_sink, head, 0, n, tile);
}

void TileLoader::load_recent(int seq, int head, int u0, int n, PartTile& tile) const {
  const int32_t* row = n > 0 ? p_.tables.recent_tables + static_cast<size_t>(seq) * p_.tables.max_blocks : nullptr;
  load_bf16_tokens(p_.geom, row, p_.layer.k_recent, p_.layer.v_recent, head, u0, n, tile);
}

void TileLoader::load_quantized(int seq, int head, int n, PartTile& tile) const {
  const cache::CacheGeometry& g = p_.geom;
  const int d = g.head_dim, bs = g.block_size;
  start_tile(tile, n, d);
  if (n == 0) return;  // the table may be null then
  const int32_t* row = p_.tables.block_tables + static_cast<size_t>(seq) * p_.tables.max_blocks;
  for (int u = 0; u < n; ++u) {
    const int page = row[u / bs], slot = u % bs;
    if (g.kivi()) {  // K's scale is per channel: it cannot ride on the logit, so the tile holds values
      load_kivi_row(page, head, slot, &tile.k[static_cast<size_t>(u) * d], &tile.v[static_cast<size_t>(u) * d]);
      continue;
    }
    // Each plane has its own format, hence its own byte offset (int4 packs two codes per byte).
    decode_row(0, p_.layer.k_codes, k_geom_.code_offset(page, head, slot), &tile.k[static_cast<size_t>(u) * d]);
    decode_row(1, p_.layer.v_codes, v_geom_.code_offset(page, head, slot), &tile.v[static_cast<size_t>(u) * d]);
    const size_t si = g.scale_index(page, head, slot);
    if (k_scaled_) tile.k_scale[u] = cache::load_scale(p_.layer.k_scales, si, g.scale_dtype);
    if (v_scaled_) tile.v_scale[u] = cache::load_scale(p_.layer.v_scales, si, g.scale_dtype);
    if (g.outlier_capacity > 0) {
      // A sparse entry holds the value itself; the tile holds codes that the scale multiplies later
      // (K's channel scales are applied here: its per-token scale is 1).
      for (int kv = 0; kv < 2; ++kv) {
        const cache::CacheGeometry& pg = kv == 0 ? k_geom_ : v_geom_;
        const uint32_t* words = kv == 0 ? p_.layer.k_outliers : p_.layer.v_outliers;
        float* row_out = &(kv == 0 ? tile.k : tile.v)[static_cast<size_t>(u) * d];
        const float scale = kv == 0 ? tile.k_scale[u] : tile.v_scale[u];
        if (pg.channel_scales) {
          const size_t c0 = pg.channel_scale_index(page, head);
          for (int c = 0; c < d; ++c) row_out[c] *= cache::load_scale(words, c0 + c, ScaleDtype::kFp16);
        }
        const uint32_t* plane = words + pg.outlier_index(page, head);
        for (uint32_t j = 0; j < plane[0]; ++j) {
          const quant::OutlierEntry e = quant::unpack_outlier(plane[1 + j]);
          if (e.index / d == slot) row_out[e.index % d] = format::fp16_to_float(e.value) / scale;
        }
      }
    }
  }
}

void attend_part(const float* q, float softmax_scale, const PartTile& tile, int n_visible, int head_dim,
                 std::vector<float>& logits, Partial& out) {
  out.acc.assign(head_dim, 0.f);
  out.n = n_visible > 0 ? n_visible : 0;
  out.m = -std::numeric_limits<float>::infinity();
  out.l = 0.f;
  if (n_visible <= 0) return;
  if (logits.size() < static_cast<size_t>(n_visible)) logits.resize(n_visible);
  float m = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n_visible; ++t) {
    // The k scale multiplies the logit, not the codes: exactly what a fused kernel does.
    const float s = softmax_scale * tile.k_scale[t];
    logits[t] = s * dot(q, &tile.k[static_cast<size_t>(t) * head_dim], head_dim);
    m = std::max(m, logits[t]);
  }
  float l = 0.f;
  float* acc = out.acc.data();
  for (int t = 0; t < n_visible; ++t) {
    const float e = std::exp(logits[t] - m);
    l += e;
    const float w = e * tile.v_scale[t];  // the v scale rides on the probability
    const float* v = &tile.v[static_cast<size_t>(t) * head_dim];
    for (int i = 0; i < head_dim; ++i) acc[i] += w * v[i];
  }
  out.m = m;
  out.l = l;
}

namespace {

// Merge of two softmax partials (count, max, sum, accumulator). seq_len >= 1 makes at least one
// part non-empty. Emptiness is decided by the token count, not by l > 0, so a NaN read from a bad
// page propagates to the output instead of being dropped.
void merge(int na, float ma, float la, const float* acc_a, int nb, float mb, float lb, const float* acc_b,
           int head_dim, float* out, float* lse) {
  const float m = na == 0 ? mb : nb == 0 ? ma : std::max(ma, mb);
  const float wa = na > 0 ? std::exp(ma - m) : 0.f;
  const float wb = nb > 0 ? std::exp(mb - m) : 0.f;
  const float l = la * wa + lb * wb;
  const float inv = 1.f / l;
  for (int i = 0; i < head_dim; ++i) out[i] = (acc_a[i] * wa + acc_b[i] * wb) * inv;
  if (lse != nullptr) *lse = m + std::log(l);
}

void merge3(const int* n, const float* m_in, const float* l_in, const float* const* acc, int head_dim, float* out,
            float* lse) {
  float m = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (int i = 0; i < 3; ++i) {
    if (n[i] == 0) continue;
    m = any ? std::max(m, m_in[i]) : m_in[i];
    any = true;
  }
  float w[3], l = 0.f;
  for (int i = 0; i < 3; ++i) {
    w[i] = n[i] > 0 ? std::exp(m_in[i] - m) : 0.f;
    l += n[i] > 0 ? l_in[i] * w[i] : 0.f;
  }
  const float inv = 1.f / l;
  for (int c = 0; c < head_dim; ++c) {
    float sum = 0.f;
    for (int i = 0; i < 3; ++i)
      if (n[i] > 0) sum += acc[i][c] * w[i];
    out[c] = sum * inv;
  }
  if (lse != nullptr) *lse = m + std::log(l);
}

}  // namespace

void merge_parts(const Partial& a, const Partial& b, const Partial& c, int head_dim, float* out, float* lse) {
  const int n[3] = {a.n, b.n, c.n};
  const float m[3] = {a.m, b.m, c.m}, l[3] = {a.l, b.l, c.l};
  const float* acc[3] = {a.acc.data(), b.acc.data(), c.acc.data()};
  merge3(n, m, l, acc, head_dim, out, lse);
}

void merge_block_row(const BlockPartial& a, const BlockPartial& b, const BlockPartial& c, int r, int head_dim,
                     float* out, float* lse) {
  const size_t o = static_cast<size_t>(r) * head_dim;
  const int n[3] = {a.n[r], b.n[r], c.n[r]};
  const float m[3] = {a.m[r], b.m[r], c.m[r]}, l[3] = {a.l[r], b.l[r], c.l[r]};
  const float* acc[3] = {a.acc.data() + o, b.acc.data() + o, c.acc.data() + o};
  merge3(n, m, l, acc, head_dim, out, lse);
}

void merge_parts(const Partial& a, const Partial& b, int head_dim, float* out, float* lse) {
  merge(a.n, a.m, a.l, a.acc.data(), b.n, b.m, b.l, b.acc.data(), head_dim, out, lse);
}

void attend_part_block(const float* q, size_t q_stride, int rows, const int* visible, float softmax_scale,
                       const PartTile& tile, int head_dim, BlockPartial& out, const int* first) {
  const int d = head_dim;
  out.n.assign(visible, visible + rows);
  out.m.assign(rows, -std::numeric_limits<float>::infinity());
  out.l.assign(rows, 0.f);
  out.acc.assign(static_cast<size_t>(rows) * d, 0.f);
  const int cols = std::min(tile.n, *std::max_element(visible, visible + rows));
  if (cols <= 0) return;
  out.p.resize(static_cast<size_t>(rows) * cols);
  float* p = out.p.data();
  // Raw logits: codes only; the per-token k scale and the softmax scale are applied per element.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d, 1.f, q, static_cast<int>(q_stride),
              tile.k.data(), d, 0.f, p, cols);
  for (int r = 0; r < rows; ++r) {
    float* pr = p + static_cast<size_t>(r) * cols;
    const int n = std::min(visible[r], cols);
    const int f = first != nullptr ? std::clamp(first[r], 0, std::max(n, 0)) : 0;
    out.n[r] = std::max(n - f, 0);
    float m = -std::numeric_limits<float>::infinity();
    for (int t = f; t < n; ++t) {
      pr[t] *= softmax_scale * tile.k_scale[t];
      m = std::max(m, pr[t]);
    }
    float l = 0.f;
    for (int t = f; t < n; ++t) {
      const float e = std::exp(pr[t] - m);
      l += e;
      pr[t] = e * tile.v_scale[t];  // the v scale rides on the probability
    }
    for (int t = 0; t < f; ++t) pr[t] = 0.f;  // before the window: read from the codes instead
    for (int t = std::max(n, 0); t < cols; ++t) pr[t] = 0.f;  // causal mask
    out.m[r] = m;
    out.l[r] = l;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, cols, 1.f, p, cols, tile.v.data(), d, 0.f,
              out.acc.data(), d);
}

void merge_block_row(const BlockPartial& a, const BlockPartial& b, int r, int head_dim, float* out, float* lse) {
  const size_t o = static_cast<size_t>(r) * head_dim;
  merge(a.n[r], a.m[r], a.l[r], a.acc.data() + o, b.n[r], b.m[r], b.l[r], b.acc.data() + o, head_dim, out, lse);
}

}  // namespace kvq::attention::cpu::detail
