#pragma once
// Device quantization that reproduces quant::quantize_row / scale_for_amax bit for bit.
// fp8 uses the hardware conversion (cvt.rn.satfinite.e4m3x2.f32: one rounding to nearest even,
// saturation at 448), then applies the writer's interchange rule (-0 -> +0). FNUZ codes are the
// OCP codes of 2x: the two grids coincide up to that factor for every code the FNUZ writer emits
// (cap 224 = OCP 448). tests/attention/write_test.cu checks both against the scalar codecs on
// every float bit pattern.
#include <cfloat>
#include <cstdint>

#include "device_util.cuh"
#include "kvq/format/format.h"
#include "kvq/quant/policy.h"

namespace kvq::attention::cuda::detail {

// The scale policy itself (amax rule, amax -> scale, growth, per_tensor) is quant/policy.h's,
// shared with the host cache; this file only holds the vectorised encoders.
using quant::amax_term;
using quant::scale_for_amax;

// Bytes equal to 0x80 (-0 in OCP) become 0x00.
__device__ __forceinline__ uint32_t flush_neg_zero4(uint32_t w) { return w & ~__vcmpeq4(w, 0x80808080u); }

__device__ __forceinline__ uint32_t e4m3x4_satfinite(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return flush_neg_zero4(lo | (hi << 16));
}

__device__ __forceinline__ uint32_t int8_code(float x) {
  int q = __float2int_rn(x);  // round to nearest even; saturates; NaN -> 0
  q = min(max(q, -format::kInt8Max), format::kInt8Max);
  return static_cast<uint32_t>(q) & 0xffu;
}

// Four already scaled values (finite or +-inf; NaN never reaches here) -> four 8-bit codes.
template <Format F>
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d) {
  if constexpr (F == Format::kFp8E4m3) {
    return e4m3x4_satfinite(a, b, c, d);
  } else if constexpr (F == Format::kFp8E4m3Fnuz) {
    return e4m3x4_satfinite(2.f * a, 2.f * b, 2.f * c, 2.f * d);
  } else {
    return int8_code(a) | (int8_code(b) << 8) | (int8_code(c) << 16) | (int8_code(d) << 24);
  }
}

// x / s rounded to nearest, as __fdiv_rn, from y = RN(1/s) computed once per row: q0 = RN(x * y)
// is within an ulp of x / s, the remainder x - s * q0 is exact in one FMA, and one correction
// q0 + r * y then rounds correctly (Markstein's theorem; s >= FLT_MIN keeps 1/s normal). Where
// that argument needs care the code does not: |x / s| >= 2^20 saturates every 8-bit format, so
// q0 is used as is, and quotients below 2^-20 become code 0 either way.
// count_division_mismatches() checks it against __fdiv_rn on the device.
__device__ __forceinline__ float div_by_scale(float x, float s, float y) {
  const float q0 = __fmul_rn(x, y);
  const float r = __fmaf_rn(-q0, s, x);
  const float q = __fmaf_rn(r, y, q0);
  return fabsf(q0) < 1048576.f ? q : q0;
}

// quant::quantize_value's element rule (non-finite -> code 0, else encode(x / scale)) with the
// quotient from div_by_scale.
__device__ __forceinline__ float scaled_or_zero(float x, float scale, float inv) {
  return isfinite(x) ? div_by_scale(x, scale, inv) : 0.f;
}

// max(m, |x|) with NaN propagating (PTX max.NaN): after a lane's 16 values one test, m < inf,
// tells whether all of them were finite, at one instruction per element.
__device__ __forceinline__ float abs_max_nan(float m, float x) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(x)));
  return r;
}

// 16 values -> 16 codes of an 8-bit format. kAllFinite: the caller has checked that the 16 values
// are finite (abs_max_nan), so the per-element non-finite test of scaled_or_zero is skipped; the
// quotients are the same.
template <Format F, bool kAllFinite = false>
__device__ __forceinline__ uint4 quantize16(const float (&x)[16], float scale) {
  const float inv = __frcp_rn(scale);
  float s[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i] = kAllFinite ? div_by_scale(x[i], scale, inv) : scaled_or_zero(x[i], scale, inv);
  uint4 r;
  r.x = encode4<F>(s[0], s[1], s[2], s[3]);
  r.y = encode4<F>(s[4], s[5], s[6], s[7]);
  r.z = encode4<F>(s[8], s[9], s[10], s[11]);
  r.w = encode4<F>(s[12], s[13], s[14], s[15]);
  return r;
}

// quantize_row for bf16 / fp16 storage: non-finite -> 0, values that would round to inf
// saturate to the largest finite value, else round to nearest even.
template <Format F>
__device__ __forceinline__ uint16_t store16(float v) {
  if (!isfinite(v)) return 0;
  if constexpr (F == Format::kFp16) {
    if (fabsf(v) >= 65520.0f) v = copysignf(65504.0f, v);
    return format::float_to_fp16(v);
  } else {
    if (fabsf(v) >= __uint_as_float(0x7F7F8000u)) v = copysignf(__uint_as_float(0x7F7F0000u), v);
    return format::float_to_bf16(v);
  }
}

template <Format F>
__device__ __forceinline__ void store16x16(const float (&x)[16], uint4& lo, uint4& hi) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = store16<F>(x[2 * i]) | (static_cast<uint32_t>(store16<F>(x[2 * i + 1])) << 16);
  lo = make_uint4(w[0], w[1], w[2], w[3]);
  hi = make_uint4(w[4], w[5], w[6], w[7]);
}

// One code byte back to the value the host's dequantize_row gives (code value * scale).
template <Format F>
__device__ __forceinline__ float dequant1(uint32_t byte, float scale) {
  return __fmul_rn(decode_byte(F, static_cast<uint8_t>(byte)), scale);
}

}  // namespace kvq::attention::cuda::detail
