#pragma once
// The decode kernels' CTA-level pieces, shared by the register kernel (decode_kernel.cuh) and the ring
// kernel (decode_bulk_kernel.cuh): which tiles and query heads a CTA owns (CtaWork), the query loaded at
// the start and turned into fragments, the sink's and the main part's arguments, and the merge of the
// warps' softmax states into the CTA's output rows. The per-tile arithmetic is in decode_tiles.cuh.
#include "decode_tiles.cuh"

namespace kvq::attention::cuda::detail {

// The warps' O rows in shared memory for merge_and_store. Lane (g, t) holds head dims g D/8 + 2jj (+1) of
// heads 2t, 2t+1; unpadded, a store's 32 lanes met one bank pair (D256; D128 two, D64 four) and the rows'
// stores took 2-6 us of a CTA's end (docs/GPU_NOTES.md §22). Two floats after each lane's D/8 dims and
// four after the row spread every 8-byte store over all banks (two wavefronts) and keep the merge's reads
// of consecutive dims within two.
template <int D>
struct MergeRows {
  static constexpr int kGap = 2, kRow = D + 8 * kGap + 4;
  __host__ __device__ static constexpr int col(int d) { return d + kGap * (d / (D / 8)); }
};

// W: the attending warps (decode_warps).
template <int D, int W>
struct DecodeSmem {
  union {
    uint4 qf[2][(D / 16) * 32];                      // main path, sink path
    float o[W][kMaxGroupPerCta][MergeRows<D>::kRow];  // per-warp O for the final merge (MergeRows;
                                                      // o[2]: query_staging)
  };
  float m[W][kMaxGroupPerCta];
  float l[W][kMaxGroupPerCta];
  float mv[W][kMaxGroupPerCta];
  unsigned qamax_bits;
  unsigned long long t_start, t_pages0, t_pages1;  // DecodePlan::cta_timeline: kept here, not in registers
  DecodeSmemMarks marks;
};
// DecodePlan::cta_timeline: the CTA's start and, zeroed, the marks that a kernel may leave unset.
template <bool kTL, int D, int W>
__device__ __forceinline__ void start_timeline(const DecodeParams& p, DecodeSmem<D, W>& sm) {
  if (!kTL || p.timeline == nullptr || threadIdx.x != 0) return;
  sm.t_start = global_ns();
  sm.t_pages0 = sm.t_pages1 = 0;
  sm.marks = DecodeSmemMarks{};
  sm.marks.c_start = static_cast<unsigned long long>(clock64());
}

// ---- pieces shared by the register kernel (16-bit caches) and the bulk kernel (8-bit caches) ----------

// Which query heads and which tiles a CTA owns: the sequence's sink and main tiles dealt to the
// splits by split_range (kvq/attention/cuda/split_work.h, shared with its host test).
struct CtaWork {
  int kv_head, hq0, valid_heads, seq, split;
  int sink_len, n_sink_tiles, n_main;
  int sink_t0, sink_t1;  // sink tiles of this split
  int main_t0, main_t1;  // main tiles of this split (whole pages when unit_align > 1)
  int main_pages, first_page;  // the bulk kernel's pages of the main part (unit_align = tiles per page)
  __device__ bool empty() const { return sink_t0 >= sink_t1 && main_t0 >= main_t1; }
};

// The CTA's place in the grid: its sequence, kv head and query heads, from blockIdx alone (no load).
__device__ __forceinline__ CtaWork cta_place(const DecodeParams& p) {
  CtaWork w{};
  w.split = blockIdx.x;
  w.kv_head = blockIdx.y / p.head_groups;
  const int hg = blockIdx.y % p.head_groups;
  w.seq = blockIdx.z;
  w.hq0 = w.kv_head * p.group + hg * kMaxGroupPerCta;
  w.valid_heads = min(kMaxGroupPerCta, p.group - hg * kMaxGroupPerCta);
  return w;
}

// Its tiles, from the sequence's lengths (`w`: cta_place's).
__device__ __forceinline__ CtaWork cta_work(const DecodeParams& p, int unit_align, CtaWork w) {
  const int len = max(p.seq_lens[w.seq], 0);
  w.sink_len = min(max(p.sink_lens[w.seq], 0), len);
  w.n_sink_tiles = (w.sink_len + kTileTokens - 1) / kTileTokens;
  w.n_main = len - w.sink_len;
  SplitShape shape;
  shape.n_sink_tiles = w.n_sink_tiles;
  shape.n_main_tiles = (w.n_main + kTileTokens - 1) / kTileTokens;
  shape.num_splits = p.num_splits;
  shape.spread_sink = p.spread_sink != 0;
  shape.unit_align = unit_align;
  const SplitRange r = split_range(shape, w.split);
  w.sink_t0 = r.sink_t0, w.sink_t1 = r.sink_t1;
  w.main_t0 = r.main_t0, w.main_t1 = r.main_t1;
  w.main_pages = r.pages(unit_align), w.first_page = r.first_page(unit_align);
  return w;
}

// The CTA's query rows (valid_heads x D floats), element tid + k * blockDim.x in v[k]: loaded first, since
// their address needs no loaded value. Loaded after the ring's first copies, they queued behind the
// whole grid's ring bytes and the query was ready 7-9 us after the CTA's start, its first ring items long
// since arrived (docs/GPU_NOTES.md §22).
template <int D, int W>
struct QueryLoad {
  static constexpr int kN = kMaxGroupPerCta * D / (W * 32);  // enough for W warps (a producer warp adds threads)
  float v[kN];
};
template <int D, int W>
__device__ __forceinline__ QueryLoad<D, W> load_query(const DecodeParams& p, const CtaWork& place) {
  QueryLoad<D, W> ql;
  const float* q_rows = p.q + (static_cast<size_t>(place.seq) * p.num_q_heads + place.hq0) * D;
  const int n = place.valid_heads * D;
#pragma unroll
  for (int k = 0; k < QueryLoad<D, W>::kN; ++k) {
    const int idx = threadIdx.x + k * blockDim.x;
    ql.v[k] = idx < n ? __ldg(q_rows + idx) : 0.f;
  }
  return ql;
}

// An empty split still owes the merge its weight 0.
__device__ __forceinline__ void store_empty(const DecodeParams& p, const CtaWork& w, int D) {
  constexpr float kNegInf = -__builtin_huge_valf();
  for (int idx = threadIdx.x; idx < w.valid_heads * D; idx += blockDim.x) {
    const size_t row = static_cast<size_t>(w.seq) * p.num_q_heads + w.hq0 + idx / D;
    if (p.num_splits > 1) {
      p.part_out[(row * p.num_splits + w.split) * D + idx % D] = 0.f;
      if (idx % D == 0) p.part_lse[row * p.num_splits + w.split] = kNegInf;
    } else {
      p.out[row * D + idx % D] = 0.f;
      if (idx % D == 0 && p.lse != nullptr) p.lse[row] = kNegInf;
    }
  }
}

// Where prepare_query stages the query rows: o[2] of the union, free while the fragments (qf, the size
// of o[0] and o[1]) are built, and as large as the rows (kMaxGroupPerCta x D).
template <int D, int W>
__device__ __forceinline__ float* query_staging(DecodeSmem<D, W>& sm) {
  static_assert(sizeof(sm.qf) <= 2 * sizeof(sm.o[0]) && W >= 3 && sizeof(sm.o[2]) >= kMaxGroupPerCta * D * 4,
                "the staging rows must fit o[2], clear of qf");
  return &sm.o[2][0][0];
}

// Query fragments for the main path (sm.qf[0]) and the bf16 sink path (sm.qf[1]) from the rows that
// load_query brought; returns the factor that undoes the power-of-two prescale, which keeps fp16
// fragments in range whatever the query's magnitude. Every thread of the CTA must call it (it
// synchronises).
template <Format F, int D, int W>
__device__ float prepare_query(const DecodeParams& p, const CtaWork& w, DecodeSmem<D, W>& sm, const QueryLoad<D, W>& ql) {
  const int tid = threadIdx.x;
  float* rows = query_staging(sm);
  if (tid == 0) sm.qamax_bits = 0u;
  __syncthreads();
  float qa = 0.f;
  const int n = w.valid_heads * D;
#pragma unroll
  for (int k = 0; k < QueryLoad<D, W>::kN; ++k) {
    const int idx = tid + k * static_cast<int>(blockDim.x);
    if (idx < n) rows[idx] = ql.v[k], qa = fmaxf(qa, fabsf(ql.v[k]));
  }
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
  build_q_frags<F, D>(rows, w.valid_heads, qscale, sm.qf[0], tid);
  build_q_frags<Format::kBf16, D>(rows, w.valid_heads, qscale, sm.qf[1], tid);
  __syncthreads();
  return ldexpf(1.f, -e);
}

template <int D>
__device__ __forceinline__ void init_state(State<D>& st) {
  st.m = -__builtin_huge_valf(), st.l = 0.f, st.mv = -__builtin_huge_valf();
#pragma unroll
  for (int jj = 0; jj < D / 16; ++jj) st.o[jj][0] = st.o[jj][1] = st.o[jj][2] = st.o[jj][3] = 0.f;
}

// int4 (Path::kInt4KeyUnit): -8 * 2^-24 times head g's query summed as its fp16 fragments carry it
// (high-nibble entries back at full size), the start of lane (g, t)'s QK accumulators.
template <int D>
__device__ __forceinline__ float int4_key_bias(const uint4* qf, int lane) {
  float lo = 0.f, hi = 0.f;
#pragma unroll
  for (int M = 0; M < D / 16; ++M) {
    const uint4 r = qf[M * 32 + lane];
    const float2 a = unpack_half2(r.x), b = unpack_half2(r.y), c = unpack_half2(r.z), d = unpack_half2(r.w);
    lo += (a.x + a.y) + (b.x + b.y);
    hi += (c.x + c.y) + (d.x + d.y);
  }
  float sum = lo + 16.f * hi;
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  return -8.f * Path<Format::kInt4>::kInt4KeyUnit * sum;
}

// The bf16 sink tiles of this split: their arguments, and their pass through the register path (the
// register kernel's, and the ring kernel's where its ring does not take them, DecodePlan::sink_in_ring).
__device__ __forceinline__ PartArgs sink_args(const DecodeParams& p, const CtaWork& w, float unscale) {
  PartArgs a;
  a.k = p.k_sink, a.v = p.v_sink, a.ks = nullptr, a.vs = nullptr;
  a.table = p.sink_tables + static_cast<size_t>(w.seq) * p.max_sink_blocks;
  a.n_tokens = w.sink_len;
  a.tile_begin = w.sink_t0, a.tile_end = w.sink_t1;
  a.kconst = unscale, a.lvconst = 0.f;
  return a;
}
template <int D, int W>
__device__ __forceinline__ void run_sink(const DecodeParams& p, const CtaWork& w, const uint4* qf, float unscale,
                                         int warp, int lane, State<D>& st) {
  if (w.sink_t0 >= w.sink_t1) return;
  run_part<Format::kBf16, D, ScaleMode::kNone, W>(p, sink_args(p, w, unscale), w.kv_head, qf, warp, lane, st);
}

// Arguments of the main (quantized) part: scale constants per mode.
template <ScaleMode SM>
__device__ __forceinline__ PartArgs main_args(const DecodeParams& p, const CtaWork& w, float unscale) {
  PartArgs a;
  a.k = p.k_codes, a.v = p.v_codes, a.ks = p.k_scales, a.vs = p.v_scales;
  a.table = p.block_tables + static_cast<size_t>(w.seq) * p.max_blocks;
  a.n_tokens = w.n_main;
  a.tile_begin = w.main_t0, a.tile_end = w.main_t1;
  a.kconst = unscale * p.fnuz_factor;
  a.lvconst = 0.f;
  if constexpr (SM == ScaleMode::kTensor) {
    a.kconst *= ldg_scale(p.k_scales, 0, p.geom.scale_dtype);
    a.lvconst = __log2f(ldg_scale(p.v_scales, 0, p.geom.scale_dtype) * p.fnuz_factor);
  } else if constexpr (SM == ScaleMode::kToken) {
    a.lvconst = p.fnuz_factor;  // compute_tiles takes log2(v scale * this)
  }
  return a;
}

// Merges the W attending warps' softmax states through shared memory and stores the CTA's rows.
// Warps >= W (the bulk kernel's producer) only take part in the barriers.
template <int D, int W, bool kPack, bool kTL>
__device__ void merge_and_store(const DecodeParams& p, const CtaWork& w, DecodeSmem<D, W>& sm, State<D>& st, int warp,
                                int lane) {
  constexpr float kNegInf = -__builtin_huge_valf();
  // l is summed over the 4 lanes that share a head (packed: and the 4 of g + 4); packed O columns of
  // t >= 2 (low-half sums) join the high-half sums of t - 2.
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 1);
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 2);
  if constexpr (kPack) {
    st.l += __shfl_xor_sync(0xffffffffu, st.l, 16);
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.o[jj][i] += __shfl_xor_sync(0xffffffffu, st.o[jj][i], 2);
  }
  __syncthreads();  // everyone is done with the query fragments (union with o)
  mark_timeline<kTL>(p, sm.marks.t_warps);
  if (warp < W) {
    const int g = lane >> 2, t = lane & 3;
    if (t == 0) {
      sm.m[warp][g] = st.m;
      sm.l[warp][g] = st.l;
      sm.mv[warp][g] = st.mv;
    }
    const int base = MergeRows<D>::col(g * (D / 8));
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      *reinterpret_cast<float2*>(&sm.o[warp][2 * t][base + 2 * jj]) = make_float2(st.o[jj][0], st.o[jj][2]);
      *reinterpret_cast<float2*>(&sm.o[warp][2 * t + 1][base + 2 * jj]) = make_float2(st.o[jj][1], st.o[jj][3]);
    }
  }
  __syncthreads();
  mark_timeline<kTL>(p, sm.marks.t_rows);
  // Per head, once: the maximum, the sum and each warp's weight (-1: a warp without tokens), in place of the
  // warps' m, l and mv (thread h alone touches head h's).
  if (threadIdx.x < w.valid_heads) {
    const int h = threadIdx.x;
    float M = kNegInf;
#pragma unroll
    for (int v = 0; v < W; ++v) M = fmaxf(M, sm.m[v][h]);
    const float M_use = M == kNegInf ? 0.f : M;
    float L = 0.f;
#pragma unroll
    for (int v = 0; v < W; ++v) {
      L += sm.l[v][h] * exp2f(sm.m[v][h] - M_use);
      const float mvw = sm.mv[v][h];
      sm.mv[v][h] = mvw == kNegInf ? -1.f : exp2f(mvw - M_use);
    }
    sm.m[0][h] = M, sm.l[0][h] = L;
  }
  __syncthreads();
  mark_timeline<kTL>(p, sm.marks.t_heads);
  // kDims dims of one head per thread and step: four at head dims 128 and 256, where M, L, the warps' weights,
  // the index arithmetic and the branch on the split count then serve four elements, the rows are read as
  // float2 (MergeRows' gaps leave 8-byte alignment, not 16) and stored as one float4 (out and the workspace are
  // 16-byte aligned: decode.cu checks). One element a step took ~100-140 instructions, and this step -- issued
  // by 4-8 warps an SM, nothing else left to run -- 1.0-1.3 us at head dim 128 and 2.2-2.9 at 256 (docs/GPU_NOTES.md
  // §35-§37). Head dim 64 keeps one: there four ran the step 0.3 us longer, with a quarter as many work items as
  // threads (§37). Each element's arithmetic, and so its bits, is the same either way.
  constexpr int kDims = D >= 128 ? 4 : 1, kSteps = D / kDims;
  static_assert((D / 8) % kDims == 0, "a thread's dims must not straddle a MergeRows gap");
  const size_t row0 = static_cast<size_t>(w.seq) * p.num_q_heads + w.hq0;
  const int splits = p.num_splits;
  for (int idx = threadIdx.x; idx < w.valid_heads * kSteps; idx += blockDim.x) {
    const int h = idx / kSteps, d = kDims * (idx % kSteps);
    const float M = sm.m[0][h], L = sm.l[0][h];
    float num[kDims];
#pragma unroll
    for (int i = 0; i < kDims; ++i) num[i] = 0.f;
#pragma unroll
    for (int v = 0; v < W; ++v) {
      const float wv = sm.mv[v][h];
      const float* o = &sm.o[v][h][MergeRows<D>::col(d)];
      float x[kDims];
      if constexpr (kDims == 4) {
        const float2 a = *reinterpret_cast<const float2*>(o), b = *reinterpret_cast<const float2*>(o + 2);
        x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
      } else {
        x[0] = o[0];
      }
#pragma unroll
      for (int i = 0; i < kDims; ++i) num[i] += wv < 0.f ? 0.f : x[i] * wv;
    }
    // L == 0 only for an empty split; a NaN from a bad read must reach the output.
    float res[kDims];
#pragma unroll
    for (int i = 0; i < kDims; ++i) res[i] = L == 0.f ? 0.f : num[i] / L;
    const size_t row = row0 + h;
    float* dst = (splits > 1 ? p.part_out + (row * splits + w.split) * D : p.out + row * D) + d;
    if constexpr (kDims == 4) {
      *reinterpret_cast<float4*>(dst) = make_float4(res[0], res[1], res[2], res[3]);
    } else {
      *dst = res[0];
    }
    if (d == 0) {
      const float lse2 = L == 0.f ? kNegInf : M + __log2f(L);
      if (splits > 1) {
        p.part_lse[row * splits + w.split] = lse2;
      } else if (p.lse != nullptr) {
        p.lse[row] = lse2 * kLn2;
      }
    }
  }
}

}  // namespace kvq::attention::cuda::detail
