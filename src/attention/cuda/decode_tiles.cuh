#pragma once
// The decode kernels' tiles (see include/kvq/attention/cuda/decode.h for the contract). Layout of the work:
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

// Attending warps per CTA (the kernels' template parameter W): four, and eight at head dim 256 for 16-bit
// and 8-bit caches, whose plans put one or two CTAs on an SM, so that four warps per CTA left the SM too
// few warps to hide a tile's latency: eight took 0.83-0.98x of the time there on five D256 shapes at block
// 16 (0.95-1.00x at 32), while at head dim 64 and 128 (four CTAs per SM) they lost up to 20%, and int4 at
// 256 gained or lost by shape (docs/GPU_NOTES.md §24).
KVQ_HD constexpr int decode_warps(int bits, int head_dim) { return head_dim == 256 && bits >= 8 ? 8 : 4; }
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
  int ring_stages;    // bulk kernel: pages in flight per CTA (a multiple of the attending warps, <= kMaxStages)
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
// c_start: thread 0's SM clock (clock64) at the CTA's start, against which the end's gives the SM's clock
// rate over the CTA (words 11-12; a replay that runs slow at a lower clock is then told from one that waits).
struct DecodeSmemMarks {
  unsigned long long t_work, t_primed, t_query, t_item0, t_warps, c_start;
  unsigned long long t_rows, t_heads;  // merge_and_store: the warps' rows written, the heads' weights known
};
// kTL: the kernel instance that writes the timeline (DecodeKernelFn: instances apart from the product's,
// whose marks, though guarded by a run-time test, cost int4 up to 12% (H200) and spilled registers:
// docs/GPU_NOTES.md §28); every timeline function is empty without it.
template <bool kTL>
__device__ __forceinline__ void record_timeline(const DecodeParams& p, unsigned long long t0, int pages,
                                                unsigned long long t_pages0, unsigned long long t_pages1,
                                                const DecodeSmemMarks* marks) {
  if (!kTL || p.timeline == nullptr || threadIdx.x != 0) return;  // t0: thread 0's start time (DecodeSmem::t_start)
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
  row[11] = mk.c_start, row[12] = mk.c_start != 0 ? static_cast<unsigned long long>(clock64()) : 0ull;
  row[13] = mk.t_rows, row[14] = mk.t_heads;
}
template <bool kTL>
__device__ __forceinline__ void mark_timeline(const DecodeParams& p, unsigned long long& t) {
  if (kTL && p.timeline != nullptr && threadIdx.x == 0) t = global_ns();
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
// the W attending warps, the next bundle's loads in flight while the current one is computed, page ids one
// bundle further ahead still.
template <Format F, int D, ScaleMode SM, int W>
__device__ __forceinline__ void run_part(const DecodeParams& p, const PartArgs& a, int kv_head, const uint4* qf, int warp,
                                         int lane, State<D>& st) {
  constexpr int NT = TileShape<F, D>::kNT;
  const int n_tiles = a.tile_end - a.tile_begin;
  if (n_tiles <= 0) return;
  const int n_bundles = (n_tiles + NT - 1) / NT;
  const int tiles_per_page = p.block_size / kTileTokens;
  auto page_of = [&](int tile) { return __ldg(a.table + tile / tiles_per_page); };

  // Bundle `bundle`'s tiles into dst (empty payloads past the part's end), their pages from page_for(i, tile).
  auto load_bundle = [&](int bundle, Payload<F, D>* dst, auto page_for) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int tile = a.tile_begin + bundle * NT + i;
      if (tile < a.tile_end) {
        load_tile<F, D, SM>(p, a, kv_head, tile, page_for(i, tile), lane, dst[i]);
      } else {
        dst[i] = Payload<F, D>{};
      }
    }
  };
  auto table_page = [&](int, int tile) { return page_of(tile); };
  int b = warp;
  if (b >= n_bundles) return;
  Payload<F, D> cur[NT];
  auto compute_bundle = [&](int bundle) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
      if (a.tile_begin + bundle * NT + i < a.tile_end)
        compute_tiles<F, D, SM, 1>(&cur[i], qf, a, a.tile_begin + bundle * NT + i, lane, st);
  };
  load_bundle(b, cur, table_page);
  if constexpr (TileShape<F, D>::kPrefetch) {
    int next_page[NT];
    auto fetch_pages = [&](int bundle) {
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int tile = a.tile_begin + bundle * NT + i;
        next_page[i] = tile < a.tile_end ? page_of(tile) : 0;
      }
    };
    fetch_pages(b + W);
    for (; b < n_bundles; b += W) {
      Payload<F, D> nxt[NT];
      load_bundle(b + W, nxt, [&](int i, int) { return next_page[i]; });
      fetch_pages(b + 2 * W);
      compute_bundle(b);
#pragma unroll
      for (int i = 0; i < NT; ++i) cur[i] = nxt[i];
    }
  } else {
    for (;;) {
      compute_bundle(b);
      b += W;
      if (b >= n_bundles) break;
      load_bundle(b, cur, table_page);
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

}  // namespace kvq::attention::cuda::detail
