// libFuzzer target: the cache-spec parsers: parse_kv_cache_dtype, parse_granularity,
// parse_quant_spec (vLLM-style options) and eval's spec list ("fp8:per_tensor:sink0:b32,...").
// The input is split at '\n' into dtype, granularity, scale dtype and spec list; two int32 from
// its last 8 bytes are the block size and the sink size.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "kvq/eval/specs.h"
#include "kvq/quant/spec.h"

using namespace kvq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int32_t ints[2] = {16, 256};
  if (size >= 8) {
    std::memcpy(ints, data + size - 8, 8);
    size -= 8;
  }
  std::vector<std::string> f;
  std::string cur;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') {
      f.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  f.push_back(cur);
  f.resize(4);

  (void)parse_kv_cache_dtype(f[0]);
  (void)parse_granularity(f[1]);
  QuantOptions o;
  o.kv_cache_dtype = f[0];
  o.granularity = f[1];
  o.scale_dtype = f[2];
  o.block_size = ints[0];
  o.sink_tokens = ints[1];
  auto spec = parse_quant_spec(o, Format::kFp8E4m3);
  if (spec.is_ok()) {
    KVQ_FUZZ_CHECK(spec.value().block_size == 16 || spec.value().block_size == 32);
    KVQ_FUZZ_CHECK(spec.value().sink_tokens >= 0 && spec.value().sink_tokens <= kMaxSinkTokens);
    (void)spec.value().to_string();
  } else {
    KVQ_FUZZ_CHECK(!spec.status().message().empty());
  }
  eval::SpecListOptions so;
  so.kv_cache_dtypes = f[3];
  so.granularities = f[1].empty() ? "per_token_head" : f[1];
  so.block_size = ints[0];
  so.sink_tokens = ints[1];
  auto list = eval::parse_spec_list(so);
  if (list.is_ok()) {
    for (const auto& r : list.value()) {
      KVQ_FUZZ_CHECK(r.spec.block_size == 16 || r.spec.block_size == 32);
      KVQ_FUZZ_CHECK(r.spec.sink_tokens >= 0 && r.spec.sink_tokens <= kMaxSinkTokens);
      KVQ_FUZZ_CHECK(r.spec.recent_tokens >= 0 && r.spec.recent_tokens <= kMaxSinkTokens);  // "recentN" entries
    }
  } else {
    KVQ_FUZZ_CHECK(!list.status().message().empty());
  }
  return 0;
}
