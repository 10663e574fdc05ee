#pragma once
// Integer codecs. All take an already scaled value (x / scale, plus the zero point for the
// asymmetric ones) and round to nearest even, like the fp8 encoders.
//
// Symmetric: int8 uses -127..127 (never -128, so negation is exact and the grid is symmetric);
// int4 uses -7..7. Asymmetric (KIVI): uint4 uses 0..15 around a zero point the quantizer picks.
// Non-finite policy as for fp8: NaN -> 0, +-inf -> the nearest end of the range.
//
// int4 packing: two codes per byte, element 2i in the low nibble and 2i+1 in the high nibble; a
// row of odd length leaves the last byte's high nibble zero.
#include <cstddef>
#include <cstdint>

#include "kvq/common/macros.h"
#include "kvq/format/fp8.h"

namespace kvq::format {

inline constexpr int kInt8Max = 127;
inline constexpr int kInt4Max = 7;
inline constexpr int kUint4Max = 15;

KVQ_HD int encode_symmetric_int(float x, int qmax) {
  if (x != x) return 0;
  float q = fp8_rint(x);
  if (q > static_cast<float>(qmax)) return qmax;
  if (q < -static_cast<float>(qmax)) return -qmax;
  return static_cast<int>(q);
}

// 0..qmax; the caller has already added the zero point.
KVQ_HD int encode_unsigned_int(float x, int qmax) {
  if (x != x) return 0;
  float q = fp8_rint(x);
  if (q > static_cast<float>(qmax)) return qmax;
  if (q < 0.0f) return 0;
  return static_cast<int>(q);
}

KVQ_HD int8_t encode_int8(float x) { return static_cast<int8_t>(encode_symmetric_int(x, kInt8Max)); }
KVQ_HD float decode_int8(int8_t q) { return static_cast<float>(q); }

KVQ_HD int8_t encode_int4(float x) { return static_cast<int8_t>(encode_symmetric_int(x, kInt4Max)); }
KVQ_HD uint8_t encode_uint4(float x) { return static_cast<uint8_t>(encode_unsigned_int(x, kUint4Max)); }

KVQ_HD uint8_t pack_int4(int lo, int hi) {
  return static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4));
}
// Signed nibbles (symmetric int4), sign extended.
KVQ_HD int unpack_int4_lo(uint8_t b) { return static_cast<int>(static_cast<int8_t>(b << 4)) >> 4; }
KVQ_HD int unpack_int4_hi(uint8_t b) { return static_cast<int>(static_cast<int8_t>(b)) >> 4; }
// Unsigned nibbles (asymmetric uint4).
KVQ_HD int unpack_uint4_lo(uint8_t b) { return b & 0xf; }
KVQ_HD int unpack_uint4_hi(uint8_t b) { return b >> 4; }

// Bytes holding n packed 4-bit codes.
KVQ_HD constexpr size_t int4_row_bytes(size_t n) { return (n + 1) / 2; }

// Element i of a packed row.
KVQ_HD int int4_at(const uint8_t* packed, size_t i) {
  return (i & 1) ? unpack_int4_hi(packed[i / 2]) : unpack_int4_lo(packed[i / 2]);
}
KVQ_HD int uint4_at(const uint8_t* packed, size_t i) {
  return (i & 1) ? unpack_uint4_hi(packed[i / 2]) : unpack_uint4_lo(packed[i / 2]);
}

// Encodes n values into int4_row_bytes(n) bytes: code_i = encode_int4(x[i] / scale). Division
// (not a reciprocal multiply) so the codes match quant::quantize_row's x / scale exactly.
KVQ_HD void encode_int4_row(const float* x, size_t n, float scale, uint8_t* out) {
  for (size_t i = 0; i + 1 < n; i += 2)
    out[i / 2] = pack_int4(encode_int4(x[i] / scale), encode_int4(x[i + 1] / scale));
  if (n & 1) out[n / 2] = pack_int4(encode_int4(x[n - 1] / scale), 0);
}

// Decodes a packed int4 row: y[i] = code_i * scale.
KVQ_HD void decode_int4_row(const uint8_t* packed, size_t n, float scale, float* y) {
  for (size_t i = 0; i < n; ++i) y[i] = static_cast<float>(int4_at(packed, i)) * scale;
}

// Asymmetric rows (KIVI): code_i = encode_uint4(x[i] / scale + zero_point),
// y[i] = (code_i - zero_point) * scale.
KVQ_HD void encode_uint4_row(const float* x, size_t n, float scale, float zero_point, uint8_t* out) {
  for (size_t i = 0; i + 1 < n; i += 2)
    out[i / 2] = pack_int4(encode_uint4(x[i] / scale + zero_point),
                           encode_uint4(x[i + 1] / scale + zero_point));
  if (n & 1) out[n / 2] = pack_int4(encode_uint4(x[n - 1] / scale + zero_point), 0);
}

KVQ_HD void decode_uint4_row(const uint8_t* packed, size_t n, float scale, float zero_point,
                             float* y) {
  for (size_t i = 0; i < n; ++i) y[i] = (static_cast<float>(uint4_at(packed, i)) - zero_point) * scale;
}

}  // namespace kvq::format
