#pragma once
// KV memory from the cache geometry (cache::bytes_per_page; no hand arithmetic): what one sequence
// of a given length costs with a spec (quantized main pages with their scales, plus the bf16
// sink), how many such sequences a budget holds, and how a KV budget becomes the two page pools
// of a serving engine.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/quant/spec.h"

namespace kvq::serve {

struct KvGeometry {
  std::string name;
  int num_layers = 0, num_kv_heads = 0, head_dim = 0, num_q_heads = 0;
};
// The design's 27B-class model: 46 layers, 16 KV heads of 128, 32 query heads.
KvGeometry geometry_27b_class();

struct SequenceKv {
  int64_t main_pages = 0, sink_pages = 0;
  size_t main_bytes = 0;  // codes + scales of the main pages, all layers, K and V
  size_t sink_bytes = 0;  // bf16 sink pages, all layers, K and V
  size_t total() const { return main_bytes + sink_bytes; }
};
// One sequence of `tokens` tokens: its first min(tokens, sink) tokens in bf16 sink pages, the rest
// in main pages of `spec` (whole pages each). kInvalidArgument for a geometry the cache refuses.
Result<SequenceKv> sequence_kv(const QuantSpec& spec, const KvGeometry& g, int64_t tokens);

struct CapacityRow {
  QuantSpec spec;
  SequenceKv seq;
  double bytes_per_token = 0;      // seq.total() / tokens
  double saved_vs_baseline = 0;    // baseline.total() - seq.total(), bytes
  double ratio_vs_baseline = 0;    // seq.total() / baseline.total()
  int64_t seqs_in_budget = 0;      // whole sequences of `tokens` that fit `budget_bytes` (0: no budget)
  double seqs_vs_baseline = 0;     // seqs_in_budget / the baseline's
};
// Rows for each spec against the first (the baseline, normally bf16).
Result<std::vector<CapacityRow>> capacity_table(const std::vector<QuantSpec>& specs, const KvGeometry& g,
                                                int64_t tokens, size_t budget_bytes = 0);
std::string capacity_markdown(const std::vector<CapacityRow>& rows, const KvGeometry& g, int64_t tokens,
                              size_t budget_bytes);

// The page pools of a serving engine for a KV budget: a full sink for each of `max_seqs`
// sequences (bf16) and, with a recent window (spec.recent_tokens, quantized formats), a full window
// of bf16 twin pages for each (cache::PagedKvCache::recent_pages_per_sequence with `chunk_tokens`),
// the rest main pages of `spec`. Both reserves are per admitted sequence, so the scheduler's page
// budget (main and sink pages) needs no window term. kInvalidArgument (saying what to raise or
// lower) when the budget cannot hold the reserves plus one sequence of `max_model_len` tokens.
struct KvPools {
  int num_pages = 0, num_sink_pages = 0, num_recent_pages = 0;
  size_t main_bytes = 0, sink_bytes = 0, recent_bytes = 0;
};
Result<KvPools> plan_kv_pools(const QuantSpec& spec, const KvGeometry& g, int max_seqs, int max_model_len,
                              size_t budget_bytes, int chunk_tokens = 128);

}  // namespace kvq::serve
