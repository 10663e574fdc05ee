#pragma once
// Variant 2 of the decode kernel (DecodeOptions::variant = 2): the same math as decode_kernel.cuh,
// but the loads go through a per-warp ring of shared-memory stages filled with cp.async, so
// several bundles per warp are in flight without holding registers. K/V copies cover whole
// sectors; the scales are copied once per tile by four lanes. Kept for measurements
// (docs/GPU_NOTES.md); instances exist for the 8-bit formats.
#include "decode_kernel.cuh"

namespace kvq::attention::cuda::detail::async {

// Loads go through a per-warp ring of kStages shared-memory stages (cp.async, 16-byte units of
// 32 lanes = 512 bytes); each lane reads back only what it copied, so no barrier is needed. A stage
// holds a bundle of kNT tiles; kStages - 1 bundles are in flight while one is computed.
constexpr int kStages = 3;

template <Format F, int D, ScaleMode SM>
struct Pipe {
  static constexpr int kKUnits = TileShape<F, D>::kKWords / 4;
  static constexpr int kVUnits = TileShape<F, D>::kVWords == 2 ? 1 : TileShape<F, D>::kVWords / 2;  // both tokens
  static constexpr int kSUnits = SM == ScaleMode::kToken ? 1 : 0;
  static constexpr int kU = kKUnits + kVUnits + kSUnits;  // units per tile
  static constexpr int kNT = 10 / kU > 0 ? 10 / kU : 1;   // ~5 KB per warp and stage
  static constexpr int kStageUnits = kNT * kU;
};

// Units per stage of a kernel whose main part is F (its sink part is bf16 without scales).
template <Format F, int D, ScaleMode SM>
constexpr int stage_units() {
  constexpr int a = Pipe<F, D, SM>::kStageUnits, b = Pipe<Format::kBf16, D, ScaleMode::kNone>::kStageUnits;
  return a > b ? a : b;
}

template <Format F, int D, ScaleMode SM>
constexpr int decode_dyn_smem_bytes() {
  constexpr int ring = kDecodeWarps * kStages * stage_units<F, D, SM>() * 512;
  constexpr int combine = kDecodeWarps * kMaxGroupPerCta * D * 4;  // reuses the ring at the end
  return ring > combine ? ring : combine;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async16(void* s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async8(void* s, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async4(void* s, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}




// Starts the copies of one tile's K/V (and per-token scales) into this lane's units of a stage.
template <Format F, int D, ScaleMode SM>
__device__ __forceinline__ void issue_tile(const DecodeParams& p, const PartArgs& a, int kv_head, int tile, int page,
                                           int lane, uint4* units) {
  using S = Pipe<F, D, SM>;
  constexpr int kB = Path<F>::kBytes;
  constexpr size_t kRow = static_cast<size_t>(D) * kB;
  constexpr int kVW = TileShape<F, D>::kVWords;
  const int g = lane >> 2, t = lane & 3;
  const int slot0 = (tile * kTileTokens) % p.block_size;
  const size_t head_base = (static_cast<size_t>(page) * p.num_kv_heads + kv_head) * p.block_size + slot0;
  const uint8_t* krow = a.k + (head_base + g) * kRow;
#pragma unroll
  for (int j = 0; j < S::kKUnits; ++j) cp_async16(&units[j * 32 + lane], krow + (t + 4 * j) * 16);
  const uint8_t* va = a.v + (head_base + 2 * t) * kRow + g * (kVW * 4);
  const uint8_t* vb = va + kRow;
  uint4* vu = units + S::kKUnits * 32;
  if constexpr (kVW == 2) {
    cp_async8(&vu[lane], va);
    cp_async8(reinterpret_cast<uint8_t*>(&vu[lane]) + 8, vb);
  } else {
#pragma unroll
    for (int j = 0; j < kVW / 4; ++j) {
      cp_async16(&vu[j * 32 + lane], va + 16 * j);
      cp_async16(&vu[(kVW / 4 + j) * 32 + lane], vb + 16 * j);
    }
  }
  if constexpr (SM == ScaleMode::kToken) {
    // The tile's 8 K and 8 V scales are 2 x 32 contiguous bytes (per_token_head) or one value each
    // (per_block_head): lanes 0-3 copy them for the whole warp (read back after a __syncwarp).
    float* su = reinterpret_cast<float*>(units + (S::kKUnits + S::kVUnits) * 32);
    const size_t head_row = static_cast<size_t>(page) * p.num_kv_heads + kv_head;
    if (p.scale_slot_mul == 1) {
      if (lane < 4) cp_async16(su + 4 * lane, (lane < 2 ? a.ks : a.vs) + head_row * p.block_size + slot0 + 4 * (lane & 1));
    } else if (lane < 2) {
      cp_async4(su + 8 * lane, (lane == 0 ? a.ks : a.vs) + head_row);
    }
  }
}

template <Format F, int D, ScaleMode SM>
__device__ __forceinline__ void read_tile(const DecodeParams& p, const uint4* units, int lane, Payload<F, D>& pl) {
  using S = Pipe<F, D, SM>;
  constexpr int kVW = TileShape<F, D>::kVWords;
#pragma unroll
  for (int j = 0; j < S::kKUnits; ++j) {
    const uint4 w = units[j * 32 + lane];
    pl.k[4 * j] = w.x, pl.k[4 * j + 1] = w.y, pl.k[4 * j + 2] = w.z, pl.k[4 * j + 3] = w.w;
  }
  const uint4* vu = units + S::kKUnits * 32;
  if constexpr (kVW == 2) {
    const uint4 w = vu[lane];
    pl.va[0] = w.x, pl.va[1] = w.y, pl.vb[0] = w.z, pl.vb[1] = w.w;
  } else {
#pragma unroll
    for (int j = 0; j < kVW / 4; ++j) {
      const uint4 x = vu[j * 32 + lane], y = vu[(kVW / 4 + j) * 32 + lane];
      pl.va[4 * j] = x.x, pl.va[4 * j + 1] = x.y, pl.va[4 * j + 2] = x.z, pl.va[4 * j + 3] = x.w;
      pl.vb[4 * j] = y.x, pl.vb[4 * j + 1] = y.y, pl.vb[4 * j + 2] = y.z, pl.vb[4 * j + 3] = y.w;
    }
  }
  if constexpr (SM == ScaleMode::kToken) {
    const float* su = reinterpret_cast<const float*>(units + (S::kKUnits + S::kVUnits) * 32);
    const int i0 = p.scale_slot_mul * 2 * (lane & 3);
    pl.ks0 = su[i0], pl.ks1 = su[i0 + p.scale_slot_mul], pl.vs0 = su[8 + i0], pl.vs1 = su[8 + i0 + p.scale_slot_mul];
  }
}

// One part's tiles [tile_begin, tile_end) for this warp: bundles of NT tiles dealt round-robin to
// the warps; kStages - 1 bundles are being copied while one is computed, and the page ids of the
// next bundle to copy are loaded one iteration ahead so the copies never wait on the table.
template <Format F, int D, ScaleMode SM, int kRingUnits>
__device__ __forceinline__ void run_part(const DecodeParams& p, const PartArgs& a, int kv_head, const uint4* qf, int warp,
                                         int lane, uint4* ring, State<D>& st) {
  constexpr int NT = Pipe<F, D, SM>::kNT, U = Pipe<F, D, SM>::kU;
  const int n_tiles = a.tile_end - a.tile_begin;
  if (n_tiles <= 0) return;
  const int n_bundles = (n_tiles + NT - 1) / NT;
  const int nk = (n_bundles - warp + kDecodeWarps - 1) / kDecodeWarps;  // this warp's bundles
  if (nk <= 0) return;
  const int tiles_per_page = p.block_size / kTileTokens;
  auto first_tile = [&](int k) { return a.tile_begin + (warp + kDecodeWarps * k) * NT; };
  auto stage = [&](int k, int i) { return ring + ((k % kStages) * kRingUnits + i * U) * 32; };
  int pg[NT];
  auto load_pages = [&](int k) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int tile = first_tile(k) + i;
      pg[i] = (k < nk && tile < a.tile_end) ? __ldg(a.table + tile / tiles_per_page) : 0;
    }
  };
  auto issue = [&](int k) {
    if (k >= nk) return;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int tile = first_tile(k) + i;
      if (tile < a.tile_end) issue_tile<F, D, SM>(p, a, kv_head, tile, pg[i], lane, stage(k, i));
    }
  };
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {
    load_pages(k);
    issue(k);
    cp_async_commit();
  }
  load_pages(kStages - 1);
  for (int k = 0; k < nk; ++k) {
    __syncwarp();            // every lane is done reading the stage about to be refilled
    issue(k + kStages - 1);  // into the stage computed in the previous iteration
    cp_async_commit();
    load_pages(k + kStages);
    cp_async_wait<kStages - 1>();
    __syncwarp();            // the scales were copied by other lanes
    Payload<F, D> pl[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      if (first_tile(k) + i < a.tile_end) {
        read_tile<F, D, SM>(p, stage(k, i), lane, pl[i]);
      } else {
        pl[i] = Payload<F, D>{};
      }
    }
    compute_bundle<F, D, SM>(pl, qf, a, first_tile(k), lane, st);
  }
  cp_async_wait<0>();
}

template <int D>
struct DecodeSmem {
  uint4 qf[2][(D / 16) * 32];  // query fragments: main path, sink path
  float m[kDecodeWarps][kMaxGroupPerCta];
  float l[kDecodeWarps][kMaxGroupPerCta];
  float mv[kDecodeWarps][kMaxGroupPerCta];
  unsigned qamax_bits;
};

template <Format F, int D, ScaleMode SM>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel_async(const DecodeParams p) {
  __shared__ DecodeSmem<D> sm;
  extern __shared__ uint4 dyn_smem[];  // the cp.async rings, then the per-warp O for the merge
  constexpr int kRingUnits = stage_units<F, D, SM>();
  uint4* ring = dyn_smem + (threadIdx.x / 32) * kStages * kRingUnits * 32;
  auto o_smem = reinterpret_cast<float(*)[kMaxGroupPerCta][D]>(dyn_smem);
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / p.head_groups, hg = blockIdx.y % p.head_groups;
  const int seq = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int hq0 = kv_head * p.group + hg * kMaxGroupPerCta;
  const int valid_heads = min(kMaxGroupPerCta, p.group - hg * kMaxGroupPerCta);

  const int len = p.seq_lens[seq];
  const int sink_len = min(max(p.sink_lens[seq], 0), max(len, 0));
  const int n_sink_tiles = (sink_len + kTileTokens - 1) / kTileTokens;
  const int n_main = max(len, 0) - sink_len;
  const int n_tiles = n_sink_tiles + (n_main + kTileTokens - 1) / kTileTokens;
  const int per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t0 = min(split * per_split, n_tiles), t1 = min(t0 + per_split, n_tiles);

  constexpr float kNegInf = -__builtin_huge_valf();
  if (t0 >= t1) {  // nothing for this split: weight 0 in the merge
    for (int idx = tid; idx < valid_heads * D; idx += kDecodeThreads) {
      const size_t row = static_cast<size_t>(seq) * p.num_q_heads + hq0 + idx / D;
      if (p.num_splits > 1) {
        p.part_out[(row * p.num_splits + split) * D + idx % D] = 0.f;
        if (idx % D == 0) p.part_lse[row * p.num_splits + split] = kNegInf;
      } else {
        p.out[row * D + idx % D] = 0.f;
        if (idx % D == 0 && p.lse != nullptr) p.lse[row] = kNegInf;
      }
    }
    return;
  }

  // Query: a power-of-two prescale keeps fp16 fragments in range whatever the query's magnitude.
  const float* q_rows = p.q + (static_cast<size_t>(seq) * p.num_q_heads + hq0) * D;
  if (tid == 0) sm.qamax_bits = 0u;
  __syncthreads();
  float qa = 0.f;
  for (int idx = tid; idx < valid_heads * D; idx += kDecodeThreads) qa = fmaxf(qa, fabsf(q_rows[idx]));
  atomicMax(&sm.qamax_bits, __float_as_uint(qa));
  __syncthreads();
  const float qamax = __uint_as_float(sm.qamax_bits) * p.softmax_scale * kLog2e;
  int e = 0;
  if (qamax > 0.f && qamax < __builtin_huge_valf()) {
    int x;
    frexpf(qamax, &x);
    e = min(max(8 - x, -100), 100);
  }
  const float qscale = p.softmax_scale * kLog2e * ldexpf(1.f, e);
  const float unscale = ldexpf(1.f, -e);

  constexpr bool kMainBf16 = Path<F>::kBf16Mma;
  build_q_frags<D, Path<F>::kBytes, kMainBf16>(q_rows, valid_heads, qscale, sm.qf[0], tid);
  build_q_frags<D, 2, true>(q_rows, valid_heads, qscale, sm.qf[1], tid);
  __syncthreads();

  State<D> st;
  st.m = kNegInf, st.l = 0.f, st.mv = kNegInf;
#pragma unroll
  for (int jj = 0; jj < D / 16; ++jj) st.o[jj][0] = st.o[jj][1] = st.o[jj][2] = st.o[jj][3] = 0.f;

  if (t0 < n_sink_tiles) {
    PartArgs a;
    a.k = p.k_sink, a.v = p.v_sink, a.ks = nullptr, a.vs = nullptr;
    a.table = p.sink_tables + static_cast<size_t>(seq) * p.max_sink_blocks;
    a.n_tokens = sink_len;
    a.tile_begin = t0, a.tile_end = min(t1, n_sink_tiles);
    a.kconst = unscale, a.lvconst = 0.f;
    run_part<Format::kBf16, D, ScaleMode::kNone, kRingUnits>(p, a, kv_head, sm.qf[1], warp, lane, ring, st);
  }
  if (t1 > n_sink_tiles) {
    PartArgs a;
    a.k = p.k_codes, a.v = p.v_codes, a.ks = p.k_scales, a.vs = p.v_scales;
    a.table = p.block_tables + static_cast<size_t>(seq) * p.max_blocks;
    a.n_tokens = n_main;
    a.tile_begin = max(t0, n_sink_tiles) - n_sink_tiles, a.tile_end = t1 - n_sink_tiles;
    a.kconst = unscale * p.fnuz_factor;
    a.lvconst = 0.f;
    if constexpr (SM == ScaleMode::kTensor) {
      a.kconst *= __ldg(p.k_scales);
      a.lvconst = __log2f(__ldg(p.v_scales) * p.fnuz_factor);
    } else if constexpr (SM == ScaleMode::kToken) {
      a.lvconst = p.fnuz_factor;  // compute_tile takes log2(v scale * this)
    }
    run_part<F, D, SM, kRingUnits>(p, a, kv_head, sm.qf[0], warp, lane, ring, st);
  }

  // Merge the warps. l is summed over the 4 lanes that share a head.
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 1);
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 2);
  __syncthreads();  // every warp is done with its ring (o_smem reuses it)
  {
    const int g = lane >> 2, t = lane & 3;
    if (t == 0) {
      sm.m[warp][g] = st.m;
      sm.l[warp][g] = st.l;
      sm.mv[warp][g] = st.mv;
    }
    const int base = g * (D / 8);
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      *reinterpret_cast<float2*>(&o_smem[warp][2 * t][base + 2 * jj]) = make_float2(st.o[jj][0], st.o[jj][2]);
      *reinterpret_cast<float2*>(&o_smem[warp][2 * t + 1][base + 2 * jj]) = make_float2(st.o[jj][1], st.o[jj][3]);
    }
  }
  __syncthreads();
  for (int idx = tid; idx < valid_heads * D; idx += kDecodeThreads) {
    const int h = idx / D, d = idx % D;
    float M = kNegInf;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) M = fmaxf(M, sm.m[w][h]);
    const float M_use = M == kNegInf ? 0.f : M;
    float L = 0.f, num = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      L += sm.l[w][h] * exp2f(sm.m[w][h] - M_use);
      const float mvw = sm.mv[w][h];
      num += mvw == kNegInf ? 0.f : o_smem[w][h][d] * exp2f(mvw - M_use);
    }
    // L == 0 only for an empty split; a NaN from a bad read must reach the output.
    const float res = L == 0.f ? 0.f : num / L;
    const float lse2 = L == 0.f ? kNegInf : M + __log2f(L);
    const size_t row = static_cast<size_t>(seq) * p.num_q_heads + hq0 + h;
    if (p.num_splits > 1) {
      p.part_out[(row * p.num_splits + split) * D + d] = res;
      if (d == 0) p.part_lse[row * p.num_splits + split] = lse2;
    } else {
      p.out[row * D + d] = res;
      if (d == 0 && p.lse != nullptr) p.lse[row] = lse2 * kLn2;
    }
  }
}

}  // namespace kvq::attention::cuda::detail::async
