#pragma once
// The list of cache specs one `kvq eval` compares, from vLLM-style options:
//   --kv-cache-dtype bf16,fp8,fp8_fnuz,int8,fp8:per_tensor,auto  --kv-scale-granularity g1,g2
// An entry may carry its own options after colons, in any order: a granularity name, `sinkN`
// (bf16 sink tokens), `recentN` (bf16 recent window), `bN` (block size) and a rotation (`hadamard`,
// `none`), e.g. `int8:per_block_head:sink0`, `fp8:recent128` or `int8:hadamard`. Entries without an
// inline granularity are expanded over every --kv-scale-granularity value.
#include <string>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/quant/spec.h"

namespace kvq::eval {

struct SpecRequest {
  std::string label;              // the entry as it will be shown ("fp8:per_tensor", "auto")
  QuantSpec spec;                 // for auto: the settings its candidates share
  bool is_auto = false;
  std::vector<QuantSpec> auto_chain;  // auto only: candidates in order (see gate.h)
};

struct SpecListOptions {
  std::string kv_cache_dtypes = "bf16,fp8,fp8_fnuz,int8";
  std::string granularities = "per_token_head";
  std::string scale_dtype = "fp32";
  int block_size = 16;
  int sink_tokens = 256;
  std::string rotate = "none";  // --kv-rotate: every entry's rotation unless the entry names one
  int recent_tokens = 0;        // --kv-recent-tokens: every entry's window unless the entry names one
  Format auto_first = Format::kFp8E4m3;  // where auto's fallback chain starts
  // Accuracy treats bf16 caches of any block size as one (their numbers are the same); a speed
  // benchmark does not (the kernels page differently), so it keeps entries that differ in block size.
  bool distinct_block_sizes = false;
};

// Duplicates (same cache layout) are dropped, keeping the first. Errors name the bad entry.
Result<std::vector<SpecRequest>> parse_spec_list(const SpecListOptions& opts);

// "a,b, c" -> {"a","b","c"}; empty items are dropped.
std::vector<std::string> split_csv(const std::string& s);

}  // namespace kvq::eval
