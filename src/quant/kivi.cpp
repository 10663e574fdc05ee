#include "kvq/quant/kivi.h"

#include "kvq/format/integer.h"
#include "kvq/quant/kivi_policy.h"

namespace kvq::quant {
namespace {

// The stored parameters of the values x[0], x[stride], ... (count of them).
KiviParams group_params(const float* x, int count, int stride) {
  KiviRange r;
  for (int i = 0; i < count; ++i) r.add(x[static_cast<size_t>(i) * stride]);
  return kivi_params(r);
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
  std::vector<KiviParams> kp(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c) {
    kp[c] = group_params(k + c, n, d);
    p.k_scale[c] = kp[c].scale, p.k_zero[c] = kp[c].zero;
  }
  for (int t = 0; t < n; ++t) {
    const KiviParams vp = group_params(v + static_cast<size_t>(t) * d, d, 1);
    p.v_scale[t] = vp.scale, p.v_zero[t] = vp.zero;
    for (int i = 0; i < d; i += 2) {
      const size_t e = static_cast<size_t>(t) * d + i, b = static_cast<size_t>(t) * row_bytes + i / 2;
      p.k_codes[b] = kivi_code_pair(k[e], k[e + 1], kp[i], kp[i + 1]);
      p.v_codes[b] = kivi_code_pair(v[e], v[e + 1], vp, vp);
    }
  }
  return p;
}

void kivi_dequantize(const KiviPageHead& p, int n, int d, float* k, float* v) {
  const size_t row_bytes = static_cast<size_t>(d) / 2;
  for (int t = 0; t < n; ++t) {
    const uint8_t* kc = p.k_codes.data() + static_cast<size_t>(t) * row_bytes;
    const uint8_t* vc = p.v_codes.data() + static_cast<size_t>(t) * row_bytes;
    const KiviParams vp{p.v_scale[t], p.v_zero[t]};
    for (int i = 0; i < d; ++i) {
      k[static_cast<size_t>(t) * d + i] = kivi_value(format::uint4_at(kc, i), {p.k_scale[i], p.k_zero[i]});
      v[static_cast<size_t>(t) * d + i] = kivi_value(format::uint4_at(vc, i), vp);
    }
  }
}

}  // namespace kvq::quant
