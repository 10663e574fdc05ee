#pragma once
// The synthetic accuracy report (`kvq report`): for every storable format x scale granularity, the
// quantization error of K and V and the resulting decode-attention error against float64, on
// heavy-tailed synthetic KV (kvq/attention/synthetic.h), with the real bytes per token. It needs no
// model, so it is the accuracy evidence until the end-to-end eval exists, and a quick regression
// check afterwards.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/attention/synthetic.h"
#include "kvq/common/status.h"
#include "kvq/format/format.h"
#include "kvq/quant/spec.h"

namespace kvq::eval {

struct SyntheticReportOptions {
  uint64_t seed = 1;
  attention::HeavyTailOptions kv{8, 128};      // Hkv 8, D 128, default outliers
  int num_q_heads = 32;
  std::vector<int> seq_lens = {4096, 2048, 1024, 512};
  int block_size = 16;
  int sink_tokens = 0;       // 0: the formats alone
  int queries_per_seq = 2;   // independent decode queries per sequence
  float logit_std = 2.f;     // spread of softmax_scale * q.k over tokens
  // Each sequence is written like a served one: prefill in chunks of `prefill_chunk`, then its last
  // `decode_tokens` tokens one at a time (per_block_head re-quantizes pages as they grow).
  int prefill_chunk = 512;
  int decode_tokens = 64;
};

struct SyntheticRow {
  Format format = Format::kBf16;
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;  // meaningless for bf16/fp16
  double k_rel_err = 0, v_rel_err = 0;  // ||dequant - x|| / ||x|| over every stored value
  double attn_rel_err = 0;              // ||out - ref|| / ||ref|| over all sequences, queries, heads
  double attn_rel_err_worst = 0;        // worst single (sequence, query, head)
  double lse_max_abs_err = 0;
  uint64_t saturated = 0;               // values clipped at write (per_tensor only)
  uint64_t requantized_page_heads = 0;  // per_block_head growth events
  size_t bytes_per_token_d64 = 0;       // one layer, K + V, num_kv_heads heads, scales included
  size_t bytes_per_token_d128 = 0;
};

struct SyntheticReport {
  SyntheticReportOptions options;
  std::vector<SyntheticRow> rows;  // bf16 first, then fp8_e4m3, fp8_e4m3_fnuz, int8 x granularity
  double seconds = 0;
};

Result<SyntheticReport> run_synthetic_report(const SyntheticReportOptions& opts);

std::string format_synthetic_report(const SyntheticReport& r);  // human-readable table
std::string synthetic_report_json(const SyntheticReport& r);    // the same, as a JSON document

}  // namespace kvq::eval
