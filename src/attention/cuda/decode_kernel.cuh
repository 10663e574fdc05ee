#pragma once
// The decode kernel (see include/kvq/attention/cuda/decode.h for the contract). Layout of the work:
//
// CTA = (split, kv head x head group, sequence), 4 warps. The sequence's tokens form two parts,
// sink (bf16 pages) and main (quantized pages), cut into tiles of 8 tokens that never straddle a
// page. The split's tiles are dealt to the warps in bundles of NT tiles; each warp keeps its own
// online softmax and all warps are merged through shared memory at the end.
//
// Per tile and warp, lane (g, t) = (lane / 4, lane % 4):
//   QK^T on tensor cores: A = the query rows (rows 0-7 the high halves of up to 8 heads, rows 8-15
//     the low halves), B = K^T with token g in column g: lane t holds head-dim chunks t, t+4, ...
//     of 16 bytes of token g, so the contraction index is a fixed permutation of the head dim
//     that the query fragments (built once per CTA in shared memory) follow.
//     Result: logits of head g for tokens 2t, 2t+1.
//   PV on tensor cores (m16n8k8): A = V^T with rows = head dims (lane g owns dims
//     [g*D/8, (g+1)*D/8)), columns = the 8 tokens; B = probabilities, which are exactly the QK
//     result layout (head g, tokens 2t, 2t+1). Result: O for heads 2t, 2t+1 over lane g's dims.
//     The probabilities go in twice, high and low half, into the same accumulators.
// Scales: K scales multiply the logit; V scales enter the probability as log2(scale) added to the
// logit, with a separate running maximum for the numerator, so any scale magnitude is exact in
// fp16 (the weights stay <= 1). Logits are kept in the log2 domain.
#include <cstdint>

#include "device_util.cuh"
#include "kvq/attention/cuda/decode.h"
#include "kvq/attention/cuda/split_work.h"
#include "kvq/cache/layout.h"
#include "kvq/format/format.h"

namespace kvq::attention::cuda::detail {

enum class ScaleMode : int { kNone, kTensor, kToken };

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kTileTokens = 8;
constexpr int kMaxGroupPerCta = 8;

struct DecodeParams {
  const uint8_t* k_codes;
  const uint8_t* v_codes;
  const void* k_scales;  // geom.scale_dtype elements
  const void* v_scales;
  const uint8_t* k_sink;  // bf16 planes as bytes
  const uint8_t* v_sink;
  const int32_t* seq_lens;
  const int32_t* sink_lens;
  const int32_t* block_tables;
  const int32_t* sink_tables;
  int max_blocks, max_sink_blocks;
  const float* q;
  float* out;
  float* lse;
  float* part_out;  // [seq][q head][split][D] when num_splits > 1
  float* part_lse;  // [seq][q head][split]
  cache::CacheGeometry geom;  // element and scale addresses (elem_index / scale_index)
  int num_kv_heads, num_q_heads, group, head_groups, block_size, num_splits;
  int spread_sink;  // the sink's tiles dealt over all splits (SplitShape::spread_sink), else the first
  float softmax_scale;
  float fnuz_factor;  // 0.5 for FNUZ read as OCP, else 1
  int ring_stages;    // bulk kernel: pages in flight per CTA (a multiple of kDecodeWarps, <= kMaxStages)
  int stage_bytes;    // bulk kernel: bytes of one ring stage (bulk_stage_bytes)
  unsigned long long* timeline;  // DecodePlan::cta_timeline (diagnostics), usually null
  int sink_in_ring;              // bulk kernel: DecodePlan::sink_in_ring
};

// DecodePlan::cta_timeline: the global timer when the CTA starts, when its warp 0 starts and ends the
// main pages (after the query and the sink; before the warps' merge and the store), and when it is done.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Marks of the ramp's steps (DecodePlan::cta_timeline words 6-10), kept in shared memory by thread 0.
struct DecodeSmemMarks {
  unsigned long long t_work, t_primed, t_query, t_item0, t_warps;
};
__device__ __forceinline__ void record_timeline(const DecodeParams& p, unsigned long long t0, int pages,
                                                unsigned long long t_pages0, unsigned long long t_pages1,
                                                const DecodeSmemMarks* marks) {
  if (p.timeline == nullptr || threadIdx.x != 0) return;  // t0: thread 0's start time (DecodeSmem::t_start)
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const size_t cta = blockIdx.x + static_cast<size_t>(gridDim.x) * (blockIdx.y + static_cast<size_t>(gridDim.y) * blockIdx.z);
  unsigned long long* row = p.timeline + kTimelineWords * cta;  // the layout DecodePlan::cta_timeline documents
  row[0] = t0, row[1] = global_ns(), row[2] = smid, row[3] = static_cast<unsigned long long>(pages);
  row[4] = t_pages0, row[5] = t_pages1;
  // The ring kernel's ramp, in steps (0 where a kernel does not mark them): work and barriers known, warp 0's
  // ring prime issued, query prepared, warp 0's first ring item arrived, every warp past its pages.
  const DecodeSmemMarks mk = marks != nullptr ? *marks : DecodeSmemMarks{};
  row[6] = mk.t_work, row[7] = mk.t_primed, row[8] = mk.t_query, row[9] = mk.t_item0, row[10] = mk.t_warps;
}
__device__ __forceinline__ void mark_timeline(const DecodeParams& p, unsigned long long& t) {
  if (p.timeline != nullptr && threadIdx.x == 0) t = global_ns();
}

// ---- per-format fragment builders ------------------------------------------------------------------

template <Format F>
struct Path {
  static constexpr int kBits = format_traits(F).bits;
  static constexpr int kBytes = kBits == 16 ? 2 : 1;  // per code (int4: two codes per byte)
  static constexpr bool kBf16Mma = F == Format::kBf16;
  static constexpr bool kInt4 = F == Format::kInt4;
  static constexpr bool kFiniteCodes = format_traits(F).kind == CodeKind::kInteger;  // no code decodes to NaN/inf
  // int4 K codes reach the QK mmas as subnormal halves of u = code + 8 (int4x2_to_subnormal_half2): a
  // low nibble is u * 2^-24 (kInt4KeyUnit), a high nibble u * 2^-20. build_q_frags divides the query
  // entries that meet high nibbles (rows r = 2, 3) by 16, so every product is q u 2^-24; the
  // accumulators start at -8 * 2^-24 * sum(q) (int4_key_bias), which leaves 2^-24 q.code, and
  // PartArgs::kconst carries the 2^24. The offset is a term of one dot product (of the size of the
  // logit or a few times it), not a sum over tokens, so the logits stay fp32-accurate; it saves the
  // HSUB2/HFMA2 per K pair, 32 of int4's 405 instructions per 16-token page.
  static constexpr float kInt4KeyUnit = 0x1p-24f;

  // Head-dim element that lane t's K words feed to contraction row r of QK mma M, r = 0..3 for the
  // rows 2t, 2t+1, 2t+8, 2t+9 (what build_q_frags puts there). Lane t holds K pieces t, t+4, ...
  // of min(16, its share) bytes each (see load_tile_smem); 8- and 16-bit words go to the mma in
  // element order; lane-local int4 word w (8 elements) feeds mma 2w its elements {0, 4, 1, 5} and
  // mma 2w+1 its elements {2, 6, 3, 7}: what one mask of a word's two halves yields (k_frag).
  template <int D>
  __device__ __forceinline__ static int k_elem(int M, int t, int r) {
    constexpr int kKW = D * kBits / 128;  // TileShape::kKWords
    constexpr int kPiece = kKW * 4 < 16 ? kKW * 4 : 16;
    // Lane-local byte -> byte of the row: pieces t, t+4, ...
    auto row_byte = [&](int lb) { return (t + 4 * (lb / kPiece)) * kPiece + lb % kPiece; };
    if constexpr (kInt4) return 2 * row_byte(4 * (M >> 1)) + 2 * (M & 1) + (r >> 1) + 4 * (r & 1);
    return row_byte(4 * M * kBytes) / kBytes + r;  // lane-local elements 4M..4M+3, in order in one piece
  }

  // B fragment of QK mma M from the lane's K words.
  __device__ __forceinline__ static void k_frag(const uint32_t* kw, int M, uint32_t& b0, uint32_t& b1) {
    if constexpr (kBytes == 2) {
      b0 = kw[2 * M];
      b1 = kw[2 * M + 1];
    } else if constexpr (kInt4) {
      const uint32_t x = kw[M >> 1] >> (8 * (M & 1));
      b0 = int4x2_to_subnormal_half2(x);
      b1 = int4x2_hi_to_subnormal_half2(x);
    } else if constexpr (F == Format::kInt8) {
      const uint32_t u = kw[M] ^ 0x80808080u;
      b0 = biased_u8x2_to_half2(prmt(u, 0x64646464u, 0x4140));
      b1 = biased_u8x2_to_half2(prmt(u, 0x64646464u, 0x4342));
    } else {  // fp8 (OCP bytes; FNUZ bytes read as OCP)
      b0 = e4m3x2_to_half2(kw[M]);
      b1 = e4m3x2_hi_to_half2(kw[M]);
    }
  }

  // A fragment of PV mma jj (head dims 2jj, 2jj+1 of the lane's range) from tokens 2t (a), 2t+1 (b).
  __device__ __forceinline__ static void v_frag(const uint32_t* a, const uint32_t* b, int jj, uint32_t& a0,
                                                uint32_t& a1) {
    if constexpr (kBytes == 2) {
      a0 = prmt(a[jj], b[jj], 0x5410);
      a1 = prmt(a[jj], b[jj], 0x7632);
    } else if constexpr (kInt4) {
      // Byte k = jj % 4 of word jj / 4 holds dims 2jj (low nibble) and 2jj+1 (high nibble); one PRMT
      // puts a's byte k at byte 0 and b's at byte 2 (no shift for odd k).
      const int w = jj >> 2, k = jj & 3;
      const uint32_t x = prmt(a[w], b[w], k | (k << 4) | ((k + 4) << 8) | ((k + 4) << 12));  // [a_k, a_k, b_k, b_k]
      a0 = int4x2_to_half2(x);
      a1 = int4x2_hi_to_half2(x);
    } else {
      const int w = jj >> 1;
      const uint32_t x = prmt(a[w], b[w], (jj & 1) ? 0x7362 : 0x5140);  // [a_d, b_d, a_d+1, b_d+1]
      if constexpr (F == Format::kInt8) {
        const uint32_t u = x ^ 0x80808080u;
        a0 = biased_u8x2_to_half2(prmt(u, 0x64646464u, 0x4140));
        a1 = biased_u8x2_to_half2(prmt(u, 0x64646464u, 0x4342));
      } else {
        a0 = e4m3x2_to_half2(x);
        a1 = e4m3x2_hi_to_half2(x);
      }
    }
  }
};

// Tiles per online-softmax step in the bulk kernel. The step's fixed work (maxima, shuffles, the
// rescale, the loop and the ring's wait and refill) is paid once per step, so a step takes as many
// tiles as the registers allow: four when a tile is at most 12 words of payload per lane (8-bit codes
// at head dim 64, int4 at 64 and 128: D x bits <= 512), one for 16-bit tiles at D >= 128 (36 words),
// else two. Pairs of tiles are one k = 16 PV contraction.
KVQ_HD constexpr int ring_step_tiles(int bits, int D) { return bits == 16 && D >= 128 ? 1 : D * bits <= 512 ? 4 : 2; }
// Pages per ring stage: enough for one softmax step (two 16-token pages when a step is four tiles).
KVQ_HD constexpr int ring_pages_per_stage(int bits, int D, int block_size) {
  return ring_step_tiles(bits, D) * kTileTokens > block_size ? ring_step_tiles(bits, D) * kTileTokens / block_size : 1;
}

template <Format F, int D>
struct TileShape {
  static constexpr int kKWords = D * Path<F>::kBits / 128;  // lane's share of one K row
  static constexpr int kVWords = D * Path<F>::kBits / 256;  // lane's share of one V row
  static constexpr int kWordsPerTile = kKWords + 2 * kVWords + 4;
  static constexpr int kNT = kWordsPerTile <= 12 ? 4 : kWordsPerTile <= 24 ? 2 : 1;
  static constexpr bool kPrefetch = kWordsPerTile * kNT <= 48;
  static constexpr int kRingStepTiles = ring_step_tiles(Path<F>::kBits, D);
};

template <Format F, int D>
struct Payload {
  uint32_t k[TileShape<F, D>::kKWords];
  uint32_t va[TileShape<F, D>::kVWords];
  uint32_t vb[TileShape<F, D>::kVWords];
  float ks0, ks1, vs0, vs1;
};

template <int D>
struct State {
  float m, l, mv;
  float o[D / 16][4];
};

// Element i of a read-only scale plane (layout.h's load_scale through the read-only cache); an
// fp16 scale widens exactly, so both dtypes feed the same float arithmetic.
__device__ __forceinline__ float ldg_scale(const void* plane, size_t i, ScaleDtype d) {
  if (d == ScaleDtype::kFp16) return __half2float(__ushort_as_half(__ldg(static_cast<const unsigned short*>(plane) + i)));
  return __ldg(static_cast<const float*>(plane) + i);
}

// Everything a part (sink or main) loop needs besides the State.
struct PartArgs {
  const uint8_t* k;     // plane base (bytes)
  const uint8_t* v;
  const void* ks;       // per-token scales (kToken) or null, geom.scale_dtype elements
  const void* vs;
  const int32_t* table;  // this sequence's row
  int n_tokens;          // tokens in the part
  int tile_begin, tile_end;  // tiles of this CTA within the part
  float kconst;          // logit multiplier (2^-e, fnuz, tensor scale; int4: 2^24, Path::kInt4KeyUnit)
  float lvconst;         // log2 of the constant V factor
  float kbias = 0.f;     // int4: the QK accumulators' start (int4_key_bias)
};

template <Format F, int D, ScaleMode SM>
__device__ __forceinline__ void load_tile(const DecodeParams& p, const PartArgs& a, int kv_head, int tile, int page,
                                          int lane, Payload<F, D>& pl) {
  constexpr int kB = Path<F>::kBytes;
  constexpr size_t kRow = static_cast<size_t>(D) * kB;
  const int g = lane >> 2, t = lane & 3;
  const int slot0 = (tile * kTileTokens) % p.block_size;
  // Sink and main planes share the element layout; only the element size differs (kB).
  const uint8_t* krow = a.k + p.geom.elem_index(page, kv_head, slot0 + g) * kB;
#pragma unroll
  for (int j = 0; j < TileShape<F, D>::kKWords / 4; ++j) {
    const uint4 w = ld_stream_v4(krow + (t + 4 * j) * 16);
    pl.k[4 * j] = w.x, pl.k[4 * j + 1] = w.y, pl.k[4 * j + 2] = w.z, pl.k[4 * j + 3] = w.w;
  }
  constexpr int kVW = TileShape<F, D>::kVWords;
  const uint8_t* va = a.v + p.geom.elem_index(page, kv_head, slot0 + 2 * t) * kB + g * (kVW * 4);
  const uint8_t* vb = va + kRow;  // the next slot's row
  if constexpr (kVW == 2) {
    const uint2 x = ld_stream_v2(va), y = ld_stream_v2(vb);
    pl.va[0] = x.x, pl.va[1] = x.y, pl.vb[0] = y.x, pl.vb[1] = y.y;
  } else {
#pragma unroll
    for (int j = 0; j < kVW / 4; ++j) {
      const uint4 x = ld_stream_v4(va + 16 * j), y = ld_stream_v4(vb + 16 * j);
      pl.va[4 * j] = x.x, pl.va[4 * j + 1] = x.y, pl.va[4 * j + 2] = x.z, pl.va[4 * j + 3] = x.w;
      pl.vb[4 * j] = y.x, pl.vb[4 * j + 1] = y.y, pl.vb[4 * j + 2] = y.z, pl.vb[4 * j + 3] = y.w;
    }
  }
  if constexpr (SM == ScaleMode::kToken) {
    const size_t si0 = p.geom.scale_index(page, kv_head, slot0 + 2 * t);
    const size_t si1 = p.geom.scale_index(page, kv_head, slot0 + 2 * t + 1);
    const ScaleDtype sd = p.geom.scale_dtype;
    pl.ks0 = ldg_scale(a.ks, si0, sd);
    pl.ks1 = ldg_scale(a.ks, si1, sd);
    pl.vs0 = ldg_scale(a.vs, si0, sd);
    pl.vs1 = ldg_scale(a.vs, si1, sd);
  }
}

// N consecutive tiles (tile, tile + 1, ...) in one online-softmax step: their QK chains are
// independent (the query fragment is loaded once for all), and the max, rescale and shuffle work is
// paid once per step instead of once per tile. Tiles past the part's end are masked.
// kMask = false: the caller guarantees every token of the N tiles is valid (the bulk kernel's
// whole units), so the validity tests and the V zeroing drop out.
// kPack (N even, at most 4 query heads per CTA): the QK result leaves lanes g >= 4 (heads 4-7) idle,
// so they take the second tile of each pair instead: lanes g < 4 score tile 2v for head g, lanes g + 4
// tile 2v + 1 for the same head, and one set of softmax instructions serves two tiles. The PV
// contraction then needs one mma per pair instead of two: its columns become (head h, high half) for
// n = h < 4 and (head h, low half) for n = h + 4, so a lane's O holds the high-half sums of heads
// 2t, 2t+1 (t < 2) or the low-half sums of heads 2t-4, 2t-3 (t >= 2), added up in merge_and_store.
// State in this layout: m, mv equal in lanes g and g + 4, l split between them (pack_state).
template <Format F, int D, ScaleMode SM, int N, bool kMask = true, bool kPack = false>
__device__ __forceinline__ void compute_tiles(const Payload<F, D>* pl_in, const uint4* qf, const PartArgs& a, int tile,
                                              int lane, State<D>& st) {
  using P = Path<F>;
  static_assert(!kPack || N % 2 == 0, "packed heads score the tiles in pairs");
  constexpr int NV = kPack ? N / 2 : N;  // rows of softmax work per lane
  const int t = lane & 3;
  const bool upper = kPack && lane >= 16;  // packed: this lane scores the pair's second tile
  constexpr float kNegInf = -__builtin_huge_valf();
  bool ok0[N], ok1[N], partial[N];
  float s0[NV], s1[NV], u0[NV], u1[NV];

  // Logits of head g for tokens 2t, 2t+1 of each tile.
  float c[N][4];
#pragma unroll
  for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = P::kInt4 ? a.kbias : 0.f, c[n][2] = c[n][3] = 0.f;
#pragma unroll
  for (int M = 0; M < D / 16; ++M) {
    const uint4 qa = qf[M * 32 + lane];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      uint32_t b0, b1;
      P::k_frag(pl_in[n].k, M, b0, b1);
      if constexpr (P::kBf16Mma) {
        mma_m16n8k16_bf16(c[n], qa, b0, b1);
      } else {
        mma_m16n8k16_f16(c[n], qa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n) {
    if constexpr (kMask) {
      const int nvalid = min(kTileTokens, a.n_tokens - (tile + n) * kTileTokens);
      ok0[n] = 2 * t < nvalid, ok1[n] = 2 * t + 1 < nvalid, partial[n] = nvalid < kTileTokens;
    } else {
      ok0[n] = ok1[n] = true, partial[n] = false;
    }
  }
  float smax = kNegInf, umax = kNegInf;
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    // This lane's tile n and its logits: tile v, or (packed) tile 2v, whose partner lane takes 2v + 1.
    const int n = kPack ? 2 * v : v;
    float x0 = c[n][0] + c[n][2], x1 = c[n][1] + c[n][3];
    bool k0 = ok0[n], k1 = ok1[n];
    const Payload<F, D>* pl = &pl_in[n];
    if constexpr (kPack) {
      const float y0 = __shfl_xor_sync(0xffffffffu, c[n + 1][0] + c[n + 1][2], 16);
      const float y1 = __shfl_xor_sync(0xffffffffu, c[n + 1][1] + c[n + 1][3], 16);
      x0 = upper ? y0 : x0, x1 = upper ? y1 : x1;
      k0 = upper ? ok0[n + 1] : k0, k1 = upper ? ok1[n + 1] : k1;
    }
    float km0 = a.kconst, km1 = a.kconst, lv0 = a.lvconst, lv1 = a.lvconst;
    if constexpr (SM == ScaleMode::kToken) {
      const float ks0 = upper ? pl[1].ks0 : pl->ks0, ks1 = upper ? pl[1].ks1 : pl->ks1;  // upper implies kPack
      const float vs0 = upper ? pl[1].vs0 : pl->vs0, vs1 = upper ? pl[1].vs1 : pl->vs1;
      km0 *= ks0;
      km1 *= ks1;
      lv0 = fast_log2(vs0 * a.lvconst);  // kToken parts pass the V factor itself in lvconst
      lv1 = fast_log2(vs1 * a.lvconst);
    }
    s0[v] = k0 ? x0 * km0 : kNegInf;
    s1[v] = k1 ? x1 * km1 : kNegInf;
    u0[v] = k0 ? s0[v] + lv0 : kNegInf;
    u1[v] = k1 ? s1[v] + lv1 : kNegInf;
    smax = fmaxf(smax, fmaxf(s0[v], s1[v]));
    umax = fmaxf(umax, fmaxf(u0[v], u1[v]));
  }

  // Online softmax: denominator over s, numerator over u = s + log2(v scale). A head's lanes: its
  // four t lanes, and (packed) the same four of g + 4.
  float red_s = warp_max_xor(smax, 2), red_u = warp_max_xor(umax, 2);
  if constexpr (kPack) {
    red_s = fmaxf(red_s, __shfl_xor_sync(0xffffffffu, red_s, 16));
    red_u = fmaxf(red_u, __shfl_xor_sync(0xffffffffu, red_u, 16));
  }
  const float m_new = fmaxf(st.m, red_s);
  const float m_use = m_new == kNegInf ? 0.f : m_new;
  const float alpha = fast_exp2(st.m - m_use);
  float lsum = 0.f;
#pragma unroll
  for (int v = 0; v < NV; ++v) lsum += fast_exp2(s0[v] - m_use) + fast_exp2(s1[v] - m_use);
  st.l = st.l * alpha + lsum;
  st.m = m_new;
  const float mv_new = fmaxf(st.mv, red_u);
  const float mv_use = mv_new == kNegInf ? 0.f : mv_new;
  const float beta = fast_exp2(st.mv - mv_use);
  st.mv = mv_new;

  // Rescale O: its columns 2t, 2t+1 are heads 2t, 2t+1, whose factors live in lanes 8t and 8t + 4
  // (packed: heads (2t) & 3 and (2t + 1) & 3, lanes 8t & 15 and (8t + 4) & 15).
  const int src = kPack ? (8 * t) & 15 : 8 * t;
  const float beta_a = __shfl_sync(0xffffffffu, beta, src);
  const float beta_b = __shfl_sync(0xffffffffu, beta, src + 4);
  if (__any_sync(0xffffffffu, beta_a != 1.f || beta_b != 1.f)) {
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      st.o[jj][0] *= beta_a;
      st.o[jj][1] *= beta_b;
      st.o[jj][2] *= beta_a;
      st.o[jj][3] *= beta_b;
    }
  }

  constexpr int kVW = TileShape<F, D>::kVWords;
  uint32_t p_hi[NV], p_lo[NV];
  uint32_t va[N][kVW], vb[N][kVW];
#pragma unroll
  for (int v = 0; v < NV; ++v)
    split2<P::kBf16Mma>(fast_exp2(u0[v] - mv_use), fast_exp2(u1[v] - mv_use), p_hi[v], p_lo[v]);
#pragma unroll
  for (int n = 0; n < N; ++n) {
    // Unwritten slots of a partial tile may hold anything: floating-point codes can be NaN, which a
    // zero probability does not cancel, so their V is zeroed. Integer codes are finite, and their
    // zero weight (u = -inf above) already removes them.
#pragma unroll
    for (int i = 0; i < kVW; ++i) va[n][i] = pl_in[n].va[i], vb[n][i] = pl_in[n].vb[i];
    if constexpr (!P::kFiniteCodes && kMask) {
      if (partial[n]) {  // warp-uniform: only a part's last tile
#pragma unroll
        for (int i = 0; i < kVW; ++i) va[n][i] = ok0[n] ? va[n][i] : 0u, vb[n][i] = ok1[n] ? vb[n][i] : 0u;
      }
    }
  }
  if constexpr (kPack) {
    // One k = 16 contraction per pair with B column g = (head g & 3, high half if g < 4, else low):
    // each lane hands its partner the half the partner's column needs.
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, upper ? p_hi[v] : p_lo[v], 16);
      const uint32_t b0 = upper ? recv : p_hi[v];  // tile 2v: high half (lower lanes), low half (upper)
      const uint32_t b1 = upper ? p_lo[v] : recv;  // tile 2v + 1
#pragma unroll
      for (int jj = 0; jj < D / 16; ++jj) {
        uint4 av;
        P::v_frag(va[2 * v], vb[2 * v], jj, av.x, av.y);
        P::v_frag(va[2 * v + 1], vb[2 * v + 1], jj, av.z, av.w);
        if constexpr (P::kBf16Mma) {
          mma_m16n8k16_bf16(st.o[jj], av, b0, b1);
        } else {
          mma_m16n8k16_f16(st.o[jj], av, b0, b1);
        }
      }
    }
  } else if constexpr (N % 2 == 0) {
    // Two tiles are one k = 16 contraction: the m16n8k16 A fragment is the two m16n8k8 A fragments
    // side by side (tokens 0-7, then 8-15) and its B fragment the two tiles' probabilities, so a
    // pair costs half the PV mma instructions.
#pragma unroll
    for (int n = 0; n < N; n += 2) {
#pragma unroll
      for (int jj = 0; jj < D / 16; ++jj) {
        uint4 av;
        P::v_frag(va[n], vb[n], jj, av.x, av.y);
        P::v_frag(va[n + 1], vb[n + 1], jj, av.z, av.w);
        if constexpr (P::kBf16Mma) {
          mma_m16n8k16_bf16(st.o[jj], av, p_hi[n], p_hi[n + 1]);
          mma_m16n8k16_bf16(st.o[jj], av, p_lo[n], p_lo[n + 1]);
        } else {
          mma_m16n8k16_f16(st.o[jj], av, p_hi[n], p_hi[n + 1]);
          mma_m16n8k16_f16(st.o[jj], av, p_lo[n], p_lo[n + 1]);
        }
      }
    }
  } else {
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
      for (int jj = 0; jj < D / 16; ++jj) {
        uint32_t a0, a1;
        P::v_frag(va[n], vb[n], jj, a0, a1);
        if constexpr (P::kBf16Mma) {
          mma_m16n8k8_bf16(st.o[jj], a0, a1, p_hi[n]);
          mma_m16n8k8_bf16(st.o[jj], a0, a1, p_lo[n]);
        } else {
          mma_m16n8k8_f16(st.o[jj], a0, a1, p_hi[n]);
          mma_m16n8k8_f16(st.o[jj], a0, a1, p_lo[n]);
        }
      }
    }
  }
}

// The state of the unpacked layout (heads g = 0..7 in lanes g, O columns = heads) in the packed one
// (compute_tiles, kPack): lanes g + 4 take over head g's maxima with an empty sum, and the O columns
// of t >= 2, now low-half sums, start empty. Valid when at most 4 heads are live (the rest padding).
template <int D>
__device__ __forceinline__ void pack_state(State<D>& st, int lane) {
  const bool upper = lane >= 16;
  const float m = __shfl_xor_sync(0xffffffffu, st.m, 16), mv = __shfl_xor_sync(0xffffffffu, st.mv, 16);
  if (upper) st.m = m, st.mv = mv, st.l = 0.f;
  if ((lane & 3) >= 2) {
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) st.o[jj][0] = st.o[jj][1] = st.o[jj][2] = st.o[jj][3] = 0.f;
  }
}

// One part's tiles [tile_begin, tile_end) for this warp: bundles of NT tiles dealt round-robin to
// the warps, the next bundle's loads in flight while the current one is computed, page ids one
// bundle further ahead still.
template <Format F, int D, ScaleMode SM>
__device__ __forceinline__ void run_part(const DecodeParams& p, const PartArgs& a, int kv_head, const uint4* qf, int warp,
                                         int lane, State<D>& st) {
  constexpr int NT = TileShape<F, D>::kNT;
  const int n_tiles = a.tile_end - a.tile_begin;
  if (n_tiles <= 0) return;
  const int n_bundles = (n_tiles + NT - 1) / NT;
  const int tiles_per_page = p.block_size / kTileTokens;
  auto page_of = [&](int tile) { return __ldg(a.table + tile / tiles_per_page); };

  int b = warp;
  if (b >= n_bundles) return;
  Payload<F, D> cur[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int tile = a.tile_begin + b * NT + i;
    if (tile < a.tile_end) {
      load_tile<F, D, SM>(p, a, kv_head, tile, page_of(tile), lane, cur[i]);
    } else {
      cur[i] = Payload<F, D>{};
    }
  }
  if constexpr (TileShape<F, D>::kPrefetch) {
    int next_page[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int tile = a.tile_begin + (b + kDecodeWarps) * NT + i;
      next_page[i] = tile < a.tile_end ? page_of(tile) : 0;
    }
    for (; b < n_bundles; b += kDecodeWarps) {
      Payload<F, D> nxt[NT];
      const int nb = b + kDecodeWarps;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int tile = a.tile_begin + nb * NT + i;
        if (tile < a.tile_end) {
          load_tile<F, D, SM>(p, a, kv_head, tile, next_page[i], lane, nxt[i]);
        } else {
          nxt[i] = Payload<F, D>{};
        }
      }
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int tile = a.tile_begin + (nb + kDecodeWarps) * NT + i;
        next_page[i] = tile < a.tile_end ? page_of(tile) : 0;
      }
#pragma unroll
      for (int i = 0; i < NT; ++i)
        if (a.tile_begin + b * NT + i < a.tile_end) compute_tiles<F, D, SM, 1>(&cur[i], qf, a, a.tile_begin + b * NT + i, lane, st);
#pragma unroll
      for (int i = 0; i < NT; ++i) cur[i] = nxt[i];
    }
  } else {
    for (;;) {
#pragma unroll
      for (int i = 0; i < NT; ++i)
        if (a.tile_begin + b * NT + i < a.tile_end) compute_tiles<F, D, SM, 1>(&cur[i], qf, a, a.tile_begin + b * NT + i, lane, st);
      b += kDecodeWarps;
      if (b >= n_bundles) break;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int tile = a.tile_begin + b * NT + i;
        if (tile < a.tile_end) {
          load_tile<F, D, SM>(p, a, kv_head, tile, page_of(tile), lane, cur[i]);
        } else {
          cur[i] = Payload<F, D>{};
        }
      }
    }
  }
}

// Query fragments of one path: [D/16 mmas][32 lanes] x 4 registers. Lane (g, t), mma M holds head
// g's query at the head dims whose K codes lane t feeds to mma M (Path::k_elem).
template <Format F, int D>
__device__ void build_q_frags(const float* q_rows, int valid_heads, float qscale, uint4* qf, int tid) {
  constexpr bool kBf16 = Path<F>::kBf16Mma;
  for (int idx = tid; idx < (D / 16) * 32; idx += blockDim.x) {
    const int M = idx / 32, ln = idx % 32, g = ln >> 2, t = ln & 3;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (g < valid_heads) {
#pragma unroll
      for (int r = 0; r < 4; ++r) x[r] = q_rows[g * D + Path<F>::template k_elem<D>(M, t, r)] * qscale;
      if constexpr (Path<F>::kInt4) x[2] *= 0.0625f, x[3] *= 0.0625f;  // rows of high nibbles (Path::kInt4KeyUnit)
    }
    uint4 r;
    split2<kBf16>(x[0], x[1], r.x, r.y);
    split2<kBf16>(x[2], x[3], r.z, r.w);
    qf[idx] = r;
  }
}

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

template <int D>
struct DecodeSmem {
  union {
    uint4 qf[2][(D / 16) * 32];                      // main path, sink path
    float o[kDecodeWarps][kMaxGroupPerCta][MergeRows<D>::kRow];  // per-warp O for the final merge (MergeRows;
                                                                  // o[2]: query_staging)
  };
  float m[kDecodeWarps][kMaxGroupPerCta];
  float l[kDecodeWarps][kMaxGroupPerCta];
  float mv[kDecodeWarps][kMaxGroupPerCta];
  unsigned qamax_bits;
  unsigned long long t_start, t_pages0, t_pages1;  // DecodePlan::cta_timeline: kept here, not in registers
  DecodeSmemMarks marks;
};
// DecodePlan::cta_timeline: the CTA's start and, zeroed, the marks that a kernel may leave unset.
template <int D>
__device__ __forceinline__ void start_timeline(const DecodeParams& p, DecodeSmem<D>& sm) {
  if (p.timeline == nullptr || threadIdx.x != 0) return;
  sm.t_start = global_ns();
  sm.t_pages0 = sm.t_pages1 = 0;
  sm.marks = DecodeSmemMarks{};
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
template <int D>
struct QueryLoad {
  static constexpr int kN = kMaxGroupPerCta * D / kDecodeThreads;  // enough for the smallest CTA
  float v[kN];
};
template <int D>
__device__ __forceinline__ QueryLoad<D> load_query(const DecodeParams& p, const CtaWork& place) {
  QueryLoad<D> ql;
  const float* q_rows = p.q + (static_cast<size_t>(place.seq) * p.num_q_heads + place.hq0) * D;
  const int n = place.valid_heads * D;
#pragma unroll
  for (int k = 0; k < QueryLoad<D>::kN; ++k) {
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
template <int D>
__device__ __forceinline__ float* query_staging(DecodeSmem<D>& sm) {
  static_assert(sizeof(sm.qf) <= 2 * sizeof(sm.o[0]) && kDecodeWarps >= 3 && sizeof(sm.o[2]) >= kMaxGroupPerCta * D * 4,
                "the staging rows must fit o[2], clear of qf");
  return &sm.o[2][0][0];
}

// Query fragments for the main path (sm.qf[0]) and the bf16 sink path (sm.qf[1]) from the rows that
// load_query brought; returns the factor that undoes the power-of-two prescale, which keeps fp16
// fragments in range whatever the query's magnitude. Every thread of the CTA must call it (it
// synchronises).
template <Format F, int D>
__device__ float prepare_query(const DecodeParams& p, const CtaWork& w, DecodeSmem<D>& sm, const QueryLoad<D>& ql) {
  const int tid = threadIdx.x;
  float* rows = query_staging(sm);
  if (tid == 0) sm.qamax_bits = 0u;
  __syncthreads();
  float qa = 0.f;
  const int n = w.valid_heads * D;
#pragma unroll
  for (int k = 0; k < QueryLoad<D>::kN; ++k) {
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
template <int D>
__device__ __forceinline__ void run_sink(const DecodeParams& p, const CtaWork& w, const uint4* qf, float unscale,
                                         int warp, int lane, State<D>& st) {
  if (w.sink_t0 >= w.sink_t1) return;
  run_part<Format::kBf16, D, ScaleMode::kNone>(p, sink_args(p, w, unscale), w.kv_head, qf, warp, lane, st);
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

// Merges the kDecodeWarps consumer warps' softmax states through shared memory and stores the
// CTA's rows. Warps >= kDecodeWarps (the bulk kernel's producer) only take part in the barriers.
template <int D, bool kPack = false>
__device__ void merge_and_store(const DecodeParams& p, const CtaWork& w, DecodeSmem<D>& sm, State<D>& st, int warp,
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
  mark_timeline(p, sm.marks.t_warps);
  if (warp < kDecodeWarps) {
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
  // Per head, once: the maximum, the sum and each warp's weight (-1: a warp without tokens), in place of the
  // warps' m, l and mv (thread h alone touches head h's).
  if (threadIdx.x < w.valid_heads) {
    const int h = threadIdx.x;
    float M = kNegInf;
#pragma unroll
    for (int v = 0; v < kDecodeWarps; ++v) M = fmaxf(M, sm.m[v][h]);
    const float M_use = M == kNegInf ? 0.f : M;
    float L = 0.f;
#pragma unroll
    for (int v = 0; v < kDecodeWarps; ++v) {
      L += sm.l[v][h] * exp2f(sm.m[v][h] - M_use);
      const float mvw = sm.mv[v][h];
      sm.mv[v][h] = mvw == kNegInf ? -1.f : exp2f(mvw - M_use);
    }
    sm.m[0][h] = M, sm.l[0][h] = L;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < w.valid_heads * D; idx += blockDim.x) {
    const int h = idx / D, d = idx % D;
    const float M = sm.m[0][h], L = sm.l[0][h];
    float num = 0.f;
#pragma unroll
    for (int v = 0; v < kDecodeWarps; ++v) {
      const float wv = sm.mv[v][h];
      num += wv < 0.f ? 0.f : sm.o[v][h][MergeRows<D>::col(d)] * wv;
    }
    // L == 0 only for an empty split; a NaN from a bad read must reach the output.
    const float res = L == 0.f ? 0.f : num / L;
    const float lse2 = L == 0.f ? kNegInf : M + __log2f(L);
    const size_t row = static_cast<size_t>(w.seq) * p.num_q_heads + w.hq0 + h;
    if (p.num_splits > 1) {
      p.part_out[(row * p.num_splits + w.split) * D + d] = res;
      if (d == 0) p.part_lse[row * p.num_splits + w.split] = lse2;
    } else {
      p.out[row * D + d] = res;
      if (d == 0 && p.lse != nullptr) p.lse[row] = lse2 * kLn2;
    }
  }
}

// The register kernel (bf16/fp16 caches): every warp loads its own tiles with 16-byte loads and
// keeps the next bundle in registers. 16-bit tiles carry 8 tokens in twice the bytes of an 8-bit
// tile, so this path already streams near the bandwidth ceiling (docs/GPU_NOTES.md §4).
template <Format F, int D, ScaleMode SM, int kMinCtas>
__global__ void __launch_bounds__(kDecodeThreads, kMinCtas) decode_kernel(const DecodeParams p) {
  __shared__ DecodeSmem<D> sm;
  start_timeline(p, sm);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const CtaWork place = cta_place(p);
  const QueryLoad<D> ql = load_query<D>(p, place);
  const CtaWork w = cta_work(p, 1, place);
  if (w.empty()) {
    store_empty(p, w, D);
    record_timeline(p, sm.t_start, 0, 0, 0, nullptr);
    return;
  }
  const float unscale = prepare_query<F, D>(p, w, sm, ql);
  State<D> st;
  init_state(st);
  run_sink<D>(p, w, sm.qf[1], unscale, warp, lane, st);
  mark_timeline(p, sm.t_pages0);
  if (w.main_t0 < w.main_t1) run_part<F, D, SM>(p, main_args<SM>(p, w, unscale), w.kv_head, sm.qf[0], warp, lane, st);
  mark_timeline(p, sm.t_pages1);
  pdl_launch_dependents();
  merge_and_store<D>(p, w, sm, st, warp, lane);
  record_timeline(p, sm.t_start, (w.main_t1 - w.main_t0) * kTileTokens / p.block_size, sm.t_pages0, sm.t_pages1,
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
