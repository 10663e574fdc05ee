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
    const float a = std::fabs(x[i]);
    if (!std::isfinite(a)) {
      ++bad;
      continue;
    }
    if (a > amax) amax = a;
  }
  if (stats) stats->nonfinite += bad;
  return amax;
}

float scale_for_amax(Format f, float amax) {
  if (!is_quantized(f) || !(amax > 0.f) || !std::isfinite(amax)) return 1.0f;
  const float s = amax / format_qmax(f);
  return s < FLT_MIN ? FLT_MIN : s;
}

bool clips(Format f, float scaled) {
  const float a = std::fabs(scaled);
  switch (f) {
    // Beyond the midpoint between the largest code and the next grid value (which the format
    // lacks or the writer refuses); the tie itself rounds to the even largest code for fp8.
    case Format::kFp8E4m3: return a > 464.0f;      // 448 | 480
    case Format::kFp8E4m3Fnuz: return a > 232.0f;  // 224 | 240 (interchange cap)
    // rint's tie at qmax + 0.5 goes to the even neighbour qmax + 1, which is clipped.
    case Format::kInt8: return a >= 127.5f;
    case Format::kInt4: return a >= 7.5f;
    case Format::kFp16: return a >= 65520.0f;       // rounds to inf in binary16
    case Format::kBf16: return a >= format::bits_float(0x7F7F8000u);  // rounds to bf16 inf
  }
  return false;
}

size_t row_bytes(Format f, int n) {
  if (n <= 0) return 0;
  const size_t un = static_cast<size_t>(n);
  return f == Format::kInt4 ? (un + 1) / 2 : un * static_cast<size_t>(format_bits(f)) / 8;
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
      for (int i = 0; i < n; i += 2) {
        int q[2] = {0, 0};
        for (int j = 0; j < 2 && i + j < n; ++j) {
          const float v = x[i + j];
          if (!std::isfinite(v)) {
            ++local.nonfinite;
            continue;
          }
          const float s = v / scale;
          if (clips(f, s)) ++local.saturated;
          q[j] = format::encode_symmetric_int(s, format::kInt4Max);
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
        const float s = v / scale;
        if (clips(f, s)) ++local.saturated;
        codes[i] = encode_byte(f, s);
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
    default:
      for (int i = 0; i < n; ++i) out[i] = decode_byte(f, codes[i]) * scale;
      break;
  }
}

}  // namespace kvq::quant
