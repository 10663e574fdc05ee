#pragma once
// Dense float64 attention over contiguous K/V: the oracle the backends' tests and the synthetic
// report compare against. Deliberately shares no code with the backends (one plain softmax, no
// parts, no paging), so a bug in either cannot hide in both.
#include "kvq/common/status.h"

namespace kvq::attention {

struct DenseShape {
  int n_tokens = 0;      // tokens of K/V
  int num_kv_heads = 0;
  int num_q_heads = 0;   // a multiple of num_kv_heads (GQA)
  int head_dim = 0;
};

// k, v: [n_tokens][num_kv_heads][head_dim]; q: [n_q][num_q_heads][head_dim].
// Query i sits at position q_pos0 + i and sees tokens [0, q_pos0 + i] (causal); decode is n_q = 1,
// q_pos0 = n_tokens - 1. out: [n_q][num_q_heads][head_dim]; lse (may be null): [n_q][num_q_heads],
// natural log of sum exp(softmax_scale * q.k).
Status reference_attention(const DenseShape& shape, const float* k, const float* v, const float* q, int n_q,
                           int q_pos0, double softmax_scale, double* out, double* lse);

}  // namespace kvq::attention
