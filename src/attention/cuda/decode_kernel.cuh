#pragma once
// The register kernel (16-bit caches at head dim 256, and where a plan asks for it) and the split merge
// kernel. The tiles' arithmetic is in decode_tiles.cuh, the CTA's pieces in decode_cta.cuh; the ring
// kernel of the other caches in decode_bulk_kernel.cuh.
#include "decode_cta.cuh"

namespace kvq::attention::cuda::detail {

// The register kernel (bf16/fp16 caches): every warp loads its own tiles with 16-byte loads and
// keeps the next bundle in registers. 16-bit tiles carry 8 tokens in twice the bytes of an 8-bit
// tile, so this path already streams near the bandwidth ceiling (docs/GPU_NOTES.md §4).
template <Format F, int D, ScaleMode SM, int kMinCtas, bool kTL>
__global__ void __launch_bounds__(decode_warps(Path<F>::kBits, D) * 32, kMinCtas) decode_kernel(const DecodeParams p) {
  constexpr int W = decode_warps(Path<F>::kBits, D);
  __shared__ DecodeSmem<D, W> sm;
  pdl_wait_primary();  // DecodePlan::overlap_previous (as in the ring kernel)
  start_timeline<kTL>(p, sm);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const CtaWork place = cta_place(p);
  const QueryLoad<D, W> ql = load_query<D, W>(p, place);
  const CtaWork w = cta_work(p, 1, place);
  if (w.empty()) {
    store_empty(p, w, D);
    record_timeline<kTL>(p, sm.t_start, 0, 0, 0, nullptr);
    return;
  }
  const float unscale = prepare_query<F, D>(p, w, sm, ql);
  State<D> st;
  init_state(st);
  run_sink<D, W>(p, w, sm.qf[1], unscale, warp, lane, st);
  mark_timeline<kTL>(p, sm.t_pages0);
  if (w.main_t0 < w.main_t1) run_part<F, D, SM, W>(p, main_args<SM>(p, w, unscale), w.kv_head, sm.qf[0], warp, lane, st);
  mark_timeline<kTL>(p, sm.t_pages1);
  pdl_launch_dependents();
  merge_and_store<D, W, false, kTL>(p, w, sm, st, warp, lane);
  record_timeline<kTL>(p, sm.t_start, (w.main_t1 - w.main_t0) * kTileTokens / p.block_size, sm.t_pages0, sm.t_pages1,
                  &sm.marks);
}

// Log-sum-exp merge of the splits: one CTA of kMergeThreads per (sequence, query head). D / 4 threads
// cover a row's dims (4 each); the CTA's kMergeThreads / (D / 4) such groups take every
// (kMergeThreads / (D / 4))-th split, kMergeBatch of them per step with their loads in flight together, and
// merge them online (a running maximum per group), so a row costs one round of loads per kGroups x
// kMergeBatch splits; the groups meet in shared memory. A first pass over the splits' lse for the row's
// maximum cost one more dependent round: the merge of B1 L32768's 66 splits took 6, and the merge the
// larger part of the 5-8 us after the decode's last CTA (docs/GPU_NOTES.md §14, §16, §22).
constexpr int kMergeThreads = 256, kMergeBatch = 4;
template <int D>
__global__ void __launch_bounds__(kMergeThreads) decode_merge_kernel(const float* part_out, const float* part_lse,
                                                                      int num_splits, float* out, float* lse) {
  constexpr int kLanes = D / 4, kGroups = kMergeThreads / kLanes;
  static_assert(kGroups >= 1 && kMergeThreads % kLanes == 0, "a row's dims must fit one merge CTA");
  constexpr float kNegInf = -__builtin_huge_valf();
  __shared__ float4 acc_s[kGroups][kLanes];
  __shared__ float m_s[kGroups], l_s[kGroups];
  const size_t row = blockIdx.x;
  const float* pl = part_lse + row * num_splits;
  const int tid = threadIdx.x, grp = tid / kLanes, d = (tid % kLanes) * 4;
  const float* po = part_out + row * num_splits * D + d;
  pdl_wait_primary();  // launched to overlap the decode's tail (run()): its partial rows only after it

  float m = kNegInf, L = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = grp; s0 < num_splits; s0 += kGroups * kMergeBatch) {
    float ls[kMergeBatch];
    float4 x[kMergeBatch];
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const int s = s0 + b * kGroups;
      ls[b] = s < num_splits ? pl[s] : kNegInf;
      x[b] = s < num_splits ? *reinterpret_cast<const float4*>(po + static_cast<size_t>(s) * D) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mb = m;
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) mb = fmaxf(mb, ls[b]);
    // While every split so far is empty, mb is -inf: weights against 0 then, so that a NaN lse still reaches L.
    const float mb_use = mb == kNegInf ? 0.f : mb;
    const float c = exp2f(m - mb_use);  // 0 while m is -inf (L and acc are 0, or NaN, then)
    L *= c, acc.x *= c, acc.y *= c, acc.z *= c, acc.w *= c;
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const float w = exp2f(ls[b] - mb_use);
      L += w;
      // An empty split (w = 0) contributes nothing, whatever it stored; a NaN of a non-empty one stays.
      if (w != 0.f) acc.x += w * x[b].x, acc.y += w * x[b].y, acc.z += w * x[b].z, acc.w += w * x[b].w;
    }
    m = mb;
  }
  acc_s[grp][tid % kLanes] = acc;
  if (tid % kLanes == 0) m_s[grp] = m, l_s[grp] = L;
  __syncthreads();
  if (grp != 0) return;
  float M = kNegInf;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) M = fmaxf(M, m_s[g]);
  const float M_use = M == kNegInf ? 0.f : M;
  L = 0.f;
  acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const float c = exp2f(m_s[g] - M_use);
    const float4 x = acc_s[g][tid];
    L += l_s[g] * c;
    if (c != 0.f) acc.x += c * x.x, acc.y += c * x.y, acc.z += c * x.z, acc.w += c * x.w;
  }
  const float inv = L == 0.f ? 0.f : 1.f / L;
  *reinterpret_cast<float4*>(out + row * D + d) = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  if (tid == 0 && lse != nullptr) lse[row] = L == 0.f ? kNegInf : (M + __log2f(L)) * kLn2;
}

}  // namespace kvq::attention::cuda::detail
