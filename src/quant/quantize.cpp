#include "kvq/quant/quantize.h"

#include <cfloat>
#include <cmath>

namespace kvq::quant {
namespace {

constexpr float kFp16Max = 65504.0f;

void store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>(v >> 8);
}
uint16_t load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}

}  // namespace

float finite_amax(const float* x, int n, QuantStats* stats) {
  float amax = 0.f;
  uint64_t bad = 0;
  for (int i = 0; i < n; ++i) {
    const float a = abs_value(x[i]);
    if (!is_finite_value(a)) {
      ++bad;
      continue;
    }
    if (a > amax) amax = a;
  }
  if (stats) stats->nonfinite += bad;
  return amax;
}

size_t row_bytes(Format f, int n) {
  if (n <= 0) return 0;
  const size_t un = static_cast<size_t>(n);
  const FormatTraits t = format_traits(f);
  return t.elems_per_byte > 1 ? (un + t.elems_per_byte - 1) / t.elems_per_byte : un * static_cast<size_t>(t.bits) / 8;
}

void quantize_row(Format f, const float* x, int n, float scale, uint8_t* codes, QuantStats* stats) {
  QuantStats local;
  local.values = n > 0 ? static_cast<uint64_t>(n) : 0;
  switch (f) {
    case Format::kBf16:
    case Format::kFp16:
      for (int i = 0; i < n; ++i) {
        float v = x[i];
        if (!std::isfinite(v)) {
          ++local.nonfinite;
          v = 0.f;
        } else if (clips(f, v)) {
          ++local.saturated;
          v = std::copysign(f == Format::kFp16 ? kFp16Max : format::bits_float(0x7F7F0000u), v);
        }
        const uint16_t b = f == Format::kFp16 ? format::float_to_fp16(v) : format::float_to_bf16(v);
        store_u16(codes + 2 * static_cast<size_t>(i), b);
      }
      break;
    case Format::kInt4:
    case Format::kInt4Kivi:  // int4_kivi here: one group, zero point 0 (the cache's groups: kivi_policy.h)
      for (int i = 0; i < n; i += 2) {
        int q[2] = {0, 0};
        for (int j = 0; j < 2 && i + j < n; ++j) {
          const float v = x[i + j];
          if (!std::isfinite(v)) {
            ++local.nonfinite;
            continue;
          }
          const float s = div_rn(v, scale);
          if (clips(f, s) || (f == Format::kInt4Kivi && s < -0.5f)) ++local.saturated;
          q[j] = f == Format::kInt4 ? format::encode_symmetric_int(s, format::kInt4Max) : format::encode_uint4(s);
        }
        codes[i / 2] = format::pack_int4(q[0], q[1]);
      }
      break;
    default:  // one byte per element: fp8 (OCP, FNUZ) and int8
      for (int i = 0; i < n; ++i) {
        const float v = x[i];
        if (!std::isfinite(v)) {
          ++local.nonfinite;
          codes[i] = 0;
          continue;
        }
        const float s = div_rn(v, scale);
        if (clips(f, s)) ++local.saturated;
        codes[i] = encode_byte(f, s);  // quantize_value's rule, with the quotient kept for clips()
      }
      break;
  }
  if (stats) stats->merge(local);
}

void dequantize_row(Format f, const uint8_t* codes, int n, float scale, float* out) {
  switch (f) {
    case Format::kBf16:
      for (int i = 0; i < n; ++i) out[i] = format::bf16_to_float(load_u16(codes + 2 * static_cast<size_t>(i)));
      break;
    case Format::kFp16:
      for (int i = 0; i < n; ++i) out[i] = format::fp16_to_float(load_u16(codes + 2 * static_cast<size_t>(i)));
      break;
    case Format::kInt4:
      for (int i = 0; i < n; ++i) {
        const uint8_t b = codes[i / 2];
        const int q = (i & 1) ? format::unpack_int4_hi(b) : format::unpack_int4_lo(b);
        out[i] = static_cast<float>(q) * scale;
      }
      break;
    case Format::kInt4Kivi:
      for (int i = 0; i < n; ++i) out[i] = static_cast<float>(format::uint4_at(codes, static_cast<size_t>(i))) * scale;
      break;
    default:
      for (int i = 0; i < n; ++i) out[i] = decode_byte(f, codes[i]) * scale;
      break;
  }
}

}  // namespace kvq::quant
