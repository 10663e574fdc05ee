#pragma once
// QuantSpec: how the KV cache is stored, parsed from vLLM-style options.
#include <string>
#include <string_view>

#include "kvq/common/status.h"
#include "kvq/format/format.h"

namespace kvq {

enum class ScaleGranularity : uint8_t {
  kPerTensor,     // one scale per layer (K and V each), set by the first write; the rejected baseline
  kPerTokenHead,  // one scale per (token, kv head), amax/qmax at write time
  kPerBlockHead,  // one scale per (page, kv head); grows (re-quantizing the page head) on demand
};

enum class ScaleDtype : uint8_t { kFp32, kFp16 };

const char* granularity_name(ScaleGranularity g);

struct QuantSpec {
  Format format = Format::kBf16;
  bool from_auto = false;  // true when --kv-cache-dtype auto chose `format`
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  ScaleDtype scale_dtype = ScaleDtype::kFp32;
  int block_size = 16;     // tokens per page: 16 or 32
  int sink_tokens = 256;   // first N tokens of each sequence kept in bf16; 0 disables

  bool quantized() const { return is_quantized(format); }
  std::string to_string() const;  // e.g. "fp8_e4m3/per_token_head/b16/sink256"
};

// Strings as the user typed them on the command line.
struct QuantOptions {
  std::string kv_cache_dtype = "auto";  // auto|bf16|fp16|fp8|fp8_e4m3|fp8_fnuz|int8
  std::string granularity = "per_token_head";
  std::string scale_dtype = "fp32";
  int block_size = 16;
  int sink_tokens = 256;
};

// `auto_format` is what `auto` resolves to on this machine (see hardware probe, DESIGN §7).
Result<QuantSpec> parse_quant_spec(const QuantOptions& opts, Format auto_format = Format::kInt8);

// "fp8" -> fp8_e4m3, "fp8_fnuz" -> fp8_e4m3_fnuz, ...; "auto" is kInvalidArgument here.
Result<Format> parse_kv_cache_dtype(std::string_view s);
Result<ScaleGranularity> parse_granularity(std::string_view s);

}  // namespace kvq
