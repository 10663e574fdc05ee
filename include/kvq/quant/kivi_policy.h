#pragma once
// int4_kivi's scale / zero-point policy, host and device (the cache's page quantization, the
// pure quant/kivi.h functions and any device writer call these, so they agree bit for bit).
//
//   group   K: one channel of a page head (block_size tokens); V: one (token, head) row.
//   range   lo / hi over the group's finite values; NaN / inf are left out and written as 0.
//   scale   (hi - lo) / 15, raised to at least max(|lo|, |hi|) / kKiviZeroBound, then rounded *up*
//           to fp16 (policy.h's fp16_scale_up: clamped to [2^-24, 65504]). The floor keeps the
//           zero point within +-kKiviZeroBound, where fp16 still resolves it to 1/2 code or
//           better; it only acts on groups whose spread is under 1.5% of their magnitude (then
//           codes use less of their range). An all-zero or empty group gets scale 1, zero 0.
//   zero    -lo / scale, rounded to the nearest fp16. Codes are computed against the stored
//           scale and zero point, so (code - zero) * scale is the dequantization everywhere; the
//           zero point's rounding can move a value at most kKiviZeroBound * 2^-11 = 1/2 code past
//           the grid's edge, where it is clamped (not counted: it is rounding, not clipping).
//   code    clamp(rint(x / scale + zero), 0, 15), element 2i in the low nibble.
#include <cstdint>

#include "kvq/common/macros.h"
#include "kvq/format/bf16.h"
#include "kvq/format/integer.h"
#include "kvq/quant/policy.h"

namespace kvq::quant {

inline constexpr float kKiviZeroBound = 1024.f;

struct KiviParams {
  float scale = 1.f;
  float zero = 0.f;
};

// Finite min / max of a group, fed one value at a time.
struct KiviRange {
  float lo = 0.f, hi = 0.f;
  bool any = false;
  KVQ_HD void add(float x) {
    if (!is_finite_value(x)) return;
    lo = any && lo < x ? lo : x;
    hi = any && hi > x ? hi : x;
    any = true;
  }
};

// The unrounded scale of a group (before the fp16 rounding): what kivi_scale_clamped judges.
KVQ_HD float kivi_raw_scale(const KiviRange& r) {
  const float mag = abs_value(r.lo) > abs_value(r.hi) ? abs_value(r.lo) : abs_value(r.hi);
  if (!r.any || !(mag > 0.f)) return 1.f;
  const float spread = div_rn(r.hi - r.lo, static_cast<float>(format::kUint4Max));  // inf when hi - lo overflows
  const float floor = div_rn(mag, kKiviZeroBound);
  return spread > floor ? spread : floor;
}

// Whether the group's scale left fp16's range (QuantStats::scale_clamped); above it values clip.
KVQ_HD bool kivi_scale_clamped(const KiviRange& r) {
  const float s = kivi_raw_scale(r);
  return s > kFp16ScaleMax || s < kFp16ScaleMin;
}

// The stored (fp16-exact) scale and zero point of a group.
KVQ_HD KiviParams kivi_params(const KiviRange& r) {
  if (!r.any || (r.lo == 0.f && r.hi == 0.f)) return {};
  KiviParams p;
  p.scale = fp16_scale_up(kivi_raw_scale(r));
  float z = div_rn(-r.lo, p.scale);
  z = z > kFp16ScaleMax ? kFp16ScaleMax : (z < -kFp16ScaleMax ? -kFp16ScaleMax : z);
  p.zero = format::fp16_to_float(format::float_to_fp16(z));
  return p;
}

// x / scale + zero, the value the code rounds (0 for NaN / inf inputs).
KVQ_HD float kivi_scaled(float x, KiviParams p) { return div_rn(is_finite_value(x) ? x : 0.f, p.scale) + p.zero; }

KVQ_HD uint8_t kivi_code(float x, KiviParams p) { return format::encode_uint4(kivi_scaled(x, p)); }

// Two codes in one byte, element 2i (lo) in the low nibble.
KVQ_HD uint8_t kivi_code_pair(float lo, float hi, KiviParams plo, KiviParams phi) {
  return format::pack_int4(kivi_code(lo, plo), kivi_code(hi, phi));
}

// A finite value that a clamped scale (kivi_scale_clamped) pushed past the grid: counted as saturated.
KVQ_HD bool kivi_clips(float x, KiviParams p) {
  if (!is_finite_value(x)) return false;
  const float q = kivi_scaled(x, p);
  return q < -0.5f - kKiviZeroBound / 2048.f || q > 15.5f + kKiviZeroBound / 2048.f;
}

KVQ_HD float kivi_value(int code, KiviParams p) { return (static_cast<float>(code) - p.zero) * p.scale; }

}  // namespace kvq::quant
