#pragma once
// The decode kernel of the quantized caches (fp8 OCP/FNUZ, int8, int4) and of 16-bit caches at head
// dim 64 and 128: whole page-head tiles are streamed into a shared-memory ring with cp.async.bulk and
// W warps attend them from there (decode_warps: four, eight at head dim 256 for 8-bit pages). int4 is
// the same kernel with half the bytes per tile: the warps unpack nibbles into the same fp16 fragments
// (Path<kInt4>), so numerics and scale handling are the 8-bit ones; bf16/fp16 tiles go to the mma as loaded (the register kernel's fragments, read from
// shared memory instead of global memory).
//
// Why (docs/GPU_NOTES.md §5, §9, §13): with per-lane loads an 8-bit tile is half the bytes of a
// bf16 tile for the same per-tile work, and the bytes a warp can keep in flight were capped by its
// registers (or, with per-lane cp.async, each sector was fetched twice). The K tile and the V tile
// of one (page, kv head) are contiguous in the pool (block_size x head_dim codes each), and so are
// its per-token scales, so one thread can request a whole page with four bulk copies; the ring
// keeps up to kMaxStages pages per CTA in flight at no register cost.
//
// The split's pages i = 0, 1, ... are dealt to the W attending warps round robin (warp i % W),
// page i in stage s = i % S, phase (i / S) & 1; S is a multiple of W, so a stage always serves the
// same warp. Who refills a stage is the kernel's Feed (chosen per plan, decode.cu):
//   kSelf      the attending warp itself: after reading page i, it requests page i + S into the
//              same stage (no extra warp, so one more CTA per SM at head_dim 128: the better
//              choice when many CTAs share the SMs)
//   kProducer  a fifth warp: waits on the stage's "empty" barrier (the attending warp's 32 lanes
//              arrive after their reads), then requests the next page; it spends the request
//              latency instead of the attending warp (better when a plan has few CTAs, each a long
//              chain of pages)
// The bf16 sink's tiles go through the ring too, ahead of the pages (SinkItems): the CTA's items are its
// sink tiles, then its units, dealt to the attending warps round robin like the units.
// Either way a request is arrive.expect_tx(full[s]) and the page's copies, made by the whole warp
// with warp-uniform operands and issued by one elected lane (request_unit), and the attending warp
// waits on full[s]. Numerics are the register kernel's: the warps build the same fragments
// (Payload) from shared memory and run the same compute_tiles, two tiles per softmax step.
#include <type_traits>

#include "decode_cta.cuh"

namespace kvq::attention::cuda::detail {

enum class Feed : int { kSelf, kProducer };
template <Feed FD, int W>
constexpr int bulk_threads() {
  return (W + (FD == Feed::kProducer ? 1 : 0)) * 32;
}
constexpr int kMaxStages = 16;
constexpr int kRingOffset = 512;  // full and empty barriers (2 x kMaxStages x 8 B), page ids, then the ring

// Bytes of one stage: K tile, V tile, K scales, V scales, each 16-byte aligned. Per-block scales
// copy the 16-byte chunk that holds the page's scale (the plane is 128-byte aligned and padded).
// cp.async.bulk wants 16-byte sizes and addresses: a page head's per-token run is block_size (16 or
// 32) scales of 4 or 2 bytes, i.e. 32..128 bytes starting at a multiple of its own size.
KVQ_HD int bulk_scale_bytes(const cache::CacheGeometry& g) {
  if (!g.has_scales()) return 0;
  if (g.granularity == ScaleGranularity::kPerTokenHead) return g.block_size * static_cast<int>(g.scale_bytes());
  if (g.granularity == ScaleGranularity::kPerBlockHead) return 16;
  return 0;
}
KVQ_HD int bulk_tile_bytes(const cache::CacheGeometry& g) {
  return g.block_size * static_cast<int>(g.row_code_bytes());  // one (page, kv head) tile of K or V codes
}
KVQ_HD int bulk_stage_bytes(const cache::CacheGeometry& g) {
  const int tile = bulk_tile_bytes(g);
  return static_cast<int>(cache::align_up(static_cast<size_t>(2 * tile + 2 * bulk_scale_bytes(g)), 128));
}

// A lane's byte offsets within a page slot of the ring (its K piece, V row and scale pair in tile 0),
// fixed for the CTA: computed once, so a tile's addresses are a warp-uniform offset plus these instead of
// the lane's row recomputed for every tile (int4 0.6-2% faster, docs/GPU_NOTES.md §19).
struct SmemLane {
  uint32_t k, v;  // K piece t of token g; V row 2t at lane g's dims (the row 2t + 1 follows at + kRow)
  uint32_t ks;    // per_token_head: the K scale of token 2t; per_block_head: the K scale chunk
  uint32_t vs;    // per_token_head: the V scale of token 2t; per_block_head: unused
};
template <Format F, int D, ScaleDtype SD, bool PT>
__device__ __forceinline__ SmemLane smem_lane(int bs, int lane) {
  constexpr int kKW = TileShape<F, D>::kKWords, kVW = TileShape<F, D>::kVWords;
  constexpr int kRow = D * Path<F>::kBits / 8;  // bytes of one token's codes
  constexpr int kPiece = kKW == 2 ? 8 : 16;
  constexpr int kScale = SD == ScaleDtype::kFp16 ? 2 : 4;
  const int g = lane >> 2, t = lane & 3;
  SmemLane ln;
  ln.k = static_cast<uint32_t>(g * kRow + t * kPiece);
  ln.v = static_cast<uint32_t>(bs * kRow + 2 * t * kRow + g * (kVW * 4));
  const uint32_t scales = static_cast<uint32_t>(2 * bs * kRow);  // K scale run (or chunk), then the V one
  ln.ks = PT ? scales + static_cast<uint32_t>(2 * t * kScale) : scales;
  ln.vs = ln.ks + static_cast<uint32_t>(bs * kScale);
  return ln;
}

// PT: per_token_head scale runs (else per_block_head: one scale per page, at scale_sub of its chunk).
// `page`: the page's slot in the ring stage; tile_in_page: which 8 tokens of it.
template <Format F, int D, ScaleMode SM, ScaleDtype SD, bool PT>
__device__ __forceinline__ void load_tile_smem(const uint8_t* page, int tile_in_page, const SmemLane& ln, int scale_sub,
                                               Payload<F, D>& pl) {
  constexpr int kKW = TileShape<F, D>::kKWords, kVW = TileShape<F, D>::kVWords;
  constexpr int kRow = D * Path<F>::kBits / 8;  // bytes of one token's codes
  const uint8_t* codes = page + tile_in_page * (kTileTokens * kRow);  // warp-uniform
  const uint8_t* krow = codes + ln.k;
  // Pieces t, t+4, ... of the row (Path::k_elem): 16 bytes, or the lane's whole 8-byte share (int4 D64).
  if constexpr (kKW == 2) {
    const uint2 w = *reinterpret_cast<const uint2*>(krow);
    pl.k[0] = w.x, pl.k[1] = w.y;
  } else {
#pragma unroll
    for (int j = 0; j < kKW / 4; ++j) {
      const uint4 w = *reinterpret_cast<const uint4*>(krow + j * 64);
      pl.k[4 * j] = w.x, pl.k[4 * j + 1] = w.y, pl.k[4 * j + 2] = w.z, pl.k[4 * j + 3] = w.w;
    }
  }
  const uint8_t* va = codes + ln.v;
  const uint8_t* vb = va + kRow;
  if constexpr (kVW == 1) {
    pl.va[0] = *reinterpret_cast<const uint32_t*>(va), pl.vb[0] = *reinterpret_cast<const uint32_t*>(vb);
  } else if constexpr (kVW == 2) {
    const uint2 x = *reinterpret_cast<const uint2*>(va), y = *reinterpret_cast<const uint2*>(vb);
    pl.va[0] = x.x, pl.va[1] = x.y, pl.vb[0] = y.x, pl.vb[1] = y.y;
  } else {
#pragma unroll
    for (int j = 0; j < kVW / 4; ++j) {
      const uint4 x = *reinterpret_cast<const uint4*>(va + 16 * j), y = *reinterpret_cast<const uint4*>(vb + 16 * j);
      pl.va[4 * j] = x.x, pl.va[4 * j + 1] = x.y, pl.va[4 * j + 2] = x.z, pl.va[4 * j + 3] = x.w;
      pl.vb[4 * j] = y.x, pl.vb[4 * j + 1] = y.y, pl.vb[4 * j + 2] = y.z, pl.vb[4 * j + 3] = y.w;
    }
  }
  if constexpr (SM == ScaleMode::kToken) {
    if constexpr (PT) {
      // Slots slot0 + 2t and + 1: adjacent in the run, one 8-byte (fp32) or 4-byte (fp16) read each.
      constexpr int kScale = SD == ScaleDtype::kFp16 ? 2 : 4;
      const uint8_t* sc = page + tile_in_page * (kTileTokens * kScale);  // warp-uniform
      if constexpr (SD == ScaleDtype::kFp16) {
        const float2 k = __half22float2(*reinterpret_cast<const __half2*>(sc + ln.ks));
        const float2 v = __half22float2(*reinterpret_cast<const __half2*>(sc + ln.vs));
        pl.ks0 = k.x, pl.ks1 = k.y, pl.vs0 = v.x, pl.vs1 = v.y;
      } else {
        const float2 k = *reinterpret_cast<const float2*>(sc + ln.ks);
        const float2 v = *reinterpret_cast<const float2*>(sc + ln.vs);
        pl.ks0 = k.x, pl.ks1 = k.y, pl.vs0 = v.x, pl.vs1 = v.y;
      }
    } else {
      // The page's scale at scale_sub of its 16-byte chunk; the V chunk follows the K chunk.
      constexpr int kChunk = SD == ScaleDtype::kFp16 ? 8 : 4;
      const uint8_t* ks = page + ln.ks;
      pl.ks0 = pl.ks1 = cache::load_scale<SD>(ks, scale_sub);
      pl.vs0 = pl.vs1 = cache::load_scale<SD>(ks, kChunk + scale_sub);
    }
  }
}

// Where the pages of this CTA's kv head come from, reduced once per CTA to a few constants: the
// geometry's index functions per page cost 64-bit multiplies and, through the format's traits, a
// table load and a switch on the refill path (docs/GPU_NOTES.md §16).
struct RingAddr {
  uint32_t tile;          // bytes of one K or V tile (bulk_tile_bytes)
  uint32_t sbytes;        // bytes of one scale copy (bulk_scale_bytes; 0 without per-page scales)
  uint32_t code_page;     // code bytes of one page (every kv head; < 2^32 since a kernel's kv heads <= 65535)
  uint32_t code_head;     // this kv head's tile within its page
  uint32_t scale_unit;    // per_token_head: bytes of a page head's scale run; per_block_head: of a scale
  uint32_t scale_bytes;   // 4 (fp32) or 2 (fp16)
  uint32_t page_slot;     // bytes of one page in a stage (bulk_stage_bytes)
  int nkv, head;
  int ppu_log;            // log2 of the pages per stage (ring_pages_per_stage: 1 or 2)
  int tpp_log;            // log2 of the tiles per page (2 or 4)
  bool per_token;         // per_token_head (runs), else per_block_head (the 16-byte chunk of the scale)
};
template <Format F, int D, ScaleMode SM>
__device__ __forceinline__ RingAddr ring_addr(const DecodeParams& p, int kv_head) {
  constexpr size_t kRow = D * Path<F>::kBits / 8;
  RingAddr r;
  r.tile = static_cast<uint32_t>(p.block_size * kRow);
  r.code_page = r.tile * static_cast<uint32_t>(p.num_kv_heads);
  r.code_head = r.tile * static_cast<uint32_t>(kv_head);
  r.nkv = p.num_kv_heads, r.head = kv_head;
  r.page_slot = static_cast<uint32_t>(bulk_stage_bytes(p.geom));
  r.ppu_log = ring_pages_per_stage(Path<F>::kBits, D, p.block_size) == 2 ? 1 : 0;
  r.tpp_log = p.block_size == 32 ? 2 : 1;
  r.sbytes = 0, r.scale_unit = 0, r.scale_bytes = 4, r.per_token = true;
  if constexpr (SM == ScaleMode::kToken) {
    r.sbytes = static_cast<uint32_t>(bulk_scale_bytes(p.geom));
    r.scale_bytes = static_cast<uint32_t>(p.geom.scale_bytes());
    r.per_token = p.geom.granularity == ScaleGranularity::kPerTokenHead;
    r.scale_unit = r.per_token ? static_cast<uint32_t>(p.block_size) * r.scale_bytes : r.scale_bytes;
  }
  return r;
}

// Byte offsets of page `page`'s K/V tiles in the code planes and of its scale runs in the scale planes
// (per_block_head: the 16-byte chunk that holds the page head's scale, 4 fp32 or 8 fp16).
struct PageSource {
  size_t codes, scales;
};
template <ScaleMode SM>
__device__ __forceinline__ PageSource page_source(const RingAddr& r, int page) {
  PageSource src;
  src.codes = static_cast<size_t>(static_cast<uint32_t>(page)) * r.code_page + r.code_head;
  src.scales = 0;
  if constexpr (SM == ScaleMode::kToken) {
    const size_t b = (static_cast<size_t>(static_cast<uint32_t>(page)) * r.nkv + r.head) * r.scale_unit;
    src.scales = r.per_token ? b : b & ~static_cast<size_t>(15);
  }
  return src;
}
// per_block_head: the page head's scale within its 16-byte chunk; -1 for per-token runs.
__device__ __forceinline__ int scale_sub(const RingAddr& r, int page) {
  if (r.per_token) return -1;
  return static_cast<int>((((static_cast<size_t>(page) * r.nkv + r.head) * r.scale_bytes) & 15) / r.scale_bytes);
}

// Requests page `page` (K tile, V tile, then the K and V scale runs) into the page slot at shared
// address `slot`, completing on the barrier at `bar` (whose expected bytes the caller set). The whole
// warp calls it (converged, warp-uniform operands: warp_uniform) and one elected lane issues the copies.
template <ScaleMode SM, L2Policy L2>
__device__ __forceinline__ void request_page(const DecodeParams& p, const RingAddr& r, int page, uint32_t slot,
                                             uint32_t bar) {
  const PageSource src = page_source<SM>(r, page);
  warp_bulk_copy_g2s<L2>(slot, p.k_codes + src.codes, r.tile, bar);
  warp_bulk_copy_g2s<L2>(slot + r.tile, p.v_codes + src.codes, r.tile, bar);
  if constexpr (SM == ScaleMode::kToken) {
    warp_bulk_copy_g2s<L2>(slot + 2 * r.tile, static_cast<const uint8_t*>(p.k_scales) + src.scales, r.sbytes, bar);
    warp_bulk_copy_g2s<L2>(slot + 2 * r.tile + r.sbytes, static_cast<const uint8_t*>(p.v_scales) + src.scales, r.sbytes, bar);
  }
}
// Requests a unit's pages (page1 < 0: the unit has one page) into the stage at `stage`; the whole warp calls it.
template <ScaleMode SM, L2Policy L2>
__device__ __forceinline__ void request_unit(const DecodeParams& p, const RingAddr& r, int page0, int page1,
                                             uint32_t stage, uint32_t bar) {
  const uint32_t page_bytes = 2 * r.tile + 2 * r.sbytes;
  warp_mbar_arrive_expect_tx(bar, page1 >= 0 ? 2 * page_bytes : page_bytes);
  request_page<SM, L2>(p, r, page0, stage, bar);
  if (page1 >= 0) request_page<SM, L2>(p, r, page1, stage + r.page_slot, bar);
}

// Units: a ring stage holds 2^ppu_log consecutive pages of the split (ring_pages_per_stage), one
// softmax step's tiles. The split's units u = 0, 1, ... are dealt to the attending warps round robin;
// this warp's are u = warp + W k, k < count. Their page ids come 32 at a time, one per
// lane: lane l holds page (l & (ppu - 1)) of the window's unit l >> ppu_log, -1 past the split's end.
template <int W>
struct WarpUnits {
  const int32_t* table;  // the split's first page in the sequence's block table
  int n_pages, count, ppu_log;
  __device__ int window(int warp, int k0, int lane) const {
    const int k = k0 + (lane >> ppu_log);
    const int i = ((warp + W * k) << ppu_log) + (lane & ((1 << ppu_log) - 1));
    return k < count && i < n_pages ? __ldg(table + i) : -1;
  }
};
// Window entry of page j of the window's unit k (a lane index).
__device__ __forceinline__ int window_entry(int k, int j, int ppu_log) { return (k << ppu_log) + j; }

// The split's first page in the sequence's block table.
__device__ __forceinline__ const int32_t* split_table(const DecodeParams& p, const CtaWork& w) {
  return p.block_tables + static_cast<size_t>(w.seq) * p.max_blocks + w.first_page;
}
__device__ __forceinline__ int split_units(const CtaWork& w, const RingAddr& ra) {
  return (w.main_pages + (1 << ra.ppu_log) - 1) >> ra.ppu_log;
}

template <int W>
__device__ __forceinline__ WarpUnits<W> warp_units(const DecodeParams& p, const CtaWork& w, const RingAddr& ra, int warp) {
  const int n_units = split_units(w, ra);
  WarpUnits<W> wu;
  wu.table = split_table(p, w);
  wu.n_pages = w.main_pages;
  wu.ppu_log = ra.ppu_log;
  wu.count = warp < n_units ? (n_units - 1 - warp) / W + 1 : 0;
  return wu;
}

// Split unit u, in `stage` (page ids in ids[0..1], read for per-block scales only): its tiles through
// compute_tiles, kRingStepTiles per softmax step. a.n_tokens is the split's end in tokens: a unit
// that ends before it (all but the part's or split's last) takes the unmasked step; in the last, tiles
// past the end are masked (a second page past the split's end was not requested: its slot holds
// whatever it held, which the mask removes, V zeroed for floating-point codes).
template <Format F, int D, ScaleMode SM, ScaleDtype SD, bool PT, bool kPack>
__device__ __forceinline__ void attend_unit(const DecodeParams& p, const CtaWork& w, const RingAddr& ra, const PartArgs& a,
                                            const uint4* qf, const uint8_t* stage, const int* ids, int u,
                                            const SmemLane& ln, int lane, State<D>& st) {
  constexpr int N = TileShape<F, D>::kRingStepTiles;
  const int unit_tiles = 1 << (ra.tpp_log + ra.ppu_log);
  const int tile0 = (w.first_page + (u << ra.ppu_log)) << ra.tpp_log;
  auto steps = [&](auto masked) {
    constexpr bool kMask = decltype(masked)::value;
    for (int kt = 0; kt < unit_tiles; kt += N) {
      if (kMask && (tile0 + kt) * kTileTokens >= a.n_tokens) break;
      Payload<F, D> pl[N];
#pragma unroll
      for (int n = 0; n < N; ++n) {
        const int j = kt + n, pj = j >> ra.tpp_log;
        int sub = -1;
        if constexpr (SM == ScaleMode::kToken && !PT) sub = detail::scale_sub(ra, ids[pj]);
        load_tile_smem<F, D, SM, SD, PT>(stage + pj * ra.page_slot, j & ((1 << ra.tpp_log) - 1), ln, sub, pl[n]);
      }
      compute_tiles<F, D, SM, N, kMask, kPack>(pl, qf, a, tile0 + kt, lane, st);
    }
  };
  if ((tile0 + unit_tiles) * kTileTokens <= a.n_tokens) {
    steps(std::false_type{});
  } else {
    steps(std::true_type{});
  }
}

// A warp-uniform value as the compiler can see it: lane 0's copy (a shuffle from a run-time lane is
// uniform too, but only a constant source lane tells the compiler so). Addresses computed from it stay in
// uniform registers, which the bulk copies take directly (docs/GPU_NOTES.md §19).
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// ---- the sink through the ring --------------------------------------------------------------------

// The bf16 sink tiles of the CTA go through the same ring as its pages, ahead of them: an attending warp's
// items are its sink tiles (the CTA's sink tiles dealt round robin, tile t0 + warp + W j), then its units. On the
// register path the sink was a chain of dependent loads queued behind the whole grid's first ring pages,
// with the ring full and idle meanwhile: 9-31 us before the first page (docs/GPU_NOTES.md §21). A tile
// (8 tokens: its K rows, then its V rows, 2 x 16 D bytes) fits a stage of every 8- and 4-bit ring but
// int4's at head dim 256, which keeps the register path (DecodePlan::sink_in_ring).
template <int W>
struct SinkItems {
  int n = 0;      // the CTA's sink tiles in the ring (0: none, or its sink is on the register path)
  int count = 0;  // this attending warp's share of them
  int ids = -1;   // lane j: the page of the warp's j-th sink tile (Feed::kSelf)
  int t0 = 0;     // the CTA's first sink tile
  __device__ int tile(int j, int warp) const { return t0 + warp + W * j; }
};
// At most 32 tiles per warp (one page id per lane); a CTA with more sink tiles takes the register path.
template <int W>
__device__ __forceinline__ bool sink_through_ring(const DecodeParams& p, const CtaWork& w) {
  return p.sink_in_ring != 0 && w.sink_t1 - w.sink_t0 <= 32 * W;
}
__device__ __forceinline__ int sink_page_of(const DecodeParams& p, const CtaWork& w, int tile) {
  return __ldg(p.sink_tables + static_cast<size_t>(w.seq) * p.max_sink_blocks + tile / (p.block_size / kTileTokens));
}
template <int W>
__device__ __forceinline__ SinkItems<W> sink_items(const DecodeParams& p, const CtaWork& w, int warp, int lane,
                                                   bool self_fed) {
  SinkItems<W> sk;
  sk.n = w.sink_t1 - w.sink_t0;
  sk.t0 = w.sink_t0;
  if (warp >= W) return sk;  // the producer warp (produce() reads the ids itself)
  sk.count = warp < sk.n ? (sk.n - 1 - warp) / W + 1 : 0;
  if (self_fed && lane < sk.count) sk.ids = sink_page_of(p, w, sk.tile(lane, warp));
  return sk;
}
// Requests sink tile `tile` (on page `page`) into the stage at `stage`; the whole warp calls it with
// warp-uniform operands.
template <int D, L2Policy L2>
__device__ __forceinline__ void request_sink_tile(const DecodeParams& p, const CtaWork& w, int page, int tile,
                                                  uint32_t stage, uint32_t bar) {
  constexpr uint32_t kBytes = kTileTokens * D * 2;
  const int tpp = p.block_size / kTileTokens;
  const size_t off = p.geom.elem_index(page, w.kv_head, (tile % tpp) * kTileTokens) * 2;
  warp_mbar_arrive_expect_tx(bar, 2 * kBytes);
  warp_bulk_copy_g2s<L2>(stage, p.k_sink + off, kBytes, bar);
  warp_bulk_copy_g2s<L2>(stage + kBytes, p.v_sink + off, kBytes, bar);
}
// The warp's j-th sink tile (Feed::kSelf: page ids from SinkItems::ids).
template <int D, int W, L2Policy L2>
__device__ __forceinline__ void request_warp_sink_tile(const DecodeParams& p, const CtaWork& w, const SinkItems<W>& sk,
                                                       int j, int warp, uint32_t stage, uint32_t bar) {
  request_sink_tile<D, L2>(p, w, warp_uniform(__shfl_sync(0xffffffffu, sk.ids, j)), sk.tile(j, warp), stage, bar);
}
// Sink tile `tile` from its stage (K rows at 0, V rows after them): the register path's numerics.
template <int D>
__device__ __forceinline__ void attend_sink_tile(const uint8_t* stage, const PartArgs& sa, int tile, const SmemLane& ln,
                                                 const uint4* qf_sink, int lane, State<D>& st) {
  Payload<Format::kBf16, D> pl;
  load_tile_smem<Format::kBf16, D, ScaleMode::kNone, ScaleDtype::kFp32, true>(stage, 0, ln, -1, pl);
  compute_tiles<Format::kBf16, D, ScaleMode::kNone, 1>(&pl, qf_sink, sa, tile, lane, st);
}
// The warp's main unit k (< the first window's units, page ids in ids0) into stage s.
template <ScaleMode SM, L2Policy L2>
__device__ __forceinline__ void request_main_unit(const DecodeParams& p, const RingAddr& ra, int ids0, int k,
                                                  int* page_ids, int s, uint32_t ring, uint32_t full, int lane) {
  const int page0 = warp_uniform(__shfl_sync(0xffffffffu, ids0, window_entry(k, 0, ra.ppu_log)));
  const int page1 =
      ra.ppu_log ? warp_uniform(__shfl_sync(0xffffffffu, ids0, window_entry(k, 1, ra.ppu_log))) : -1;
  if (lane == 0) page_ids[2 * s] = page0, page_ids[2 * s + 1] = page1;
  __syncwarp();  // the ids before the barrier's arrival, which the elected lane makes
  request_unit<SM, L2>(p, ra, page0, page1, ring + s * p.stage_bytes, full + 8 * s);
}

// DecodePlan::cta_timeline: when warp 0's first ring item (in stage `bar`, phase 0) has arrived; `items`: the
// warp's items (none: no wait). Waiting on a completed phase again returns at once, so the consumer's own
// wait that follows is unchanged.
template <bool kTL>
__device__ __forceinline__ void mark_first_item(const DecodeParams& p, int items, uint32_t bar, unsigned long long& t) {
  if (!kTL || p.timeline == nullptr || threadIdx.x >= 32 || items <= 0) return;
  mbar_wait(bar, 0);
  mark_timeline<kTL>(p, t);
}

// ---- Feed::kSelf ----------------------------------------------------------------------------------

// The warp's first S / W items (sink tiles, then units), requested by the warp before the query is
// prepared, which they overlap.
template <Format F, int D, ScaleMode SM, int W, L2Policy L2>
__device__ void prime_ring(const DecodeParams& p, const CtaWork& w, const RingAddr& ra, const SinkItems<W>& sk,
                           uint32_t full, int* page_ids, uint32_t ring, int warp, int lane) {
  const WarpUnits<W> wu = warp_units<W>(p, w, ra, warp);
  const int R = p.ring_stages / W;
  const int ids = wu.window(warp, 0, lane);  // R <= 4 units in one load, not R loads in a row
  for (int i = 0; i < R; ++i) {
    const int s = warp + W * i;
    if (i < sk.count) {
      request_warp_sink_tile<D, W, L2>(p, w, sk, i, warp, ring + s * p.stage_bytes, full + 8 * s);
    } else if (i - sk.count < wu.count) {
      request_main_unit<SM, L2>(p, ra, ids, i - sk.count, page_ids, s, ring, full, lane);
    }
  }
}

// sa / qf_sink: the sink's arguments and query fragments (sink items only); t_sink_done: the timeline's
// mark after them.
template <Format F, int D, ScaleMode SM, ScaleDtype SD, bool PT, bool kPack, bool kTL, int W, L2Policy L2>
__device__ void consume_self_fed(const DecodeParams& p, const CtaWork& w, const RingAddr& ra, const PartArgs& a,
                                 const uint4* qf, const SinkItems<W>& sk, const PartArgs& sa, const uint4* qf_sink,
                                 uint32_t full, int* page_ids, uint8_t* ring, int warp, int lane, State<D>& st,
                                 unsigned long long& t_sink_done, unsigned long long& t_item0) {
  const int S = p.ring_stages, R = S / W;
  const WarpUnits<W> wu = warp_units<W>(p, w, ra, warp);
  const uint32_t ring_s = smem_u32(ring);
  const int per = 32 >> ra.ppu_log;  // units per window
  // The warp's i-th item (its sink tiles, then its units) is in stage warp + W (i % R), phase (i / R) & 1:
  // stepped, never divided (a division by the run-time S sat on the path from page to page).
  int s = warp;
  uint32_t phase = 0;
  mark_first_item<kTL>(p, sk.count + wu.count, full + 8 * s, t_item0);
  if (sk.count > 0) {
    const SmemLane ln16 = smem_lane<Format::kBf16, D, ScaleDtype::kFp32, true>(kTileTokens, lane);
    const int ids0 = wu.window(warp, 0, lane);  // the units this phase requests are the first R < per
    for (int j = 0; j < sk.count; ++j) {
      mbar_wait(full + 8 * s, phase);
      const uint32_t stage_off = static_cast<uint32_t>(s) * p.stage_bytes;
      attend_sink_tile<D>(ring + stage_off, sa, sk.tile(j, warp), ln16, qf_sink, lane, st);
      fence_proxy_async_smem();  // the reads above before the copy engine overwrites the stage
      __syncwarp();
      const int i = j + R;  // the item this stage takes next
      if (i < sk.count) {
        request_warp_sink_tile<D, W, L2>(p, w, sk, i, warp, ring_s + stage_off, full + 8 * s);
      } else if (i - sk.count < wu.count) {
        request_main_unit<SM, L2>(p, ra, ids0, i - sk.count, page_ids, s, ring_s, full, lane);
      }
      s += W;
      if (s >= S) s -= S, phase ^= 1u;
    }
  }
  mark_timeline<kTL>(p, t_sink_done);
  if constexpr (kPack) pack_state(st, lane);
  const SmemLane ln = smem_lane<F, D, SD, PT>(p.block_size, lane);
  // Table entries of the refills k + R, a window at a time and one window ahead: a table load on the
  // path from a stage's release to its refill would add a memory latency per unit.
  int kb = R, ids = wu.window(warp, kb, lane), ids_next = wu.window(warp, kb + per, lane);
  for (int k = 0; k < wu.count; ++k) {
    if (k + R == kb + per) {
      kb += per, ids = ids_next;
      ids_next = wu.window(warp, kb + per, lane);
    }
    const bool refill = k + R < wu.count;
    const int page0 = warp_uniform(__shfl_sync(0xffffffffu, ids, window_entry(k + R - kb, 0, ra.ppu_log)));
    const int page1 = ra.ppu_log ? warp_uniform(__shfl_sync(0xffffffffu, ids, window_entry(k + R - kb, 1, ra.ppu_log))) : -1;
    mbar_wait(full + 8 * s, phase);
    const uint32_t stage_off = static_cast<uint32_t>(s) * p.stage_bytes;
    attend_unit<F, D, SM, SD, PT, kPack>(p, w, ra, a, qf, ring + stage_off, page_ids + 2 * s, warp + W * k, ln,
                                         lane, st);
    // Every lane's reads of the stage (their values are consumed above) before the copy engine
    // overwrites it.
    fence_proxy_async_smem();
    __syncwarp();
    if (refill) {  // warp-uniform: the whole warp requests, one elected lane issues
      if constexpr (SM == ScaleMode::kToken && !PT) {
        if (lane == 0) page_ids[2 * s] = page0, page_ids[2 * s + 1] = page1;
        __syncwarp();  // the ids before the barrier's arrival, which the elected lane makes
      }
      request_unit<SM, L2>(p, ra, page0, page1, ring_s + stage_off, full + 8 * s);
    }
    s += W;
    if (s >= S) s -= S, phase ^= 1u;
  }
}

// ---- Feed::kProducer ------------------------------------------------------------------------------

// The producer warp: page ids 32 at a time (one per lane), the units requested in order.
template <Format F, int D, ScaleMode SM, int W, L2Policy L2>
__device__ void produce(const DecodeParams& p, const CtaWork& w, const RingAddr& ra, const SinkItems<W>& sk, uint32_t full,
                        uint32_t empty, int* page_ids, uint32_t ring, int lane) {
  const int n_pages = w.main_pages, ppu = 1 << ra.ppu_log;
  const int32_t* table = split_table(p, w);
  const int S = p.ring_stages;
  int s = 0, use = 0;  // item i (sink tiles, then units): stage i % S, use i / S, stepped
  for (int base = 0; base < sk.n; base += 32) {
    const int mine = base + lane < sk.n ? sink_page_of(p, w, sk.t0 + base + lane) : -1;
    for (int j = 0; j < min(32, sk.n - base); ++j) {
      const int page = warp_uniform(__shfl_sync(0xffffffffu, mine, j));
      if (use > 0) mbar_wait(empty + 8 * s, (use - 1) & 1);
      request_sink_tile<D, L2>(p, w, page, sk.t0 + base + j, ring + s * p.stage_bytes, full + 8 * s);
      if (++s == S) s = 0, ++use;
    }
  }
  for (int base = 0; base < n_pages; base += 32) {
    const int mine = base + lane < n_pages ? __ldg(table + base + lane) : -1;
    const int n = min(32, n_pages - base);
    for (int j = 0; j < n; j += ppu) {  // 32 is a whole number of units
      const int page0 = warp_uniform(__shfl_sync(0xffffffffu, mine, j));
      const int page1 = ppu == 2 ? warp_uniform(__shfl_sync(0xffffffffu, mine, j + 1)) : -1;
      if (use > 0) mbar_wait(empty + 8 * s, (use - 1) & 1);
      if (lane == 0) page_ids[2 * s] = page0, page_ids[2 * s + 1] = page1;
      __syncwarp();  // the ids before the barrier's arrival, which the elected lane makes
      request_unit<SM, L2>(p, ra, page0, page1, ring + s * p.stage_bytes, full + 8 * s);
      if (++s == S) s = 0, ++use;
    }
  }
}

template <Format F, int D, ScaleMode SM, ScaleDtype SD, bool PT, bool kPack, bool kTL, int W>
__device__ void consume_produced(const DecodeParams& p, const CtaWork& w, const RingAddr& ra, const PartArgs& a,
                                 const uint4* qf, uint32_t full, uint32_t empty, const int* page_ids,
                                 const uint8_t* ring, int warp, int lane, State<D>& st, const SinkItems<W>& sk,
                                 const PartArgs& sa, const uint4* qf_sink, unsigned long long& t_sink_done,
                                 unsigned long long& t_item0) {
  const int S = p.ring_stages, n_units = split_units(w, ra);
  int s = warp;
  uint32_t phase = 0;
  mark_first_item<kTL>(p, sk.n + n_units > warp ? 1 : 0, full + 8 * s, t_item0);
  // The warp's items are i = warp + W j: sink tiles while i < sk.n, then unit i - sk.n.
  if (sk.count > 0) {
    const SmemLane ln16 = smem_lane<Format::kBf16, D, ScaleDtype::kFp32, true>(kTileTokens, lane);
    for (int j = 0; j < sk.count; ++j) {
      mbar_wait(full + 8 * s, phase);
      attend_sink_tile<D>(ring + static_cast<size_t>(s) * p.stage_bytes, sa, sk.tile(j, warp), ln16, qf_sink, lane, st);
      mbar_arrive(empty + 8 * s);
      s += W;
      if (s >= S) s -= S, phase ^= 1u;
    }
  }
  mark_timeline<kTL>(p, t_sink_done);
  if constexpr (kPack) pack_state(st, lane);
  const SmemLane ln = smem_lane<F, D, SD, PT>(p.block_size, lane);
  for (int u = warp + W * sk.count - sk.n; u < n_units; u += W) {
    mbar_wait(full + 8 * s, phase);
    attend_unit<F, D, SM, SD, PT, kPack>(p, w, ra, a, qf, ring + static_cast<size_t>(s) * p.stage_bytes, page_ids + 2 * s,
                                         u, ln, lane, st);
    mbar_arrive(empty + 8 * s);  // every lane: each releases its own reads of the stage
    s += W;
    if (s >= S) s -= S, phase ^= 1u;
  }
}

// ---- the kernel -----------------------------------------------------------------------------------

// kPack: at most 4 query heads per CTA, tiles scored in pairs (compute_tiles); the sink is attended in
// the unpacked layout first and the state converted (pack_state).
// kTL: the timeline instance (record_timeline). L2: the ring copies' L2 policy (DecodePlan::l2_evict_first).
template <Format F, int D, ScaleMode SM, int kMinCtas, Feed FD, bool kPack, bool kTL, L2Policy L2 = L2Policy::kNormal>
__global__ void __launch_bounds__(bulk_threads<FD, decode_warps(Path<F>::kBits, D)>(), kMinCtas)
    decode_bulk_kernel(const DecodeParams p) {
  constexpr int W = decode_warps(Path<F>::kBits, D);
  __shared__ DecodeSmem<D, W> sm;
  extern __shared__ __align__(128) uint8_t dyn[];
  uint64_t* full = reinterpret_cast<uint64_t*>(dyn);
  uint64_t* empty = full + kMaxStages;
  int* page_ids = reinterpret_cast<int*>(empty + kMaxStages);  // two per stage
  uint8_t* ring = dyn + kRingOffset;
  // Shared-window addresses of the barriers and the ring, converted once (the page loop passes them on).
  const uint32_t full_s = smem_u32(full), empty_s = smem_u32(empty), ring_s = smem_u32(ring);

  // Launched as a programmatic dependent of the kernel before it (DecodePlan::overlap_previous: the engine's
  // cache write), the CTAs are resident and their shared memory set up while that kernel runs; nothing is
  // read before it has finished and its memory is visible. A no-op for a plain launch.
  pdl_wait_primary();
  start_timeline<kTL>(p, sm);
  // The warp index through a shuffle of lane 0's: the compiler then knows it is warp-uniform, and so are
  // the ring stages, barriers and page addresses derived from it, which the bulk copies take in uniform
  // registers: computed there once, not in every lane and moved over per copy (docs/GPU_NOTES.md §19).
  const int warp = warp_uniform(static_cast<int>(threadIdx.x / 32)), lane = threadIdx.x % 32;
  const CtaWork place = cta_place(p);
  const QueryLoad<D, W> ql = load_query<D, W>(p, place);
  const CtaWork w = cta_work(p, p.block_size / kTileTokens, place);
  if (w.empty()) {
    store_empty(p, w, D);
    record_timeline<kTL>(p, sm.t_start, 0, 0, 0, nullptr);
    return;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.ring_stages; ++s) {
      mbar_init(&full[s], 1);
      if constexpr (FD == Feed::kProducer) mbar_init(&empty[s], 32);
    }
    mbar_init_fence();
  }
  __syncthreads();
  mark_timeline<kTL>(p, sm.marks.t_work);
  const bool producer = FD == Feed::kProducer && warp == W;
  const RingAddr ra = ring_addr<F, D, SM>(p, w.kv_head);
  // The ring fills (its first items: the sink's tiles, then pages) while the query, loaded at the start, is
  // turned into fragments.
  SinkItems<W> sk;
  const bool sink_ring = sink_through_ring<W>(p, w);
  if (sink_ring) sk = sink_items<W>(p, w, warp, lane, FD == Feed::kSelf);
  if constexpr (FD == Feed::kSelf) {
    prime_ring<F, D, SM, W, L2>(p, w, ra, sk, full_s, page_ids, ring_s, warp, lane);
    mark_timeline<kTL>(p, sm.marks.t_primed);
  }
  const float unscale = prepare_query<F, D>(p, w, sm, ql);
  mark_timeline<kTL>(p, sm.marks.t_query);
  State<D> st;
  init_state(st);
  if (producer) {
    if constexpr (FD == Feed::kProducer) produce<F, D, SM, W, L2>(p, w, ra, sk, full_s, empty_s, page_ids, ring_s, lane);
  } else {
    if (!sink_ring) run_sink<D, W>(p, w, sm.qf[1], unscale, warp, lane, st);  // else: ring items (consume_self_fed)
    const PartArgs sa = sink_args(p, w, unscale);
    PartArgs a = main_args<SM>(p, w, unscale);
    if constexpr (Path<F>::kInt4) {  // the K codes' offset and unit (Path::kInt4KeyUnit)
      a.kconst *= 1.f / Path<F>::kInt4KeyUnit;
      a.kbias = int4_key_bias<D>(sm.qf[0], lane);
    }
    a.n_tokens = min(a.n_tokens, w.main_t1 * kTileTokens);  // the split's end (attend_unit)
    // One branch on the scale dtype and layout here instead of one per scale read in the page loop.
    bool half_scales = false, per_token = true;
    if constexpr (SM == ScaleMode::kToken) {
      half_scales = p.geom.scale_dtype == ScaleDtype::kFp16;
      per_token = p.geom.granularity == ScaleGranularity::kPerTokenHead;
    }
    auto consume = [&](auto sd, auto pt) {
      constexpr ScaleDtype SD = decltype(sd)::value;
      constexpr bool PT = decltype(pt)::value;
      if constexpr (FD == Feed::kSelf) {
        consume_self_fed<F, D, SM, SD, PT, kPack, kTL, W, L2>(p, w, ra, a, sm.qf[0], sk, sa, sm.qf[1], full_s, page_ids, ring, warp,
                                                  lane, st, sm.t_pages0, sm.marks.t_item0);
      } else {
        consume_produced<F, D, SM, SD, PT, kPack, kTL, W>(p, w, ra, a, sm.qf[0], full_s, empty_s, page_ids, ring, warp, lane, st,
                                                  sk, sa, sm.qf[1], sm.t_pages0, sm.marks.t_item0);
      }
    };
    using Fp16 = std::integral_constant<ScaleDtype, ScaleDtype::kFp16>;
    using Fp32 = std::integral_constant<ScaleDtype, ScaleDtype::kFp32>;
    using Runs = std::true_type;
    using Chunk = std::false_type;
    if constexpr (SM == ScaleMode::kToken) {
      if (half_scales) {
        per_token ? consume(Fp16{}, Runs{}) : consume(Fp16{}, Chunk{});
      } else {
        per_token ? consume(Fp32{}, Runs{}) : consume(Fp32{}, Chunk{});
      }
    } else {
      consume(Fp32{}, Runs{});
    }
    mark_timeline<kTL>(p, sm.t_pages1);
  }
  pdl_launch_dependents();
  merge_and_store<D, W, kPack, kTL>(p, w, sm, st, warp, lane);
  record_timeline<kTL>(p, sm.t_start, w.main_pages, sm.t_pages0, sm.t_pages1, &sm.marks);
}

}  // namespace kvq::attention::cuda::detail
