#pragma once
// Synthetic KV with the statistics that make KV quantization hard (a few K channels per head
// 20-100x larger than the rest, as in real models; V milder), and a builder that writes it into a
// PagedKvCache with the page order scrambled. Used by the attention tests (CPU and CUDA), the CPU
// benchmark and `kvq report`.
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "kvq/cache/paged_cache.h"
#include "kvq/common/status.h"
#include "kvq/quant/spec.h"

namespace kvq::attention {

struct HeavyTailOptions {
  int num_kv_heads = 8;
  int head_dim = 128;
  int k_outlier_channels = 4;  // per kv head
  float k_outlier_min = 20.f, k_outlier_max = 100.f;
  int v_outlier_channels = 2;
  float v_outlier_min = 2.f, v_outlier_max = 5.f;
};

// Per-channel statistics of one layer: value = gain * (mean + N(0, 1)). Outlier channels keep
// their sign and size across tokens and sequences, as in real models.
struct KvProfile {
  int num_kv_heads = 0, head_dim = 0;
  std::vector<float> k_gain, k_mean, v_gain, v_mean;  // [num_kv_heads][head_dim]
};

Result<KvProfile> make_kv_profile(const HeavyTailOptions& opts, uint64_t seed);

// k, v: [n_tokens][num_kv_heads][head_dim].
void sample_kv(const KvProfile& p, int n_tokens, std::mt19937_64& rng, float* k, float* v);

// Queries [n][num_q_heads][head_dim], isotropic, with a gain per kv head chosen so that
// softmax_scale * q.k has a standard deviation of about `logit_std` over tokens (real attention
// is neither uniform nor one-hot; 1.5-3 is typical).
void sample_queries(const KvProfile& p, int num_q_heads, int n, float softmax_scale, float logit_std,
                    std::mt19937_64& rng, float* q);

struct SyntheticCacheOptions {
  QuantSpec spec;               // format, granularity, block size, default sink
  HeavyTailOptions kv;          // heads, head_dim and outliers
  int num_layers = 1;
  std::vector<int> seq_lens;    // one sequence each (>= 1 token)
  std::vector<int> sink_tokens; // per sequence, as add_sequence() takes it; empty = spec default
  uint64_t seed = 0;
  // Interleave the sequences' extend/write calls in random chunks of 1..max_chunk tokens and
  // allocate-then-free filler pages between them, so block tables are non-contiguous with free
  // pages ("holes") between live ones. false: each sequence is written in one call, in order.
  bool shuffle = true;
  int max_chunk = 48;
  // When shuffling, the very first write is this many tokens (at most its length) of the longest
  // sequence, like a served prompt. It matters for per_tensor, whose scales the first write fixes.
  int prompt_tokens = 192;
  int spare_pages = 8;          // extra pages in each pool, used as holes when shuffling
};

struct SyntheticCache {
  std::unique_ptr<cache::PagedKvCache> cache;
  std::vector<cache::SeqId> seqs;
  std::vector<KvProfile> profiles;  // [layer]
  // The values as written (before quantization): k[layer][seq] is [len][num_kv_heads][head_dim].
  std::vector<std::vector<std::vector<float>>> k, v;
};

Result<SyntheticCache> build_synthetic_cache(const SyntheticCacheOptions& opts);

}  // namespace kvq::attention
