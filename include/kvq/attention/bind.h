#pragma once
// Attention arguments bound to a host PagedKvCache (the usual caller: tests, benchmarks, the CPU
// engine). `tables` must outlive the returned args; they point into it.
#include "kvq/attention/args.h"
#include "kvq/cache/paged_cache.h"

namespace kvq::attention {

inline DecodeArgs bind_decode(cache::PagedKvCache& c, int layer, const cache::PagedKvCache::BatchTables& tables,
                              const float* q, float* out, int num_q_heads, float softmax_scale,
                              float* lse = nullptr) {
  DecodeArgs a;
  a.geom = c.layer_geometry(layer);
  a.layer = c.layer_view(layer);
  a.tables = tables.view();
  a.q = q;
  a.out = out;
  a.lse = lse;
  a.num_q_heads = num_q_heads;
  a.softmax_scale = softmax_scale;
  return a;
}

inline PrefillArgs bind_prefill(cache::PagedKvCache& c, int layer, const cache::PagedKvCache::BatchTables& tables,
                                const float* q, float* out, int n_q, int q_pos0, int num_q_heads,
                                float softmax_scale, float* lse = nullptr) {
  PrefillArgs a;
  a.geom = c.layer_geometry(layer);
  a.layer = c.layer_view(layer);
  a.tables = tables.view();
  a.q = q;
  a.out = out;
  a.n_q = n_q;
  a.q_pos0 = q_pos0;
  a.num_q_heads = num_q_heads;
  a.softmax_scale = softmax_scale;
  a.lse = lse;
  return a;
}

}  // namespace kvq::attention
