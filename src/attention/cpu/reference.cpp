#include "kvq/attention/reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace kvq::attention {

Status reference_attention(const DenseShape& s, const float* k, const float* v, const float* q, int n_q,
                           int q_pos0, double softmax_scale, double* out, double* lse) {
  if (s.n_tokens < 1 || s.num_kv_heads < 1 || s.head_dim < 1 || s.num_q_heads < 1 ||
      s.num_q_heads % s.num_kv_heads != 0)
    return invalid_argument("reference_attention: bad shape (tokens " + std::to_string(s.n_tokens) +
                            ", kv heads " + std::to_string(s.num_kv_heads) + ", q heads " +
                            std::to_string(s.num_q_heads) + ", head_dim " + std::to_string(s.head_dim) + ")");
  if (n_q < 1 || q_pos0 < 0 || q_pos0 + n_q > s.n_tokens)
    return invalid_argument("reference_attention: queries [" + std::to_string(q_pos0) + ", " +
                            std::to_string(q_pos0 + n_q) + ") do not fit in " + std::to_string(s.n_tokens) +
                            " tokens");
  if (!k || !v || !q || !out) return invalid_argument("reference_attention: null pointer");
  const int d = s.head_dim, group = s.num_q_heads / s.num_kv_heads;
  const size_t tok_stride = static_cast<size_t>(s.num_kv_heads) * d;
  std::vector<double> logit(s.n_tokens);
  for (int i = 0; i < n_q; ++i) {
    const int n_vis = q_pos0 + i + 1;
    for (int h = 0; h < s.num_q_heads; ++h) {
      const int g = h / group;
      const float* qh = q + (static_cast<size_t>(i) * s.num_q_heads + h) * d;
      double m = -INFINITY;
      for (int t = 0; t < n_vis; ++t) {
        const float* kt = k + t * tok_stride + static_cast<size_t>(g) * d;
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += static_cast<double>(qh[c]) * kt[c];
        logit[t] = softmax_scale * acc;
        m = std::max(m, logit[t]);
      }
      double* o = out + (static_cast<size_t>(i) * s.num_q_heads + h) * d;
      std::fill(o, o + d, 0.0);
      double l = 0;
      for (int t = 0; t < n_vis; ++t) {
        const double p = std::exp(logit[t] - m);
        l += p;
        const float* vt = v + t * tok_stride + static_cast<size_t>(g) * d;
        for (int c = 0; c < d; ++c) o[c] += p * vt[c];
      }
      for (int c = 0; c < d; ++c) o[c] /= l;
      if (lse) lse[static_cast<size_t>(i) * s.num_q_heads + h] = m + std::log(l);
    }
  }
  return Status::ok();
}

}  // namespace kvq::attention
