#pragma once
// The per-layer cache config file (--kv-config; written by `kvq eval --search`):
//   {"model": "SmolLM2-135M", "layers": [{"k": "int8", "v": "fp8_e4m3"}, ...]}
// one entry per layer in order; dtypes as --kv-cache-dtype spells them (auto excluded). Other keys
// (the search's measurements) are kept for the reader and ignored here.
#include <string>
#include <string_view>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/quant/spec.h"

namespace kvq {

struct KvConfig {
  std::string model;                 // informational; "" when absent
  std::vector<Format> plane_formats; // [2 * layer + kv], as QuantSpec::plane_formats
};

// Errors (kInvalidArgument) name `origin` (the file) and the entry: malformed JSON, no "layers"
// array, an entry without "k"/"v", an unknown dtype (the accepted ones listed).
Result<KvConfig> parse_kv_config(std::string_view json_text, const std::string& origin);
Result<KvConfig> read_kv_config(const std::string& path);
// The file text for `cfg` (stable key order, one layer per line); `extra` (a JSON object's text,
// may be empty) is merged in as further top-level keys.
std::string kv_config_json(const KvConfig& cfg, const std::string& extra = "");

}  // namespace kvq
