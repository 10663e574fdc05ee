#pragma once
// KIVI's 2D int4 grouping for one page head, as pure functions: the reference the int4_kivi cache
// (which quantizes a page from its bf16 twin when the page leaves the recent window) is tested
// against. Scales and zero points follow quant/kivi_policy.h (fp16-exact values).
//   K: per channel, asymmetric over the page's n tokens: the values of channel c map [min_c, max_c]
//      onto codes 0..15 (scale (max - min) / 15, zero point -min / scale);
//   V: per token, asymmetric over the head's d channels, the same way.
// Decoding is (code - zero_point) * scale (format/integer.h's uint4 codec). Non-finite inputs are
// written as the code nearest 0 and left out of min / max; an all-zero group gets scale 1. Codes are packed two per byte, element 2i in the low nibble, row-major [n][d / 2] for
// both K and V.
#include <cstdint>
#include <vector>

namespace kvq::quant {

struct KiviPageHead {
  std::vector<uint8_t> k_codes, v_codes;  // [n][d / 2] each
  std::vector<float> k_scale, k_zero;     // [d]: per channel
  std::vector<float> v_scale, v_zero;     // [n]: per token
};

// k, v: [n][d] (d even).
KiviPageHead kivi_quantize(const float* k, const float* v, int n, int d);
// k, v: [n][d] out.
void kivi_dequantize(const KiviPageHead& p, int n, int d, float* k, float* v);

}  // namespace kvq::quant
