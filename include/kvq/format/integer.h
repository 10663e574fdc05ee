#pragma once
// Symmetric integer codecs. int8 uses -127..127 (never -128, so negation is exact and the grid is
// symmetric); int4 uses -7..7 packed two per byte, element 2i in the low nibble.
// Non-finite policy as for fp8: NaN -> 0, +-inf -> +-qmax.
#include <cstdint>

#include "kvq/common/macros.h"
#include "kvq/format/fp8.h"

namespace kvq::format {

inline constexpr int kInt8Max = 127;
inline constexpr int kInt4Max = 7;

KVQ_HD int encode_symmetric_int(float x, int qmax) {
  if (x != x) return 0;
  float q = fp8_rint(x);
  if (q > static_cast<float>(qmax)) return qmax;
  if (q < -static_cast<float>(qmax)) return -qmax;
  return static_cast<int>(q);
}

KVQ_HD int8_t encode_int8(float x) { return static_cast<int8_t>(encode_symmetric_int(x, kInt8Max)); }
KVQ_HD float decode_int8(int8_t q) { return static_cast<float>(q); }

KVQ_HD uint8_t pack_int4(int lo, int hi) {
  return static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4));
}
KVQ_HD int unpack_int4_lo(uint8_t b) { return static_cast<int>(static_cast<int8_t>(b << 4)) >> 4; }
KVQ_HD int unpack_int4_hi(uint8_t b) { return static_cast<int>(static_cast<int8_t>(b)) >> 4; }

}  // namespace kvq::format
