#pragma once
// The scale policy, written once for the host cache (cache/paged_cache.cpp, quant/quantize.cpp) and
// the CUDA writers (attention/cuda/write.cu, backend/cuda/ops/attention_generic.cuh). Host and
// device must emit the same scales and codes bit for bit, so everything here is one IEEE
// operation at a time: `/` is the correctly rounded division on both sides (nvcc's default
// -prec-div=true; __fdiv_rn is spelled out on the device so a fast-math flag cannot change it).
//
//   amax        over finite values only: NaN and +-inf contribute 0 (and are written as code 0).
//   scale       amax / qmax (format_traits(f).qmax); an all-zero (or empty) input gets 1, and the
//               scale is never below FLT_MIN, so x / scale stays finite and no plane holds denormals.
//   per_token_head  one scale per (token, head) from that row's amax.
//   scale dtype fp32 stores that scale. fp16 (DESIGN §3; --kv-scale-dtype fp16) stores the smallest
//               fp16 value >= it, and codes are computed by dividing by exactly that stored value, so
//               code * stored scale is the dequantization on every reader. Rounding *up* (never to
//               nearest) keeps amax / stored <= amax / fp32 scale: a row never clips because its scale
//               was rounded; it only loses < 2^-10 of its code range. Out of fp16's range: an fp32
//               scale above 65504 is clamped to 65504 (the row's large values then saturate and are
//               counted in QuantStats::saturated, as per_tensor's are) and one below fp16's smallest
//               subnormal 2^-24 is raised to 2^-24 (codes then use less of their range: the row's
//               values are all below ~3e-6 * qmax); both are counted in QuantStats::scale_clamped.
//               Scales between 2^-24 and 2^-14 are fp16 subnormals: still rounded up, with fewer
//               significant bits, so such (tiny) rows lose more code range but never clip.
//   per_block_head  a page head's scale comes from the amax of the first run written into it; a
//               later run grows it only when its exact amax exceeds the page head's recorded amax
//               (deciding on the scale alone goes wrong when an all-zero page, scale 1, gets its
//               first non-zero token); then the page head's earlier codes are re-quantized with the
//               grown scale (dequantized with the old one first).
//   per_tensor  the layer's scale is unset until the first write that reaches the main pool sets
//               it from that write's amax; later values saturate. Device planes mark "unset" with
//               kUnsetTensorScale (no real scale is 0); the host cache keeps a flag beside the plane.
//   element     code = encode(x / scale) for finite x, 0 for NaN / inf.
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kvq/common/macros.h"
#include "kvq/common/reproducible_math.h"
#include "kvq/format/bf16.h"
#include "kvq/format/format.h"
#include "kvq/quant/spec.h"

namespace kvq::quant {

inline constexpr float kUnsetTensorScale = 0.f;

KVQ_HD bool is_finite_value(float x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

KVQ_HD float div_rn(float a, float b) { return rp::div(a, b); }  // never a reciprocal multiply

KVQ_HD float abs_value(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// What x contributes to amax: |x|, or 0 when x is NaN / inf.
KVQ_HD float amax_term(float x) {
  const float a = abs_value(x);
  return is_finite_value(a) ? a : 0.f;
}

// The scale that maps amax to the format's qmax; 1 for unscaled formats and for amax 0 / non-finite.
KVQ_HD float scale_for_amax(Format f, float amax) {
  if (!is_quantized(f) || !(amax > 0.f) || !is_finite_value(amax)) return 1.0f;
  const float s = div_rn(amax, format_qmax(f));
  return s < FLT_MIN ? FLT_MIN : s;
}

inline constexpr float kFp16ScaleMax = 65504.f;
inline constexpr float kFp16ScaleMin = 5.9604644775390625e-8f;  // 2^-24, the smallest fp16 subnormal

// The smallest fp16 value >= s (s finite and > 0), clamped to [2^-24, 65504], widened to float.
KVQ_HD float fp16_scale_up(float s) {
  if (!(s < kFp16ScaleMax)) return kFp16ScaleMax;
  if (s <= kFp16ScaleMin) return kFp16ScaleMin;
  uint16_t h = format::float_to_fp16(s);  // nearest; one step up when that fell below s
  if (format::fp16_to_float(h) < s) ++h;  // positive halves are ordered like their bits
  return format::fp16_to_float(h);
}

// The scale as stored in a plane of dtype d (and as every code is computed against).
KVQ_HD float stored_scale(float s, ScaleDtype d) { return d == ScaleDtype::kFp16 ? fp16_scale_up(s) : s; }

KVQ_HD float scale_for_amax(Format f, float amax, ScaleDtype d) { return stored_scale(scale_for_amax(f, amax), d); }

// Whether scale_for_amax(f, amax, d) had to clamp to fp16's range (QuantStats::scale_clamped).
KVQ_HD bool scale_clamped(Format f, float amax, ScaleDtype d) {
  if (d != ScaleDtype::kFp16) return false;
  const float s = scale_for_amax(f, amax);
  return s > kFp16ScaleMax || s < kFp16ScaleMin;
}

// per_block_head: does a run with exact amax `run_amax` grow the page head whose recorded amax is
// `page_amax`? (A fresh page head takes the run's scale without asking.)
KVQ_HD bool block_scale_grows(float run_amax, float page_amax) { return run_amax > page_amax; }

// per_tensor: is the layer's scale still to be set by the next main-pool write?
KVQ_HD bool tensor_scale_unset(float scale) { return scale == kUnsetTensorScale; }

// One 8-bit (or unpacked int4) code: encode(x / scale), NaN / inf -> 0. `scaled` variants for the
// vectorised device writer, which computes the same quotient another way, live next to it.
KVQ_HD uint8_t quantize_value(Format f, float x, float scale) {
  return is_finite_value(x) ? encode_byte(f, div_rn(x, scale)) : uint8_t{0};
}

// Two int4 codes (elements 2i and 2i + 1 of a row) in one byte, element 2i in the low nibble;
// each is quantize_value's code, so the host cache and the CUDA writers pack alike.
KVQ_HD uint8_t quantize_int4_pair(float lo, float hi, float scale) {
  return format::pack_int4(quantize_value(Format::kInt4, lo, scale), quantize_value(Format::kInt4, hi, scale));
}

// True when encoding `scaled` (already divided by the scale) clips it to +-qmax, i.e. an
// unbounded grid would have rounded it to a larger magnitude. Rounding *to* qmax is not clipping.
KVQ_HD bool clips(Format f, float scaled) {
  const FormatTraits t = format_traits(f);
  const float a = abs_value(scaled);
  return t.clip_at_equal ? a >= t.clip_limit : a > t.clip_limit;
}

}  // namespace kvq::quant
