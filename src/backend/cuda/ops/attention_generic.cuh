#pragma once
// Generic CUDA attention paths of the backend, for shapes the fast kernels of attention/cuda do not
// take (head_dim other than 64/128/256, e.g. stories260K's 8; block sizes other than 16/32):
//   generic_write_kernel    quantize-on-write, the host cache's rules (PagedKvCache::write) with the
//                           same device codecs as the fast writer, so codes and scales match the CPU's.
//   generic_attend_kernel   decode or causal prefill in fp32 (online softmax), K/V tiles dequantized
//                           once per CTA into shared memory through the same codecs (decode_byte).
// And, for the fast path, the expansion of one prefill sequence into n_q virtual decode sequences.
// These favour simplicity over speed: they serve small models and odd shapes.
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/cuda/write_codec.cuh"
#include "kvq/attention/token_reader.h"
#include "kvq/cache/layout.h"
#include "kvq/format/bf16.h"
#include "kvq/format/format.h"
#include "kvq/quant/kivi_policy.h"
#include "kvq/quant/outlier.h"
#include "kvq/quant/policy.h"

namespace kvq::backend::cuda_ops {

using quant::amax_term;
using quant::scale_for_amax;

constexpr int kMaxGenericHeadDim = 256;

struct GenericWriteParams {
  cache::CacheGeometry geom;
  cache::LayerView layer;
  float* amax[2];     // per_block_head bookkeeping planes (k, v)
  const float* in[2];  // [n][heads][head_dim] fp32
  const int32_t* slots;
  int n;
};

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Amax of one input row (finite values only), reduced over the warp.
__device__ __forceinline__ float row_amax(const float* row, int d) {
  float a = 0.f;
  for (int i = threadIdx.x; i < d; i += 32) a = fmaxf(a, amax_term(row[i]));
  return warp_max(a);
}

// quant::quantize_row of one row of d values at byte `offset` of a codes plane (code_offset; for
// the bf16 sink, 2 * elem_index). int4: lane j packs elements 2j and 2j + 1 into one byte.
__device__ __forceinline__ void store_row(Format f, uint8_t* codes, size_t offset, const float* x, int d, float scale) {
  if (f == Format::kInt4) {
    for (int i = 2 * threadIdx.x; i < d; i += 64) codes[offset + i / 2] = quant::quantize_int4_pair(x[i], x[i + 1], scale);
    return;
  }
  const size_t elem = f == Format::kBf16 || f == Format::kFp16 ? offset / 2 : offset;
  for (int i = threadIdx.x; i < d; i += 32) {
    const float v = x[i];
    if (f == Format::kBf16) {
      reinterpret_cast<uint16_t*>(codes)[elem + i] = attention::cuda::detail::store16<Format::kBf16>(v);
    } else if (f == Format::kFp16) {
      reinterpret_cast<uint16_t*>(codes)[elem + i] = attention::cuda::detail::store16<Format::kFp16>(v);
    } else {
      codes[elem + i] = quant::quantize_value(f, v, scale);
    }
  }
}

// One warp per K|V (blockIdx.x), walking heads and tokens in order: the host cache's write, run by
// run (a run = consecutive tokens of the call in one main page).
// per_tensor: the first write reaching the main pool fixes the layer scale (0 = not yet set), from
// every head's rows; grid (K|V), one warp. Runs before generic_write_kernel, which reads it.
__global__ void __launch_bounds__(32) generic_tensor_scale_kernel(const GenericWriteParams p) {
  const int kv = blockIdx.x;
  const cache::CacheGeometry& g = p.geom;
  if (!g.has_scales() || g.granularity != ScaleGranularity::kPerTensor) return;
  void* scales = kv == 0 ? p.layer.k_scales : p.layer.v_scales;
  const ScaleDtype sd = g.scale_dtype;
  if (!quant::tensor_scale_unset(cache::load_scale(scales, 0, sd))) return;
  const int d = g.head_dim, heads = g.num_kv_heads;
  const float* in = p.in[kv];
  float amax = 0.f;
  bool any = false;
  for (int t = 0; t < p.n; ++t) {
    if (cache::slot_is_sink(p.slots[t])) continue;
    any = true;
    for (int h = 0; h < heads; ++h) amax = fmaxf(amax, row_amax(in + (size_t(t) * heads + h) * d, d));
  }
  if (any && threadIdx.x == 0) cache::store_scale(scales, 0, scale_for_amax(g.format, amax, sd), sd);
}

// Grid (K|V, kv head, z), one warp a block. Rows are independent except within a per_block_head
// page head (its scale can grow and re-quantize the page's earlier slots), so per_block_head walks
// one head's rows in order in block z = 0, and every other case takes rows z, z + gridDim.z, ...
__global__ void __launch_bounds__(32) generic_write_kernel(const GenericWriteParams p) {
  const int kv = blockIdx.x, h = blockIdx.y;
  const cache::CacheGeometry& g = p.geom;
  const int d = g.head_dim, heads = g.num_kv_heads, bs = g.block_size;
  const Format f = g.format;
  const bool quantized = g.has_scales();
  const bool per_block = quantized && g.granularity == ScaleGranularity::kPerBlockHead;
  uint8_t* codes = kv == 0 ? p.layer.k_codes : p.layer.v_codes;
  void* scales = kv == 0 ? p.layer.k_scales : p.layer.v_scales;
  const ScaleDtype sd = g.scale_dtype;
  uint16_t* sink = kv == 0 ? p.layer.k_sink : p.layer.v_sink;
  const float* in = p.in[kv];
  auto row = [&](int t) { return in + (size_t(t) * heads + h) * d; };
  if (per_block && blockIdx.z != 0) return;
  const int t0 = per_block ? 0 : static_cast<int>(blockIdx.z), dt = per_block ? 1 : static_cast<int>(gridDim.z);

  for (int t = t0; t < p.n;) {
    const int32_t s = p.slots[t];
    const int page = cache::slot_page(s, bs), slot = cache::slot_in_page(s, bs);
    if (cache::slot_is_sink(s)) {
      store_row(Format::kBf16, reinterpret_cast<uint8_t*>(sink), 2 * g.elem_index(page, h, slot), row(t), d, 1.f);
      t += dt;
      continue;
    }
    if (g.kivi()) {  // its codes come later, from the bf16 twin, when the page is final (kivi_pages.cuh)
      t += dt;
      continue;
    }
    if (!quantized || g.granularity == ScaleGranularity::kPerTensor) {
      store_row(f, codes, g.code_offset(page, h, slot), row(t), d, quantized ? cache::load_scale(scales, 0, sd) : 1.f);
      t += dt;
      continue;
    }
    if (g.granularity == ScaleGranularity::kPerTokenHead) {
      const float scale = scale_for_amax(f, row_amax(row(t), d), sd);
      if (threadIdx.x == 0) cache::store_scale(scales, g.scale_index(page, h, slot), scale, sd);
      store_row(f, codes, g.code_offset(page, h, slot), row(t), d, scale);
      t += dt;
      continue;
    }
    // per_block_head (dt == 1): the run of this page's tokens starting at t.
    int len = 1;
    while (t + len < p.n && slot + len < bs) {
      const int32_t s2 = p.slots[t + len];
      if (cache::slot_is_sink(s2) || cache::slot_page(s2, bs) != page) break;
      ++len;
    }
    float amax = 0.f;
    for (int r = 0; r < len; ++r) amax = fmaxf(amax, row_amax(row(t + r), d));
    const size_t si = g.scale_index(page, h, 0);
    float* amax_slot = p.amax[kv] + si;
    float scale = cache::load_scale(scales, si, sd);
    if (slot == 0) {  // a fresh page head
      scale = scale_for_amax(f, amax, sd);
      __syncwarp();
      if (threadIdx.x == 0) *amax_slot = amax, cache::store_scale(scales, si, scale, sd);
    } else if (quant::block_scale_grows(amax, *amax_slot)) {
      // The page head's scale grows: re-quantize its earlier slots (dequantize with the old scale).
      const float grown = scale_for_amax(f, amax, sd);
      for (int r = 0; r < slot; ++r) {
        uint8_t* c = codes + g.code_offset(page, h, r);
        if (f == Format::kInt4) {  // a byte holds two codes: lane j re-encodes byte j
          for (int j = threadIdx.x; j < d / 2; j += 32) {
            const float lo = float(format::unpack_int4_lo(c[j])) * scale, hi = float(format::unpack_int4_hi(c[j])) * scale;
            c[j] = quant::quantize_int4_pair(lo, hi, grown);
          }
          continue;
        }
        for (int i = threadIdx.x; i < d; i += 32) {
          const float x = kvq::decode_byte(f, c[i]) * scale;
          c[i] = quant::quantize_value(f, x, grown);
        }
      }
      scale = grown;
      __syncwarp();
      if (threadIdx.x == 0) *amax_slot = amax, cache::store_scale(scales, si, grown, sd);
    }
    __syncwarp();
    for (int r = 0; r < len; ++r) store_row(f, codes, g.code_offset(page, h, slot + r), row(t + r), d, scale);
    t += len;
  }
}

// int4_outlier's write (quant/outlier.h, the host's PagedKvCache::write_outlier_tokens): one
// thread walks the rows in order, so the running statistics, the page openings and the entries
// advance exactly as on the host, through the same __host__ __device__ row functions. Correct, not
// fast: the statistics are a sequential recurrence. Writes append (a row's slot drops the page
// head's entries at and after it), which is what the engine does.
struct OutlierWriteParams {
  cache::CacheGeometry geom;
  cache::LayerView layer;
  const float* in[2];  // [n][heads][head_dim] fp32
  const int32_t* slots;
  int n;
  double* sum[2];      // DeviceLayer::stats_sum / stats_count, K and V
  uint64_t* count[2];
};

__device__ inline void outlier_row(const cache::CacheGeometry& g, bool is_k, const cache::LayerView& l, int page,
                                   int h, int slot, const float* x, const float* thr) {
  const int d = g.head_dim;
  uint32_t* plane = (is_k ? l.k_outliers : l.v_outliers) + g.outlier_index(page, h);
  uint32_t* words = plane + 1;
  int count = 0;
  for (uint32_t j = 0; j < plane[0]; ++j)
    if (quant::unpack_outlier(words[j]).index / d < slot) words[count++] = words[j];
  const int room = quant::fair_share(g.outlier_capacity - count, g.block_size - slot);
  uint8_t* codes = (is_k ? l.k_codes : l.v_codes) + g.code_offset(page, h, slot);
  if (is_k) {
    quant::key_row(x, d, thr, slot, room, codes, words, &count);
  } else {
    quant::value_row(x, d, thr, slot, room, codes, static_cast<float*>(l.v_scales) + g.scale_index(page, h, slot), words,
                     &count);
  }
  plane[0] = static_cast<uint32_t>(count);
}

__global__ void __launch_bounds__(1) outlier_write_kernel(const OutlierWriteParams p) {
  const cache::CacheGeometry kg = p.geom.plane(0), vg = p.geom.plane(1);
  const int d = kg.head_dim, heads = kg.num_kv_heads, bs = kg.block_size, C = heads * d;
  float thr[kMaxGenericHeadDim];
  for (int t = 0; t < p.n; ++t) {
    const int32_t s = p.slots[t];
    const float* krow = p.in[0] + size_t(t) * C;
    const float* vrow = p.in[1] + size_t(t) * C;
    const int page = cache::slot_page(s, bs), slot = cache::slot_in_page(s, bs);
    if (cache::slot_is_sink(s)) {
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < d; ++i) {
          const size_t e = kg.elem_index(page, h, slot) + i;
          p.layer.k_sink[e] = attention::cuda::detail::store16<Format::kBf16>(krow[h * d + i]);
          p.layer.v_sink[e] = attention::cuda::detail::store16<Format::kBf16>(vrow[h * d + i]);
        }
      quant::stats_add_row(p.sum[0], p.count[0], krow, C);
      continue;
    }
    bool counted = false;
    if (slot == 0) {  // the page opens: K channel scales from the rows before it
      if (p.count[0][C] == 0) {
        quant::stats_add_row(p.sum[0], p.count[0], krow, C);
        counted = true;
      }
      for (int h = 0; h < heads; ++h)
        for (int c = 0; c < d; ++c)
          cache::store_scale(p.layer.k_outliers, kg.channel_scale_index(page, h) + c,
                             quant::key_channel_scale(p.sum[0][h * d + c], p.count[0][h * d + c]), ScaleDtype::kFp16);
    }
    if (!counted) quant::stats_add_row(p.sum[0], p.count[0], krow, C);
    quant::stats_add_row(p.sum[1], p.count[1], vrow, C);
    for (int h = 0; h < heads; ++h) {
      for (int c = 0; c < d; ++c)
        thr[c] = cache::load_scale(p.layer.k_outliers, kg.channel_scale_index(page, h) + c, ScaleDtype::kFp16);
      outlier_row(kg, true, p.layer, page, h, slot, krow + h * d, thr);
      for (int c = 0; c < d; ++c) thr[c] = quant::value_threshold(p.sum[1][h * d + c], p.count[1][h * d + c]);
      outlier_row(vg, false, p.layer, page, h, slot, vrow + h * d, thr);
    }
  }
}

// The bf16 copies of a write's rows into their recent-window twins (block = one row; slots[row] < 0:
// none), with the writer's bf16 rounding, so host and device twins agree bit for bit.
struct RecentWriteParams {
  cache::CacheGeometry geom;
  cache::LayerView layer;
  const float* in[2];    // [rows][heads][head_dim] fp32, K and V
  const int32_t* slots;  // [rows] encode_main_slot in the recent pool, or -1
};

__global__ void write_recent_kernel(const RecentWriteParams p) {
  const int row = blockIdx.x;
  const int32_t s = p.slots[row];
  if (s < 0) return;
  const cache::CacheGeometry& g = p.geom;
  const int d = g.head_dim, width = g.num_kv_heads * d;
  const int page = cache::slot_page(s, g.block_size), slot = cache::slot_in_page(s, g.block_size);
  for (int idx = threadIdx.x; idx < width; idx += blockDim.x) {
    const int h = idx / d, i = idx - h * d;
    const size_t e = g.elem_index(page, h, slot) + i;
    p.layer.k_recent[e] = attention::cuda::detail::store16<Format::kBf16>(p.in[0][size_t(row) * width + idx]);
    p.layer.v_recent[e] = attention::cuda::detail::store16<Format::kBf16>(p.in[1][size_t(row) * width + idx]);
  }
}

struct GenericAttendParams {
  cache::CacheGeometry geom;
  cache::LayerView layer;
  cache::BatchTablesView tables;
  const float* q;  // [rows][num_q_heads][head_dim]
  float* out;
  float* lse;      // optional [rows][num_q_heads]
  int rows, num_q_heads;
  float softmax_scale;
  int prefill_pos0;  // < 0: decode (row r = sequence r); else causal prefill of sequence 0
};

constexpr int kAttendTile = 32;         // tokens per shared-memory tile
constexpr int kAttendHeadsPerCta = 8;   // query heads of one kv head per CTA (one warp each)

// CTA = (kv head x group of <= 8 of its query heads, query row); warp w = one query head. Per tile
// of 32 tokens, all warps load and dequantize the K rows once into shared memory (coalesced; rows
// padded to D + 1 floats so lane t reading row t hits distinct banks), lane t computes token t's
// logit for its warp's head, then the V rows replace K and every lane accumulates its own head
// dims (l, l + 32, ...). All arithmetic in fp32 with an online softmax, as the CPU reference.
template <Format F>
__global__ void __launch_bounds__(32 * kAttendHeadsPerCta) generic_attend_kernel(const GenericAttendParams p) {
  constexpr int kDimsPerLane = kMaxGenericHeadDim / 32;
  __shared__ float tile[kAttendTile * (kMaxGenericHeadDim + 1)];
  __shared__ float qs[kAttendHeadsPerCta][kMaxGenericHeadDim];
  __shared__ attention::TokRef refs[kAttendTile];
  const cache::CacheGeometry& g = p.geom;
  const int d = g.head_dim, ld = d + 1;
  const int group = p.num_q_heads / g.num_kv_heads;
  const int head_groups = (group + kAttendHeadsPerCta - 1) / kAttendHeadsPerCta;
  const int kvh = blockIdx.x / head_groups, hg = blockIdx.x % head_groups;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = blockIdx.y;
  const int hq = kvh * group + hg * kAttendHeadsPerCta + warp;
  const bool active = hg * kAttendHeadsPerCta + warp < group;  // idle warps still load and sync
  const bool prefill = p.prefill_pos0 >= 0;
  const int seq = prefill ? 0 : r;
  const int len = prefill ? p.prefill_pos0 + r + 1 : p.tables.seq_lens[r];
  const int sink_len = min(max(p.tables.sink_lens[seq], 0), max(len, 0));
  if (active) {
    const float* q = p.q + (size_t(r) * p.num_q_heads + hq) * d;
    for (int i = lane; i < d; i += 32) qs[warp][i] = q[i];
  }

  constexpr float kNegInf = -__builtin_huge_valf();
  float m = kNegInf, l = 0.f, acc[kDimsPerLane];
#pragma unroll
  for (int k = 0; k < kDimsPerLane; ++k) acc[k] = 0.f;
  auto load_tile = [&](bool is_v, int n) {
    for (int idx = threadIdx.x; idx < n * d; idx += blockDim.x) {
      const int t = idx / d, i = idx - t * d;
      tile[t * ld + i] = attention::token_value<F>(p, is_v, refs[t], i);
    }
  };
  for (int c = 0; c < len; c += kAttendTile) {
    const int n = min(kAttendTile, len - c);
    if (threadIdx.x < n) refs[threadIdx.x] = attention::token_ref<F>(p, seq, c + threadIdx.x, sink_len, kvh, len - 1);
    __syncthreads();
    load_tile(false, n);
    __syncthreads();
    float s = kNegInf;
    if (active && lane < n) {
      float dot = 0.f;
      for (int i = 0; i < d; ++i) dot = fmaf(qs[warp][i], tile[lane * ld + i], dot);
      s = dot * p.softmax_scale;
    }
    const float m_new = fmaxf(m, warp_max(s));
    const float alpha = m == kNegInf ? 0.f : expf(m - m_new);
    const float pj = lane < n && active ? expf(s - m_new) : 0.f;
    l = l * alpha + warp_sum(pj);
    m = m_new;
    __syncthreads();  // K reads done
    load_tile(true, n);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kDimsPerLane; ++k) acc[k] *= alpha;
    for (int jj = 0; jj < n; ++jj) {
      const float w = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
      for (int k = 0; k < kDimsPerLane; ++k) {
        const int i = lane + 32 * k;
        if (i < d) acc[k] = fmaf(w, tile[jj * ld + i], acc[k]);
      }
    }
    __syncthreads();  // V reads done before the next tile
  }
  if (!active) return;
  float* o = p.out + (size_t(r) * p.num_q_heads + hq) * d;
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int k = 0; k < kDimsPerLane; ++k) {
    const int i = lane + 32 * k;
    if (i < d) o[i] = acc[k] * inv;
  }
  if (p.lse != nullptr && lane == 0) p.lse[size_t(r) * p.num_q_heads + hq] = l > 0.f ? m + logf(l) : kNegInf;
}

// Prefill through the decode kernel: query i of the chunk becomes a sequence of length
// q_pos0 + i + 1 (its causal prefix) sharing sequence 0's tables. Out: [n_q] lens, [n_q] sink lens,
// [n_q][max_blocks], [n_q][max_sink_blocks].
__global__ void expand_prefill_tables_kernel(cache::BatchTablesView t, int n_q, int q_pos0, int32_t* lens,
                                             int32_t* sink_lens, int32_t* blocks, int32_t* sink_blocks) {
  const int i = blockIdx.x;
  const int len = q_pos0 + i + 1;
  if (threadIdx.x == 0) {
    lens[i] = len;
    sink_lens[i] = min(max(t.sink_lens[0], 0), len);
  }
  for (int b = threadIdx.x; b < t.max_blocks; b += blockDim.x) blocks[size_t(i) * t.max_blocks + b] = t.block_tables[b];
  for (int b = threadIdx.x; b < t.max_sink_blocks; b += blockDim.x)
    sink_blocks[size_t(i) * t.max_sink_blocks + b] = t.sink_tables[b];
}

}  // namespace kvq::backend::cuda_ops
