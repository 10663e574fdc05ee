#pragma once
#include <cstdint>
#include <cstring>

#include "kvq/common/bits.h"
#include "kvq/common/macros.h"

namespace kvq::format {

using kvq::bits_float;  // common/bits.h
using kvq::float_bits;

// bf16 storage as raw bits; round to nearest even, NaN stays a quiet NaN.
KVQ_HD uint16_t float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

KVQ_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// IEEE binary16, round to nearest even, overflow to inf (used only for fp16 scale planes and the
// fp16 baseline; kvq never stores fp16 KV values above 65504 because the quantizer is bf16/fp8/int8).
KVQ_HD uint16_t float_to_fp16(float x) {
  uint32_t u = float_bits(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65536
  if (a < 0x38800000u) {  // below 2^-14: subnormal half, exact arithmetic in float
    float f = bits_float(a) * 16777216.0f;  // * 2^24
#if defined(__CUDA_ARCH__)
    uint32_t q = static_cast<uint32_t>(rintf(f));
#else
    uint32_t q = static_cast<uint32_t>(__builtin_rintf(f));
#endif
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = (a + 0xfffu + ((a >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(sign | (r - (112u << 10)));
}

KVQ_HD float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -v : v;
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace kvq::format
