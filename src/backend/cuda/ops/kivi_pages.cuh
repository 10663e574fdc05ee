#pragma once
// int4_kivi on the CUDA backend: the pages a cache write makes final (layout.h's kivi_page_final)
// are quantized from their bf16 twins, one CTA per (page, kv head, K|V), with quant/kivi_policy.h's
// host+device rule, so codes and fp16 scale / zero-point planes are bit-identical to the host
// cache's (PagedKvCache::quantize_kivi_page).
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/cache/layout.h"
#include "kvq/format/bf16.h"
#include "kvq/quant/kivi_policy.h"

namespace kvq::backend::cuda_ops {

// (page, twin) pairs per launch, passed by value (1 KiB of kernel parameters).
constexpr int kKiviPagesPerLaunch = 128;
constexpr int kKiviMaxBlock = 32, kKiviMaxHeadDim = 256;

struct KiviPagesParams {
  cache::CacheGeometry geom;  // the layer's; plane(kv) gives K's and V's parameter shapes
  cache::LayerView layer;
  int n;
  int32_t page[kKiviPagesPerLaunch], twin[kKiviPagesPerLaunch];
};

// grid (n, num_kv_heads, 2), any block size.
__global__ void kivi_pages_kernel(const KiviPagesParams p) {
  __shared__ float x[kKiviMaxBlock * kKiviMaxHeadDim];
  __shared__ float scale[kKiviMaxHeadDim], zero[kKiviMaxHeadDim];  // plain floats: no constructors in shared
  const int i = blockIdx.x, h = blockIdx.y, kv = blockIdx.z;
  const cache::CacheGeometry g = p.geom.plane(kv);
  const int bs = g.block_size, d = g.head_dim, page = p.page[i];
  const uint16_t* src = (kv == 0 ? p.layer.k_recent : p.layer.v_recent) + g.elem_index(p.twin[i], h, 0);
  for (int e = threadIdx.x; e < bs * d; e += blockDim.x) x[e] = format::bf16_to_float(src[e]);
  __syncthreads();
  void* params = kv == 0 ? p.layer.k_scales : p.layer.v_scales;
  const int groups = g.kivi_groups(), members = kv == 0 ? bs : d;  // K: a channel's tokens; V: a token's channels
  for (int grp = threadIdx.x; grp < groups; grp += blockDim.x) {
    quant::KiviRange r;
    for (int j = 0; j < members; ++j) r.add(kv == 0 ? x[j * d + grp] : x[grp * d + j]);
    const quant::KiviParams q = quant::kivi_params(r);
    scale[grp] = q.scale, zero[grp] = q.zero;
    cache::store_scale(params, g.kivi_param_index(page, h, grp, false), q.scale, g.scale_dtype);
    cache::store_scale(params, g.kivi_param_index(page, h, grp, true), q.zero, g.scale_dtype);
  }
  __syncthreads();
  uint8_t* codes = kv == 0 ? p.layer.k_codes : p.layer.v_codes;
  const int half = d / 2;
  for (int e = threadIdx.x; e < bs * half; e += blockDim.x) {
    const int t = e / half, c = 2 * (e - t * half);
    const int glo = kv == 0 ? c : t, ghi = kv == 0 ? c + 1 : t;
    const quant::KiviParams lo{scale[glo], zero[glo]}, hi{scale[ghi], zero[ghi]};
    codes[g.code_offset(page, h, t) + c / 2] = quant::kivi_code_pair(x[t * d + c], x[t * d + c + 1], lo, hi);
  }
}

}  // namespace kvq::backend::cuda_ops
