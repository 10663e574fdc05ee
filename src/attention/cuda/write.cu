// CUDA cache write (see include/kvq/attention/cuda/write.h).
//
// Rows (token, head, K|V) are handled by groups of D/16 lanes, 16 elements per lane, taken as
// 16-byte input chunks spread over the row (bf16: two, fp32: four) so that each load instruction
// of a row's lanes covers whole 32-byte sectors, and likewise each code store.
//   rows kernel:     sink rows, per_token_head, per_tensor and bf16/fp16 rows; the per-row amax
//                    is a shuffle reduction across the row's lanes.
//   segments kernel: per_block_head and its sink rows; one warp per run of consecutive tokens in
//                    one page (a "segment", <= block_size tokens), found by the warp whose window
//                    holds the run's first token, so each page head has exactly one owner per call.
//   per_tensor:      an amax pass over the call's main-pool rows and a one-thread finalize fix
//                    the layer scale first when it is still 0.
#include <algorithm>
#include <string>

#include "kvq/attention/cuda/write.h"
#include "write_codec.cuh"

namespace kvq::attention::cuda {
namespace detail {
namespace {

constexpr int kThreads = 128;

struct WriteParams {
  cache::CacheGeometry geom;  // element and scale addresses (elem_index / scale_index)
  uint8_t* codes[2];
  void* scales[2];  // geom.scale_dtype elements (cache::load_scale / store_scale)
  uint16_t* sink[2];
  float* amax[2];
  const void* in[2];
  const int32_t* slots;
  int n, heads, block_size, bs_log2;
  int granularity;  // ScaleGranularity
  bool quantized;
  unsigned* ws;     // per_tensor: [0..1] amax bits, [2] main rows seen
};

// A lane's 16 input elements as loaded (bf16: two 16-byte loads, fp32: four), unpacked later so
// several rows' loads can be in flight before any arithmetic.
template <bool kFp32>
struct Raw16 {
  uint4 w[kFp32 ? 4 : 2];
};

// A lane's 16 elements are kC chunks of 16/kC (chunk c at element c * D/kC + part * 16/kC), so that
// every load instruction of a row's L lanes reads whole 32-byte sectors (bf16: kC = 2 chunks of
// 8 elements = 16 bytes, fp32: 4 chunks of 4 floats) and every code store writes whole sectors.
template <bool kFp32>
constexpr int kChunks = kFp32 ? 4 : 2;

template <int D, bool kFp32>
__device__ __forceinline__ size_t chunk_elem(int part, int c) {
  constexpr int C = kChunks<kFp32>;
  return static_cast<size_t>(c) * (D / C) + static_cast<size_t>(part) * (16 / C);
}

template <int D, bool kFp32>
__device__ __forceinline__ void load_raw(const void* in, int token, int head, int heads, int part, Raw16<kFp32>& r) {
  const size_t row = (static_cast<size_t>(token) * heads + head) * D;
#pragma unroll
  for (int c = 0; c < kChunks<kFp32>; ++c) {
    const size_t e = row + chunk_elem<D, kFp32>(part, c);
    r.w[c] = kFp32 ? ld_stream_v4(static_cast<const float*>(in) + e) : ld_stream_v4(static_cast<const uint16_t*>(in) + e);
  }
}

// Hides a chunk's value from the compiler, so that rows unpacked for the amax are unpacked again
// for the store (cheap) instead of their 16 floats per row staying live (registers) in between.
template <bool kFp32>
__device__ __forceinline__ void opaque(Raw16<kFp32>& r) {
#pragma unroll
  for (int c = 0; c < (kFp32 ? 4 : 2); ++c) asm volatile("" : "+r"(r.w[c].x), "+r"(r.w[c].y), "+r"(r.w[c].z), "+r"(r.w[c].w));
}

template <bool kFp32>
__device__ __forceinline__ void unpack(const Raw16<kFp32>& r, float (&x)[16]) {
#pragma unroll
  for (int i = 0; i < (kFp32 ? 4 : 2); ++i) {
    const uint32_t w[4] = {r.w[i].x, r.w[i].y, r.w[i].z, r.w[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (kFp32) {
        x[4 * i + j] = __uint_as_float(w[j]);
      } else {
        x[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
        x[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
      }
    }
  }
}

template <int D, bool kFp32>
__device__ __forceinline__ void load16(const void* in, int token, int head, int heads, int part, float (&x)[16]) {
  Raw16<kFp32> r;
  load_raw<D, kFp32>(in, token, head, heads, part, r);
  unpack<kFp32>(r, x);
}

// Max over the `lanes` lanes of an aligned group (lanes divides 32).
__device__ __forceinline__ float group_max(float v, int lanes) {
  for (int o = lanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Stores a lane's 16 values (x in chunk order) at its chunks of row `elem` of a 16-bit plane.
template <Format F, int D, bool kFp32>
__device__ __forceinline__ void store16_chunks(uint16_t* plane, size_t elem, int part, const float (&x)[16]) {
  constexpr int C = kChunks<kFp32>, E = 16 / C;
  uint4 lo, hi;
  store16x16<F>(x, lo, hi);
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int c = 0; c < C; ++c) {
    uint16_t* dst = plane + elem + chunk_elem<D, kFp32>(part, c);
    if constexpr (E == 8) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);
    } else {
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[2 * c], w[2 * c + 1]);
    }
  }
}

// A lane's 16 values of one row, unpacked, and their |x| max with NaN propagating: one test then
// tells whether the lane holds a NaN or inf, which takes the slow path (rare: the policy writes
// such values as 0 and leaves them out of amax).
template <bool kFp32>
struct Lane16 {
  float x[16];
  float m;
  __device__ __forceinline__ explicit Lane16(const Raw16<kFp32>& r) {
    unpack<kFp32>(r, x);
    m = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = abs_max_nan(m, x[i]);
  }
  __device__ __forceinline__ bool finite() const { return m < INFINITY; }
  // The lane's share of the row amax by the policy's rule (amax_term).
  __device__ __forceinline__ float amax() const {
    if (finite()) return m;
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) a = fmaxf(a, amax_term(x[i]));
    return a;
  }
};

// A row into a bf16 plane (the sink, or a bf16 pool). Finite bf16 input is already what
// quantize_row stores (bf16 -> float -> bf16 is exact), so its raw chunks are copied.
template <int D, bool kFp32>
__device__ __forceinline__ void store_bf16_row(uint16_t* plane, size_t elem, int part, const Raw16<kFp32>& raw,
                                               const Lane16<kFp32>& v) {
  if constexpr (!kFp32) {
    if (v.finite()) {
#pragma unroll
      for (int c = 0; c < kChunks<kFp32>; ++c)
        *reinterpret_cast<uint4*>(plane + elem + chunk_elem<D, kFp32>(part, c)) = raw.w[c];
      return;
    }
  }
  store16_chunks<Format::kBf16, D, kFp32>(plane, elem, part, v.x);
}

template <Format F, int D, bool kFp32>
__device__ __forceinline__ void store_main_row(const WriteParams& p, int kv, size_t elem, int part, const Raw16<kFp32>& raw,
                                               const Lane16<kFp32>& v, float scale) {
  if constexpr (F == Format::kBf16) {
    store_bf16_row<D, kFp32>(reinterpret_cast<uint16_t*>(p.codes[kv]), elem, part, raw, v);
  } else if constexpr (F == Format::kFp16) {
    store16_chunks<F, D, kFp32>(reinterpret_cast<uint16_t*>(p.codes[kv]), elem, part, v.x);
  } else {
    const uint4 q = v.finite() ? quantize16<F, true>(v.x, scale) : quantize16<F>(v.x, scale);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    constexpr int C = kChunks<kFp32>;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      uint8_t* dst = p.codes[kv] + elem + chunk_elem<D, kFp32>(part, c);
      if constexpr (C == 2) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[2 * c], w[2 * c + 1]);
      } else {
        *reinterpret_cast<uint32_t*>(dst) = w[c];
      }
    }
  }
}

// cache::slot_page / slot_in_page for the power-of-two block sizes can_implement admits, as shifts
// (a division by the run-time block size costs more per token than a lane's whole row arithmetic).
struct PageSlot {
  int page, slot;
};
__device__ __forceinline__ PageSlot page_slot(int32_t s, int bs_log2) {
  const int32_t u = s < 0 ? -s - 1 : s;
  return {u >> bs_log2, u & ((1 << bs_log2) - 1)};
}

// Tokens per thread and grid step of the rows kernel: all their loads are issued before any is
// used (bf16: 4 x 32 bytes in flight per thread, fp32: 2 x 64).
template <bool kFp32>
constexpr int kRowTokens = kFp32 ? 2 : 4;

// Rows kernel (sink rows, per_token_head, per_tensor, bf16/fp16 pools). Each group of L = D/16
// lanes owns one (K|V, head) column of the rows and walks the tokens with a fixed stride, so
// column, head and input plane are derived once per thread and a token costs one slot load and
// its address arithmetic. Consecutive groups take consecutive heads of one plane, so a warp's
// loads cover 32/L adjacent rows. The trip count is the same for every thread (the amax
// shuffles need the whole warp); groups beyond the last whole column set only take part.
template <Format F, int D, bool kFp32>
__global__ void __launch_bounds__(kThreads) write_rows_kernel(const WriteParams p) {
  // A decode launched after this write as its programmatic dependent (DecodePlan::overlap_previous) may
  // set up its CTAs now; it waits for this grid's completion before it reads anything.
  pdl_launch_dependents();
  constexpr int L = D / 16, kT = kRowTokens<kFp32>;
  const int cols = 2 * p.heads;
  const int g = (blockIdx.x * kThreads + static_cast<int>(threadIdx.x)) / L, part = threadIdx.x % L;
  const int step = gridDim.x * (kThreads / L) / cols;  // >= 1: launch_all sizes the grid for it
  const int col = g % cols, t0 = g / cols;
  const int kv = col / p.heads, head = col % p.heads;
  const bool active = t0 < step;
  const bool per_token = p.quantized && p.granularity == static_cast<int>(ScaleGranularity::kPerTokenHead);
  // per_tensor: set before this kernel (tensor_scale_finalize_kernel) and fixed during it.
  const float fixed_scale = p.quantized && !per_token ? cache::load_scale(p.scales[kv], 0, p.geom.scale_dtype) : 1.f;
  for (int base = 0; base < p.n; base += kT * step) {
    Raw16<kFp32> raw[kT];
    int32_t slot[kT];
    bool live[kT];
#pragma unroll
    for (int k = 0; k < kT; ++k) {
      const int t = base + k * step + t0;
      live[k] = active && t < p.n;
      slot[k] = live[k] ? p.slots[t] : 0;
      if (live[k]) {
        load_raw<D, kFp32>(p.in[kv], t, head, p.heads, part, raw[k]);
      } else {
        raw[k] = Raw16<kFp32>{};
      }
    }
#pragma unroll
    for (int k = 0; k < kT; ++k) {
      const Lane16<kFp32> v(raw[k]);
      float amax = 0.f;
      if (per_token) amax = group_max(v.amax(), L);
      if (!live[k]) continue;
      const PageSlot ps = page_slot(slot[k], p.bs_log2);
      const size_t elem = p.geom.elem_index(ps.page, head, ps.slot);
      if (slot[k] < 0) {
        store_bf16_row<D, kFp32>(p.sink[kv], elem, part, raw[k], v);
        continue;
      }
      if constexpr (F == Format::kBf16 || F == Format::kFp16) {
        store_main_row<F, D, kFp32>(p, kv, elem, part, raw[k], v, 1.f);
      } else {
        float scale = fixed_scale;
        if (per_token) {
          scale = scale_for_amax(F, amax, p.geom.scale_dtype);
          if (part == 0)
            cache::store_scale(p.scales[kv], p.geom.scale_index(ps.page, head, ps.slot), scale, p.geom.scale_dtype);
        }
        store_main_row<F, D, kFp32>(p, kv, elem, part, raw[k], v, scale);
      }
    }
  }
}

// per_tensor: amax over this call's main-pool rows, only while the layer scale is unset.
template <int D, bool kFp32>
__global__ void __launch_bounds__(kThreads) tensor_amax_kernel(const WriteParams p) {
  constexpr int L = D / 16;
  const long long total = static_cast<long long>(p.n) * p.heads * 2 * L;
  float amax[2] = {0.f, 0.f};
  bool any = false;
  const bool need[2] = {quant::tensor_scale_unset(cache::load_scale(p.scales[0], 0, p.geom.scale_dtype)),
                        quant::tensor_scale_unset(cache::load_scale(p.scales[1], 0, p.geom.scale_dtype))};
  if (need[0] || need[1]) {
    for (long long gid = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; gid < total;
         gid += static_cast<long long>(gridDim.x) * kThreads) {
      const long long row = gid / L;
      const int part = static_cast<int>(gid % L), kv = static_cast<int>(row % 2);
      const int head = static_cast<int>((row / 2) % p.heads), token = static_cast<int>(row / 2 / p.heads);
      if (!need[kv] || p.slots[token] < 0) continue;
      any = true;
      float x[16];
      load16<D, kFp32>(p.in[kv], token, head, p.heads, part, x);
#pragma unroll
      for (int i = 0; i < 16; ++i) amax[kv] = fmaxf(amax[kv], amax_term(x[i]));
    }
  }
  for (int kv = 0; kv < 2; ++kv) {
    const float m = group_max(amax[kv], 32);
    if (threadIdx.x % 32 == 0 && m > 0.f) atomicMax(p.ws + kv, __float_as_uint(m));
  }
  if (__any_sync(0xffffffffu, any) && threadIdx.x % 32 == 0) atomicOr(p.ws + 2, 1u);
}

__global__ void tensor_scale_finalize_kernel(const WriteParams p, Format f) {
  if (threadIdx.x != 0 || p.ws[2] == 0u) return;  // no main-pool row in this call: scale stays unset
  for (int kv = 0; kv < 2; ++kv)
    if (quant::tensor_scale_unset(cache::load_scale(p.scales[kv], 0, p.geom.scale_dtype)))
      cache::store_scale(p.scales[kv], 0, scale_for_amax(f, __uint_as_float(p.ws[kv]), p.geom.scale_dtype), p.geom.scale_dtype);
}

// per_block_head (and its sink rows): warp w of a CTA owns the tokens
// [(4 * group + w) * bs, + bs) of one (head, K|V): it writes the sink rows among them and the
// runs of main-pool tokens of one page that start among them (a run ends at the next break, <= bs
// tokens later, possibly past the window). A run's first kChunk rows are loaded once, held in
// registers while the warp reduces the amax, and quantized from there; the rest of a longer run
// (block 32, or D 256 / fp32 rows) is read again (from L2).
template <Format F, int D, bool kFp32>
__global__ void __launch_bounds__(kThreads, 4) write_segments_kernel(const WriteParams p) {
  pdl_launch_dependents();  // as in write_rows_kernel
  constexpr int L = D / 16, kRowsPerPass = 32 / L;
  // Rows in registers per lane: <= 32 registers, so that 4 CTAs (16 warps) fit on an SM without spills.
  constexpr int kMaxPass = std::min(std::max(16 / kRowsPerPass, 1), kFp32 ? 2 : 4);
  constexpr int kChunk = kMaxPass * kRowsPerPass;
  // CTAs in (window group, K|V, head) order, head fastest: neighbouring CTAs read neighbouring rows.
  const int head = blockIdx.x % p.heads, kv = (blockIdx.x / p.heads) % 2, group = blockIdx.x / p.heads / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / L, part = lane % L;
  const int bs = p.block_size;
  const int window0 = (group * 4 + warp) * bs;
  if (window0 >= p.n) return;  // whole warps only
  // Lane l looks at tokens window0 + l and window0 + 32 + l: does a run of main-pool tokens in one
  // page end before it (a sink token, another page, the end of the call)? Runs start at such
  // breaks; a run that starts in the window ends at the next break (<= bs tokens later).
  auto is_break = [&](int i) {
    if (i >= p.n) return true;
    const int32_t s = p.slots[i];
    if (s < 0) return true;
    if (i == 0) return true;
    const int32_t prev = p.slots[i - 1];
    return prev < 0 || (prev >> p.bs_log2) != (s >> p.bs_log2);
  };
  const unsigned lo = __ballot_sync(0xffffffffu, is_break(window0 + lane));
  const unsigned hi = __ballot_sync(0xffffffffu, is_break(window0 + 32 + lane));
  const unsigned long long breaks = (static_cast<unsigned long long>(hi) << 32) | lo;
  const unsigned in_window = bs >= 32 ? 0xffffffffu : (1u << bs) - 1u;
  const unsigned sinks =
      __ballot_sync(0xffffffffu, window0 + lane < p.n && p.slots[min(window0 + lane, p.n - 1)] < 0) & in_window;

  // Sink rows: bf16 copies, no scale; kRowsPerPass of them per pass.
  const int num_sinks = __popc(sinks);
  for (int k = r; k < num_sinks; k += kRowsPerPass) {
    const int i = window0 + static_cast<int>(__fns(sinks, 0, k + 1));
    const PageSlot ps = page_slot(p.slots[i], p.bs_log2);
    Raw16<kFp32> raw;
    load_raw<D, kFp32>(p.in[kv], i, head, p.heads, part, raw);
    store_bf16_row<D, kFp32>(p.sink[kv], p.geom.elem_index(ps.page, head, ps.slot), part, raw, Lane16<kFp32>(raw));
  }

  unsigned starts = static_cast<unsigned>(breaks) & in_window & ~sinks;
  while (starts != 0u) {
    const int c = __ffs(static_cast<int>(starts)) - 1;
    starts &= starts - 1u;
    const int i = window0 + c;
    if (i >= p.n) break;
    const PageSlot ps = page_slot(p.slots[i], p.bs_log2);
    const int page = ps.page, slot0 = ps.slot;
    const unsigned long long later = breaks >> (c + 1);
    const int to_break = later ? __ffsll(static_cast<long long>(later)) : 64 - c;
    const int len = min(min(to_break, bs - slot0), p.n - i);
    // Chunk 0 of the run stays in `raw` until it is stored; later chunks are only reduced here.
    auto load_chunk = [&](int c0, Raw16<kFp32>(&rows)[kMaxPass]) {
#pragma unroll
      for (int q = 0; q < kMaxPass; ++q) {
        const int rr = c0 + r + q * kRowsPerPass;
        if (rr < len) load_raw<D, kFp32>(p.in[kv], i + rr, head, p.heads, part, rows[q]);
      }
    };
    auto chunk_amax = [&](int c0, const Raw16<kFp32>(&rows)[kMaxPass], float m) {
#pragma unroll
      for (int q = 0; q < kMaxPass; ++q)
        if (c0 + r + q * kRowsPerPass < len) m = fmaxf(m, Lane16<kFp32>(rows[q]).amax());
      return m;
    };
    Raw16<kFp32> raw[kMaxPass];
    load_chunk(0, raw);
    float amax = chunk_amax(0, raw, 0.f);
    for (int c0 = kChunk; c0 < len; c0 += kChunk) {
      Raw16<kFp32> more[kMaxPass];
      load_chunk(c0, more);
      amax = chunk_amax(c0, more, amax);
    }
#pragma unroll
    for (int q = 0; q < kMaxPass; ++q) opaque<kFp32>(raw[q]);
    amax = group_max(amax, 32);
    // The amax plane is indexed like the per_block_head scale plane ([page][head]).
    const size_t ph = p.geom.scale_index(page, head, 0);
    float scale;
    float* amax_slot = p.amax[kv] + ph;
    const ScaleDtype sd = p.geom.scale_dtype;
    if (slot0 == 0) {  // a fresh page head
      scale = scale_for_amax(F, amax, sd);
      __syncwarp();
      if (lane == 0) *amax_slot = amax, cache::store_scale(p.scales[kv], ph, scale, sd);
    } else {
      const float old_amax = *amax_slot, old_scale = cache::load_scale(p.scales[kv], ph, sd);
      scale = old_scale;
      if (quant::block_scale_grows(amax, old_amax)) {
        scale = scale_for_amax(F, amax, sd);
        // Re-quantize the page head's earlier slots with the grown scale.
        for (int c0 = 0; c0 < slot0; c0 += kChunk) {
          uint4 codes[kMaxPass];
#pragma unroll
          for (int q = 0; q < kMaxPass; ++q) {
            const int rr = c0 + r + q * kRowsPerPass;
            if (rr < slot0) codes[q] = *reinterpret_cast<const uint4*>(p.codes[kv] + p.geom.elem_index(page, head, rr) + part * 16);
          }
#pragma unroll
          for (int q = 0; q < kMaxPass; ++q) {
            const int rr = c0 + r + q * kRowsPerPass;
            if (rr < slot0) {
              const uint32_t w[4] = {codes[q].x, codes[q].y, codes[q].z, codes[q].w};
              float x[16];
#pragma unroll
              for (int e = 0; e < 16; ++e) x[e] = dequant1<F>((w[e / 4] >> (8 * (e % 4))) & 0xffu, old_scale);
              *reinterpret_cast<uint4*>(p.codes[kv] + p.geom.elem_index(page, head, rr) + part * 16) = quantize16<F>(x, scale);
            }
          }
        }
        __syncwarp();
        if (lane == 0) *amax_slot = amax, cache::store_scale(p.scales[kv], ph, scale, sd);
      }
    }
    for (int c0 = 0; c0 < len; c0 += kChunk) {
      if (c0 > 0) load_chunk(c0, raw);  // chunk 0 is still in registers
#pragma unroll
      for (int q = 0; q < kMaxPass; ++q) {
        const int rr = c0 + r + q * kRowsPerPass;
        if (rr < len)
          store_main_row<F, D, kFp32>(p, kv, p.geom.elem_index(page, head, slot0 + rr), part, raw[q], Lane16<kFp32>(raw[q]), scale);
      }
    }
  }
}

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      return 132;
    }
    return v;
  }();
  return n;
}

// CTAs of `Kernel` that fit on one SM (queried once per kernel).
template <auto Kernel>
int ctas_per_sm() {
  static const int n = [] {
    int v = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, kThreads, 0) != cudaSuccess || v < 1) {
      cudaGetLastError();
      return 4;
    }
    return v;
  }();
  return n;
}

template <Format F, int D, bool kFp32>
Status launch_all(const WriteParams& p, cudaStream_t stream, bool per_tensor, bool per_block, Format f) {
  if (per_block) {
    if constexpr (F != Format::kBf16 && F != Format::kFp16) {
      const long long groups = (p.n + 4LL * p.block_size - 1) / (4LL * p.block_size);
      write_segments_kernel<F, D, kFp32><<<static_cast<unsigned>(groups * p.heads * 2), kThreads, 0, stream>>>(p);
      return launch_status("cuda write: page-head kernel");
    }
  }
  constexpr int L = D / 16, kGroups = kThreads / L;
  const long long cols = 2LL * p.heads;
  // Enough CTAs that every thread has kRowTokens tokens, at most one wave (then each thread walks
  // several steps), and at least one token column for every (K|V, head).
  const long long want = (static_cast<long long>(p.n) * cols + kGroups * kRowTokens<kFp32> - 1) / (kGroups * kRowTokens<kFp32>);
  const long long wave = static_cast<long long>(sm_count()) * ctas_per_sm<write_rows_kernel<F, D, kFp32>>();
  const long long least = (cols + kGroups - 1) / kGroups;
  const int blocks = static_cast<int>(std::max(std::min(want, wave), least));
  if (per_tensor) {
    KVQ_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(p.ws, 0, 3 * sizeof(unsigned), stream), "cuda write: workspace reset"));
    tensor_amax_kernel<D, kFp32><<<std::min(blocks, 4096), kThreads, 0, stream>>>(p);
    KVQ_RETURN_IF_ERROR(launch_status("cuda write: tensor amax kernel"));
    tensor_scale_finalize_kernel<<<1, 32, 0, stream>>>(p, f);
    KVQ_RETURN_IF_ERROR(launch_status("cuda write: tensor scale kernel"));
  }
  write_rows_kernel<F, D, kFp32><<<blocks, kThreads, 0, stream>>>(p);
  return launch_status("cuda write: rows kernel");
}

template <Format F, int D>
Status launch_input(const WriteParams& p, bool fp32, cudaStream_t s, bool pt, bool pb, Format f) {
  return fp32 ? launch_all<F, D, true>(p, s, pt, pb, f) : launch_all<F, D, false>(p, s, pt, pb, f);
}

template <Format F>
Status launch_format(const WriteParams& p, int d, bool fp32, cudaStream_t s, bool pt, bool pb, Format f) {
  switch (d) {
    case 64: return launch_input<F, 64>(p, fp32, s, pt, pb, f);
    case 128: return launch_input<F, 128>(p, fp32, s, pt, pb, f);
    default: return launch_input<F, 256>(p, fp32, s, pt, pb, f);
  }
}

}  // namespace
}  // namespace detail

Status can_implement(const WriteArgs& a) {
  const cache::CacheGeometry& g = a.geom;
  const std::string d = std::to_string(g.head_dim);
  if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256)
    return unsupported("cuda write: head_dim " + d + " is not supported; the CUDA kernels take 64, 128 or 256");
  if (g.block_size != 16 && g.block_size != 32)
    return unsupported("cuda write: block_size " + std::to_string(g.block_size) + " is not supported; use 16 or 32");
  if (!format_traits(g.format).device_ready || format_bits(g.format) < 8)
    return unsupported(std::string("cuda write: ") + format_name(g.format) +
                       " caches are not written by these kernels (whole-byte codes only; the CUDA backend writes int4 "
                       "through its generic kernels)");
  if (g.num_kv_heads < 1) return invalid_argument("cuda write: geometry has no kv heads");
  if (a.num_tokens < 0) return invalid_argument("cuda write: num_tokens is negative");
  if (a.num_tokens == 0) return Status::ok();
  if (a.k == nullptr || a.v == nullptr || a.slot_mapping == nullptr)
    return invalid_argument("cuda write: k, v and slot_mapping must be device pointers, got null");
  const auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; };
  if (misaligned(a.k) || misaligned(a.v)) return invalid_argument("cuda write: k and v rows must be 16-byte aligned");
  if (a.layer.k_codes == nullptr || a.layer.v_codes == nullptr) return invalid_argument("cuda write: the layer's code planes are null");
  if (g.has_scales() && (a.layer.k_scales == nullptr || a.layer.v_scales == nullptr))
    return invalid_argument(std::string("cuda write: format ") + format_name(g.format) + " needs scale planes, but they are null");
  if (g.has_scales() && g.granularity == ScaleGranularity::kPerBlockHead && (a.k_block_amax == nullptr || a.v_block_amax == nullptr))
    return invalid_argument("cuda write: per_block_head needs the k/v block amax planes (DeviceLayer::k_block_amax)");
  return Status::ok();
}

size_t workspace_size(const WriteArgs& a) {
  return a.geom.has_scales() && a.geom.granularity == ScaleGranularity::kPerTensor ? 256 : 0;
}

Status run(const WriteArgs& a, void* workspace, CUstream_st* stream) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  if (a.num_tokens == 0) return Status::ok();
  const cache::CacheGeometry& g = a.geom;
  const bool per_tensor = g.has_scales() && g.granularity == ScaleGranularity::kPerTensor;
  const bool per_block = g.has_scales() && g.granularity == ScaleGranularity::kPerBlockHead;
  if (per_tensor && workspace == nullptr) return invalid_argument("cuda write: per_tensor needs workspace_size() bytes of workspace");
  detail::WriteParams p{};
  p.geom = g;
  p.codes[0] = a.layer.k_codes, p.codes[1] = a.layer.v_codes;
  p.scales[0] = a.layer.k_scales, p.scales[1] = a.layer.v_scales;
  p.sink[0] = a.layer.k_sink, p.sink[1] = a.layer.v_sink;
  p.amax[0] = a.k_block_amax, p.amax[1] = a.v_block_amax;
  p.in[0] = a.k, p.in[1] = a.v;
  p.slots = a.slot_mapping;
  p.n = a.num_tokens, p.heads = g.num_kv_heads, p.block_size = g.block_size;
  p.bs_log2 = g.block_size == 32 ? 5 : 4;  // can_implement admits 16 and 32
  p.granularity = static_cast<int>(g.granularity);
  p.quantized = g.has_scales();
  p.ws = static_cast<unsigned*>(workspace);
  const bool fp32 = a.input == InputType::kFp32;
  const cudaStream_t s = stream;
  switch (g.format) {
    case Format::kBf16: return detail::launch_format<Format::kBf16>(p, g.head_dim, fp32, s, false, false, g.format);
    case Format::kFp16: return detail::launch_format<Format::kFp16>(p, g.head_dim, fp32, s, false, false, g.format);
    case Format::kFp8E4m3: return detail::launch_format<Format::kFp8E4m3>(p, g.head_dim, fp32, s, per_tensor, per_block, g.format);
    case Format::kFp8E4m3Fnuz:
      return detail::launch_format<Format::kFp8E4m3Fnuz>(p, g.head_dim, fp32, s, per_tensor, per_block, g.format);
    case Format::kInt8: return detail::launch_format<Format::kInt8>(p, g.head_dim, fp32, s, per_tensor, per_block, g.format);
    default: return unsupported("cuda write: unsupported format");
  }
}

}  // namespace kvq::attention::cuda

// ---- encoder self-check ----------------------------------------------------------------------------------

namespace kvq::attention::cuda {
namespace detail {
namespace {

template <Format F>
__global__ void encoder_sweep_kernel(unsigned long long* mismatches) {
  unsigned long long bad = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x * 4;
  for (uint64_t base = (blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x) * 4; base < (1ull << 32);
       base += stride) {
    float x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = __uint_as_float(static_cast<uint32_t>(base + i));
      if (x[i] != x[i]) x[i] = 0.f;
    }
    const uint32_t got = encode4<F>(x[0], x[1], x[2], x[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) bad += ((got >> (8 * i)) & 0xffu) != encode_byte(F, x[i]);
  }
  if (bad) atomicAdd(mismatches, bad);
}

// Random (x, s) pairs: s as the writer makes it (amax / qmax with amax spread over 2^-30..2^30),
// x over +-2^-40..2^40 relative to amax; counts quotients that differ from __fdiv_rn.
__global__ void division_sweep_kernel(uint64_t samples, unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < samples;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    uint64_t r = (i + 1) * 0x9e3779b97f4a7c15ull;
    r ^= r >> 31;
    r *= 0xbf58476d1ce4e5b9ull;
    r ^= r >> 29;
    const float amax = __uint_as_float(0x3f800000u | static_cast<uint32_t>(r & 0x7fffffu)) *
                       exp2f(static_cast<float>(static_cast<int>((r >> 23) % 61) - 30));
    const float qmax = (r >> 40) & 1 ? 448.f : ((r >> 41) & 1 ? 224.f : 127.f);
    const float s = scale_for_amax(Format::kFp8E4m3, amax * 448.f / qmax);
    const float x = __uint_as_float((static_cast<uint32_t>(r >> 42) & 0x807fffffu) | 0x3f800000u) * amax *
                    exp2f(-static_cast<float>((r >> 32) % 41));
    const float want = __fdiv_rn(x, s), got = div_by_scale(x, s, __frcp_rn(s));
    if (fabsf(want) < 1048576.f && fabsf(want) >= 1.f / 1048576.f && __float_as_uint(want) != __float_as_uint(got)) ++bad;
  }
  if (bad) atomicAdd(mismatches, bad);
}

}  // namespace
}  // namespace detail

Result<uint64_t> count_division_mismatches(uint64_t samples) {
  unsigned long long* d = nullptr;
  KVQ_RETURN_IF_ERROR(detail::cuda_status(cudaMalloc(&d, sizeof(*d)), "division check: cudaMalloc"));
  cudaMemset(d, 0, sizeof(*d));
  detail::division_sweep_kernel<<<2048, 256>>>(samples, d);
  unsigned long long h = 0;
  const Status launched = detail::launch_status("division check kernel");
  const Status copied = launched.is_ok() ? detail::cuda_status(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost),
                                                               "division check: copy")
                                         : launched;
  cudaFree(d);
  if (!copied.is_ok()) return copied;
  return static_cast<uint64_t>(h);
}

Result<uint64_t> count_encoder_mismatches(Format f) {
  unsigned long long* d = nullptr;
  KVQ_RETURN_IF_ERROR(detail::cuda_status(cudaMalloc(&d, sizeof(*d)), "encoder check: cudaMalloc"));
  cudaMemset(d, 0, sizeof(*d));
  switch (f) {
    case Format::kFp8E4m3: detail::encoder_sweep_kernel<Format::kFp8E4m3><<<2048, 256>>>(d); break;
    case Format::kFp8E4m3Fnuz: detail::encoder_sweep_kernel<Format::kFp8E4m3Fnuz><<<2048, 256>>>(d); break;
    case Format::kInt8: detail::encoder_sweep_kernel<Format::kInt8><<<2048, 256>>>(d); break;
    default: cudaFree(d); return invalid_argument("encoder check: only fp8_e4m3, fp8_e4m3_fnuz and int8 have device encoders");
  }
  unsigned long long h = 0;
  const Status launched = detail::launch_status("encoder check kernel");
  const Status copied = launched.is_ok() ? detail::cuda_status(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost),
                                                               "encoder check: copy")
                                         : launched;
  cudaFree(d);
  if (!copied.is_ok()) return copied;
  return static_cast<uint64_t>(h);
}

}  // namespace kvq::attention::cuda
