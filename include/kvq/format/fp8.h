#pragma once
// FP8 E4M3 codecs, bit exact on host and device.
//
// OCP "fn" (NVIDIA, sm_89+): bias 7, max 448, NaN = S.1111.111, has -0.
// FNUZ (AMD CDNA3):          bias 8, max 240, NaN = 0x80, no -0, no inf.
//
// Encoding rounds to nearest even and saturates: a finite input never becomes NaN.
// Non-finite input policy (one for both formats): NaN encodes as +0 and +-inf as +-max.
// The quantizers count such inputs (QuantStats::nonfinite) so they are never silent.
//
// Interchange rule (DESIGN §2): kvq's FNUZ *writer* caps at 224 (code 0x7E) and its OCP writer
// flushes -0 to +0. Every byte either writer emits then decodes to the same code in both formats
// with value_fnuz = value_ocp / 2, so moving a cache between vendors only rescales.
#include <cstdint>

#include "kvq/common/macros.h"
#include "kvq/format/bf16.h"

namespace kvq::format {

inline constexpr float kFp8E4m3Max = 448.0f;
inline constexpr float kFp8E4m3FnuzMax = 240.0f;
inline constexpr float kFp8FnuzWriterMax = 224.0f;  // interchange cap
inline constexpr uint8_t kFp8MaxCode = 0x7E;        // 448 (OCP) / 224 (FNUZ): both writers' cap

KVQ_HD float fp8_rint(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return __builtin_rintf(x);
#endif
}

// Shared core: |x| to a 7-bit magnitude code with exponent bias `bias`, RNE, saturating at
// `max_code`. Subnormals are m * 2^(1-bias-3); the code of m happens to equal m, including the
// carry into the smallest normal (m == 8 -> exponent 1, mantissa 0).
KVQ_HD uint8_t fp8_magnitude_code(uint32_t abs_bits, int bias, uint8_t max_code) {
  const uint32_t min_normal_bits = static_cast<uint32_t>(127 + 1 - bias) << 23;
  if (abs_bits < min_normal_bits) {
    const float scale_up = bits_float(static_cast<uint32_t>(127 + bias + 2) << 23);  // 2^(bias+2)
    return static_cast<uint8_t>(fp8_rint(bits_float(abs_bits) * scale_up));
  }
  // Round the float's 23-bit mantissa to 3 bits, nearest even; a carry bumps the exponent.
  uint32_t r = (abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20;
  uint32_t code = r - (static_cast<uint32_t>(127 - bias) << 3);
  // Any exponent beyond the format (including float inf) saturates.
  if (r >= (static_cast<uint32_t>(127 - bias) << 3) + max_code) return max_code;
  return static_cast<uint8_t>(code);
}

// Plain OCP E4M3 encode, saturating at 448. -0 is kept (as ml_dtypes does after clamping).
KVQ_HD uint8_t encode_fp8_e4m3(float x) {
  uint32_t u = float_bits(x);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x00;  // NaN policy: +0
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  return static_cast<uint8_t>(sign | fp8_magnitude_code(a, 7, 0x7E));
}

// Plain FNUZ E4M3 encode, saturating at 240. Zero (of either sign) is 0x00, never 0x80.
KVQ_HD uint8_t encode_fp8_e4m3_fnuz(float x) {
  uint32_t u = float_bits(x);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x00;
  uint8_t m = fp8_magnitude_code(a, 8, 0x7F);
  if (m == 0) return 0x00;
  return static_cast<uint8_t>(((u >> 24) & 0x80u) | m);
}

// The cache writers (interchange rule applied).
KVQ_HD uint8_t write_fp8_e4m3(float x) {
  uint8_t c = encode_fp8_e4m3(x);
  return c == 0x80 ? uint8_t{0} : c;
}
KVQ_HD uint8_t write_fp8_e4m3_fnuz(float x) {
  uint32_t u = float_bits(x);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x00;
  uint8_t m = fp8_magnitude_code(a, 8, kFp8MaxCode);
  if (m == 0) return 0x00;
  return static_cast<uint8_t>(((u >> 24) & 0x80u) | m);
}

KVQ_HD float decode_fp8_e4m3(uint8_t c) {
  uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 15 && m == 7) return bits_float(sign | 0x7fc00000u);
  if (e == 0) {
    float v = static_cast<float>(m) * 0.001953125f;  // 2^-9
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

KVQ_HD float decode_fp8_e4m3_fnuz(uint8_t c) {
  if (c == 0x80) return bits_float(0x7fc00000u);
  uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 0) {
    float v = static_cast<float>(m) * 0.0009765625f;  // 2^-10
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 119u) << 23) | (m << 20));
}

}  // namespace kvq::format
