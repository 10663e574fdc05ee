#pragma once
// QuantSpec: how the KV cache is stored, parsed from vLLM-style options.
#include <string>
#include <string_view>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/format/format.h"

namespace kvq {

enum class ScaleGranularity : uint8_t {
  kPerTensor,     // one scale per layer (K and V each), set by the first write; the rejected baseline
  kPerTokenHead,  // one scale per (token, kv head), amax/qmax at write time
  kPerBlockHead,  // one scale per (page, kv head); grows (re-quantizing the page head) on demand
};

// Type of the stored scales: fp16 halves the scale bytes (quant/policy.h: rounded up, clamped).
enum class ScaleDtype : uint8_t { kFp32, kFp16 };

// A fixed orthogonal transform applied per head to K (before it is quantized) and to Q (so q·k is
// unchanged up to rounding); V is stored as is. Hadamard spreads a few large K channels over all
// of them, which shrinks per-(token, head) amax relative to the typical value.
enum class KvRotation : uint8_t { kNone, kHadamard };

const char* rotation_name(KvRotation r);             // "none" | "hadamard"
Result<KvRotation> parse_rotation(std::string_view s);

// int4_kivi's recent window when --kv-recent-tokens is not given (or 0): KIVI's residual length.
inline constexpr int kKiviDefaultRecentTokens = 128;

// Largest sink a spec may ask for; keeps page arithmetic far from int overflow.
inline constexpr int kMaxSinkTokens = 1 << 24;

const char* granularity_name(ScaleGranularity g);

struct QuantSpec {
  Format format = Format::kBf16;
  bool from_auto = false;  // true when --kv-cache-dtype auto chose `format`
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  ScaleDtype scale_dtype = ScaleDtype::kFp32;
  int block_size = 16;     // tokens per page: 16 or 32
  int sink_tokens = 256;   // first N tokens of each sequence kept in bf16; 0 disables
                           // (0 ..= kMaxSinkTokens)
  KvRotation rotation = KvRotation::kNone;  // applies to every format (bf16 included)
  // Per-layer, per-K/V formats (--kv-config): empty means every plane stores `format`; otherwise
  // plane_formats[2 * layer + kv] (kv 0 = K, 1 = V) for every layer of the model, and `format` is
  // not used for the pages. Granularity, block, sink, scale dtype and rotation stay global.
  std::vector<Format> plane_formats;
  // int4_outlier: int4 per_token_head codes plus a per-page sparse fp16 plane (quant/outlier.h).
  bool outliers = false;
  // The last R tokens of each sequence are attended in bf16 (KIVI's residual window): a query at
  // position t reads key j from a bf16 copy iff j >= t + 1 - R, else from the stored codes. 0 = off;
  // a no-op for unquantized formats (0 ..= kMaxSinkTokens).
  int recent_tokens = 0;

  bool mixed() const { return !plane_formats.empty(); }
  Format plane_format(int layer, int kv) const {
    return plane_formats.empty() ? format : plane_formats[static_cast<size_t>(2 * layer + kv)];
  }
  // Whether any plane is quantized (has scales).
  bool quantized() const;
  // e.g. "fp8_e4m3/per_token_head/b16/sink256"; unquantized formats omit the granularity
  // ("bf16/b16/sink0"); a recent window of a quantized format and a rotation are appended
  // ("int8/per_token_head/b16/sink256/recent128/hadamard").
  // A per-layer mix shows as "mixed:<planes>x<fnv32 of the formats, hex>" in place of the format,
  // e.g. "mixed:60x1a2b3c4d/per_token_head/b16/sink256".
  std::string to_string() const;
};

// Refuses a per-layer mix that does not cover exactly `num_layers` layers (kInvalidArgument naming
// both counts) or names a format the cache cannot store (kUnsupported). A uniform spec passes.
Status check_plane_formats(const QuantSpec& spec, int num_layers);

// Strings as the user typed them on the command line.
struct QuantOptions {
  std::string kv_cache_dtype = "auto";  // auto|bf16|fp16|fp8|fp8_e4m3|fp8_fnuz|int8|int4|int4_outlier|int4_kivi
  std::string granularity = "per_token_head";
  std::string scale_dtype = "fp32";
  int block_size = 16;
  int sink_tokens = 256;
  std::string rotate = "none";  // none | hadamard
  int recent_tokens = 0;        // --kv-recent-tokens
};

// `auto_format` is what `auto` resolves to on this machine (see hardware probe, DESIGN §7).
// Accepted values (anything else is kInvalidArgument naming the accepted ones):
//   kv_cache_dtype: auto | bf16 (bfloat16) | fp16 (float16) | fp8 == fp8_e4m3 (OCP) |
//                   fp8_fnuz (== fp8_e4m3_fnuz, AMD) | int8 | int4 | int4_outlier (int4 + outliers,
//                   per_token_head only) | int4_kivi (K per channel of a page, V per token, asymmetric,
//                   fp16 scale + zero point: scale_dtype becomes fp16; needs the recent window: R 0
//                   means kKiviDefaultRecentTokens, R < block_size is kInvalidArgument; granularity
//                   other than the default per_token_head is kInvalidArgument);  fp8_e5m2 -> kUnsupported
//   granularity:    per_tensor | per_token_head | per_block_head
//   scale_dtype:    fp32 (float32) | fp16 (float16)
//   block_size:     16 | 32;   sink_tokens, recent_tokens: 0 ..= kMaxSinkTokens;   rotate: none | hadamard
Result<QuantSpec> parse_quant_spec(const QuantOptions& opts, Format auto_format = Format::kInt8);

// "fp8" -> fp8_e4m3, "fp8_fnuz" -> fp8_e4m3_fnuz, ...; "auto" is kInvalidArgument here.
Result<Format> parse_kv_cache_dtype(std::string_view s);
Result<ScaleGranularity> parse_granularity(std::string_view s);

}  // namespace kvq
