#pragma once
// Device primitives shared by the CUDA attention kernels: tensor-core mma wrappers, code -> fp16
// pair conversions, streaming loads and small helpers. Fragment layouts are PTX's for
// mma.m16n8k16 / m16n8k8 (g = lane / 4, t = lane % 4):
//   A (16 x k): reg0 (row g, cols 2t..2t+1), reg1 (row g+8, same cols), [k16: reg2/reg3 cols +8]
//   B (k x 8):  reg0 (rows 2t..2t+1, col g), [k16: reg1 rows +8]
//   C (16 x 8): c0/c1 (row g, cols 2t, 2t+1), c2/c3 (row g+8, same cols)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kvq/common/status.h"

namespace kvq::attention::cuda::detail {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// A launch error (bad configuration, no kernel image for this GPU) shows at the launch itself.
inline Status launch_status(const char* kernel) { return cuda_status(cudaGetLastError(), kernel); }

// ---- mma -----------------------------------------------------------------------------------------

__device__ __forceinline__ void mma_m16n8k16_f16(float c[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_m16n8k16_bf16(float c[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_m16n8k8_f16(float c[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b));
}
__device__ __forceinline__ void mma_m16n8k8_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b));
}

// ---- loads ---------------------------------------------------------------------------------------

// K/V bytes are read exactly once: keep them out of L1.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ld_stream_v2(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// ---- bulk copies and mbarriers (sm_90) -------------------------------------------------------------
// One thread moves a whole contiguous tile global -> shared with cp.async.bulk; the copy engine
// reports the bytes on an mbarrier (transaction count), so consumers wait on the barrier's phase.

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// Makes initialised barriers visible to the copy engine (async proxy) before first use.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// The operations below take shared-window addresses (smem_u32 of a barrier or a ring slot), which a
// page loop converts once instead of on every use.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits until the barrier has completed the phase of parity `parity`.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// Orders this thread's earlier generic-proxy accesses of shared memory (plain loads of a ring stage)
// before later async-proxy ones (a bulk copy refilling that stage).
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// A bulk copy of `bytes` from global to shared memory completing on the barrier at `bar` (dst, src and
// bytes multiples of 16), and the barrier's arrival that expects `bytes`. The whole converged warp calls
// them with warp-uniform operands and one lane (elect.sync) issues each: the copy then takes its operands
// from uniform registers as they are. Called from one lane (`if (lane == 0)`), every copy sat in a loop
// over the active lanes that moved its operands there (docs/GPU_NOTES.md §19).
// L2Policy::kEvictFirst: the copy's lines carry an L2 evict_first policy, so bytes read once per decode step
// leave L2 before lines that other CTAs still read (DecodePlan::l2_evict_first; docs/GPU_NOTES.md §31-§33). A
// template parameter, not a run-time choice: a branch per copy added 2-10% instructions to int4's kernels (§32).
enum class L2Policy { kNormal, kEvictFirst };
template <L2Policy L2 = L2Policy::kNormal>
__device__ __forceinline__ void warp_bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  if constexpr (L2 == L2Policy::kEvictFirst) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t.reg .b64 pol;\n\telect.sync _|p, 0xffffffff;\n\t"
        "createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n\t"
        "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], pol;\n\t}\n" ::"r"(dst),
        "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(bar)
        : "memory");
  } else {
    asm volatile(
        "{\n\t.reg .pred p;\n\telect.sync _|p, 0xffffffff;\n\t"
        "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n\t}\n" ::"r"(dst),
        "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(bar)
        : "memory");
  }
}
__device__ __forceinline__ void warp_mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n\t.reg .pred p;\n\telect.sync _|p, 0xffffffff;\n\t"
      "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n\t}\n" ::"r"(bar), "r"(bytes)
      : "memory");
}

// Programmatic dependent launch (sm_90): a kernel launched after this one with the programmatic
// stream-serialization attribute (the split merge) may be scheduled once every CTA of this grid has
// called pdl_launch_dependents, so its launch overlaps this grid's tail; it calls pdl_wait_primary
// before reading anything this grid wrote, which waits for this grid's completion and its memory. Both
// are no-ops for a grid launched without the attribute.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_wait_primary() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// ---- packing -------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) { return __byte_perm(a, b, sel); }

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_half2(uint32_t u) {
  __half2 h = *reinterpret_cast<__half2*>(&u);
  return __half22float2(h);
}
__device__ __forceinline__ float2 unpack_bf162(uint32_t u) {
  __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&u);
  return __bfloat1622float2(h);
}

// x = hi + lo with hi, lo in the mma input type: ~22 (fp16) or ~16 (bf16) significant bits.
template <bool kBf16>
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  if constexpr (kBf16) {
    hi = pack_bf162(x0, x1);
    const float2 h = unpack_bf162(hi);
    lo = pack_bf162(x0 - h.x, x1 - h.y);
  } else {
    hi = pack_half2(x0, x1);
    const float2 h = unpack_half2(hi);
    lo = pack_half2(x0 - h.x, x1 - h.y);
  }
}

// ---- code pairs -> fp16x2 ----------------------------------------------------------------------------

// Two OCP E4M3 bytes (low 16 bits of `w`) -> fp16x2, exact (hardware cvt on sm_89+).
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t w) {
  __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

// The same for the two fp8 codes in bits 16-31: the conversion reads the upper half-word itself, no
// shift into the lower half first.
__device__ __forceinline__ uint32_t e4m3x2_hi_to_half2(uint32_t w) {
  uint32_t d;
  asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;\n\t}" : "=r"(d) : "r"(w));
  return d;
}

// Two int8 codes -> fp16x2, exact: with u = code + 128 (the 0x80 flip), the half with bits
// 0x6400 | u is 1024 + u, so subtracting 1152 leaves the code.
__device__ __forceinline__ uint32_t biased_u8x2_to_half2(uint32_t two_bytes_with_magic) {
  const __half2 magic = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
  __half2 h = *reinterpret_cast<__half2*>(&two_bytes_with_magic);
  h = __hsub2(h, magic);
  return *reinterpret_cast<uint32_t*>(&h);
}

// (a & b) ^ c in one LOP3. Written as C++ with two immediates, the compiler emitted an AND and an XOR
// (a LOP3 takes one immediate): 64 of int4's 520 instructions per page (docs/GPU_NOTES.md §19).
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Two int4 codes, the nibbles at bits 0-3 and 16-19 of `w` (other bits ignored) -> fp16x2, exact.
// Flipping a two's complement nibble's top bit gives u = code + 8 (0..15), and 0x6400 | u is the
// half 1024 + u, so one LOP3 (mask, flip, magic) and one HSUB2 of 1032 leave the code.
__device__ __forceinline__ uint32_t int4x2_to_half2(uint32_t w) {
  uint32_t x = and_xor(w, 0x000f000fu, 0x64086408u);
  const __half2 magic = __halves2half2(__ushort_as_half(0x6408), __ushort_as_half(0x6408));  // 1032
  __half2 h = *reinterpret_cast<__half2*>(&x);
  h = __hsub2(h, magic);
  return *reinterpret_cast<uint32_t*>(&h);
}

// The same for the nibbles at bits 4-7 and 20-23, without shifting them down first: 0x6400 | 16 u is
// 1024 + 16 u, and (1024 + 16 u) / 16 - 72 = u - 8 is exact in one HFMA2 (every intermediate is a
// multiple of 1/16 below 2^11).
__device__ __forceinline__ uint32_t int4x2_hi_to_half2(uint32_t w) {
  uint32_t x = and_xor(w, 0x00f000f0u, 0x64806480u);
  const __half2 sixteenth = __halves2half2(__ushort_as_half(0x2c00), __ushort_as_half(0x2c00));  // 1/16
  const __half2 neg72 = __halves2half2(__ushort_as_half(0xd480), __ushort_as_half(0xd480));      // -72
  __half2 h = *reinterpret_cast<__half2*>(&x);
  h = __hfma2(h, sixteenth, neg72);
  return *reinterpret_cast<uint32_t*>(&h);
}

// int4 K codes for the QK contraction: the nibbles at bits 0-3 and 16-19 of `w` -> fp16x2 in one
// LOP3. The flipped nibble u = code + 8 (as above) as the bits of a half is the subnormal u * 2^-24,
// exactly; the offset 8 and the unit 2^-24 are removed per head and per logit instead of per code
// (decode_tiles.cuh, Path<kInt4>::k_frag). The V codes keep the exact conversion above: in the PV
// sums an offset would accumulate over the tokens (docs/GPU_NOTES.md §20).
__device__ __forceinline__ uint32_t int4x2_to_subnormal_half2(uint32_t w) {
  return and_xor(w, 0x000f000fu, 0x00080008u);
}

// The same for the nibbles at bits 4-7 and 20-23, not shifted down: 16 u * 2^-24 = u * 2^-20.
__device__ __forceinline__ uint32_t int4x2_hi_to_subnormal_half2(uint32_t w) {
  return and_xor(w, 0x00f000f0u, 0x00800080u);
}

// ---- misc ----------------------------------------------------------------------------------------

// 2^x by the hardware approximation (within 2 ulp, like exp2f), results below 2^-126 flushed to 0:
// exp2f adds a denormal fix-up of three instructions to each call, and a softmax weight under
// 2^-126 of the running maximum is far below what the fp32 sums it joins can resolve.
// log2 with subnormal inputs flushed (-inf): only ever applied to scales, which are normal numbers.
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max_xor(float v, int width_lanes_mask) {
  for (int o = width_lanes_mask; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace kvq::attention::cuda::detail
