#include "kvq/quant/kivi.h"

#include <algorithm>

#include "kvq/format/integer.h"
#include "kvq/quant/policy.h"

namespace kvq::quant {
namespace {

// Scale and zero point of the finite values x[0], x[stride], ... (count of them).
void asymmetric_params(const float* x, int count, int stride, float* scale, float* zero) {
  float lo = 0.f, hi = 0.f;
  bool any = false;
  for (int i = 0; i < count; ++i) {
    const float v = x[static_cast<size_t>(i) * stride];
    if (!is_finite_value(v)) continue;
    lo = any ? std::min(lo, v) : v;
    hi = any ? std::max(hi, v) : v;
    any = true;
  }
  const float range = hi - lo;
  *scale = range > 0.f && is_finite_value(range) ? div_rn(range, static_cast<float>(format::kUint4Max)) : 1.f;
  *zero = div_rn(-lo, *scale);
}

uint8_t code_of(float x, float scale, float zero) {
  return format::encode_uint4(div_rn(is_finite_value(x) ? x : 0.f, scale) + zero);
}

}  // namespace

KiviPageHead kivi_quantize(const float* k, const float* v, int n, int d) {
  KiviPageHead p;
  const size_t rows = static_cast<size_t>(n), row_bytes = static_cast<size_t>(d) / 2;
  p.k_codes.assign(rows * row_bytes, 0);
  p.v_codes.assign(rows * row_bytes, 0);
  p.k_scale.assign(static_cast<size_t>(d), 1.f);
  p.k_zero.assign(static_cast<size_t>(d), 0.f);
  p.v_scale.assign(rows, 1.f);
  p.v_zero.assign(rows, 0.f);
  for (int c = 0; c < d; ++c) asymmetric_params(k + c, n, d, &p.k_scale[c], &p.k_zero[c]);
  for (int t = 0; t < n; ++t) asymmetric_params(v + static_cast<size_t>(t) * d, d, 1, &p.v_scale[t], &p.v_zero[t]);
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < d; i += 2) {
      const size_t e = static_cast<size_t>(t) * d + i, b = static_cast<size_t>(t) * row_bytes + i / 2;
      p.k_codes[b] = format::pack_int4(code_of(k[e], p.k_scale[i], p.k_zero[i]), code_of(k[e + 1], p.k_scale[i + 1], p.k_zero[i + 1]));
      p.v_codes[b] = format::pack_int4(code_of(v[e], p.v_scale[t], p.v_zero[t]), code_of(v[e + 1], p.v_scale[t], p.v_zero[t]));
    }
  }
  return p;
}

void kivi_dequantize(const KiviPageHead& p, int n, int d, float* k, float* v) {
  const size_t row_bytes = static_cast<size_t>(d) / 2;
  for (int t = 0; t < n; ++t) {
    const uint8_t* kc = p.k_codes.data() + static_cast<size_t>(t) * row_bytes;
    float* kr = k + static_cast<size_t>(t) * d;
    for (int i = 0; i < d; ++i) kr[i] = (static_cast<float>(format::uint4_at(kc, i)) - p.k_zero[i]) * p.k_scale[i];
    format::decode_uint4_row(p.v_codes.data() + static_cast<size_t>(t) * row_bytes, static_cast<size_t>(d), p.v_scale[t],
                             p.v_zero[t], v + static_cast<size_t>(t) * d);
  }
}

}  // namespace kvq::quant
