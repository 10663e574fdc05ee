#pragma once
// Operator arguments shared by every attention backend (DESIGN §5, CUTLASS-style contract:
// Args / can_implement / workspace_size / plan / run -> Status).
#include <cstdint>

#include "kvq/cache/layout.h"

namespace kvq::attention {

// Decode: one query token per sequence, GQA (num_q_heads a multiple of num_kv_heads).
struct DecodeArgs {
  cache::CacheGeometry geom;
  cache::LayerView layer;         // one layer's planes
  cache::BatchTablesView tables;  // num_seqs sequences
  const float* q = nullptr;       // [num_seqs][num_q_heads][head_dim]
  float* out = nullptr;           // [num_seqs][num_q_heads][head_dim]
  float* lse = nullptr;           // optional [num_seqs][num_q_heads], natural-log LSE of scaled logits
  int num_q_heads = 0;
  float softmax_scale = 0.f;      // usually 1/sqrt(head_dim)
};

// Prefill: n_q query tokens of one sequence at positions [q_pos0, q_pos0 + n_q), causal, attending
// over the cached prefix plus themselves. Their K/V must already be written to the cache.
struct PrefillArgs {
  cache::CacheGeometry geom;
  cache::LayerView layer;
  cache::BatchTablesView tables;  // exactly one sequence; seq_lens[0] >= q_pos0 + n_q
  const float* q = nullptr;       // [n_q][num_q_heads][head_dim]
  float* out = nullptr;           // [n_q][num_q_heads][head_dim]
  int n_q = 0;
  int q_pos0 = 0;
  int num_q_heads = 0;
  float softmax_scale = 0.f;
  float* lse = nullptr;           // optional [n_q][num_q_heads], as DecodeArgs::lse
};

}  // namespace kvq::attention
