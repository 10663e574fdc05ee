#include "kvq/quant/layer_config.h"

#include <nlohmann/json.hpp>

#include "kvq/common/file_io.h"

namespace kvq {
namespace {

using nlohmann::json;

Result<Format> plane_dtype(const json& entry, const char* key, size_t layer, const std::string& origin) {
  const std::string where = origin + ": layers[" + std::to_string(layer) + "]";
  if (!entry.is_object()) return invalid_argument(where + " must be an object like {\"k\": \"int8\", \"v\": \"fp8\"}");
  auto it = entry.find(key);
  if (it == entry.end() || !it->is_string())
    return invalid_argument(where + " has no \"" + key + "\" dtype string (bf16, fp16, fp8, fp8_e4m3, fp8_fnuz, int8, int4)");
  const std::string name = it->get<std::string>();
  if (name == "auto") return invalid_argument(where + "." + key + ": auto is not a storage dtype here; name one");
  if (name == "int4_outlier")  // its outlier side planes and statistics are per cache, not per plane
    return unsupported(where + "." + key + ": int4_outlier is not available per layer; use int4");
  auto f = parse_kv_cache_dtype(name);
  if (!f.is_ok()) return Status(f.status().code(), where + "." + key + ": " + f.status().message());
  return f.value();
}

}  // namespace

Result<KvConfig> parse_kv_config(std::string_view json_text, const std::string& origin) {
  const json j = json::parse(json_text.begin(), json_text.end(), nullptr, false);
  if (j.is_discarded()) return invalid_argument(origin + " is not valid JSON");
  if (!j.is_object()) return invalid_argument(origin + ": expected a JSON object with a \"layers\" array");
  KvConfig cfg;
  if (auto m = j.find("model"); m != j.end() && m->is_string()) cfg.model = m->get<std::string>();
  auto layers = j.find("layers");
  if (layers == j.end() || !layers->is_array() || layers->empty())
    return invalid_argument(origin + ": needs a non-empty \"layers\" array, one {\"k\": ..., \"v\": ...} per layer");
  for (size_t l = 0; l < layers->size(); ++l) {
    for (const char* key : {"k", "v"}) {
      auto f = plane_dtype((*layers)[l], key, l, origin);
      if (!f.is_ok()) return f.status();
      cfg.plane_formats.push_back(f.value());
    }
  }
  return cfg;
}

Result<KvConfig> read_kv_config(const std::string& path) {
  auto text = read_file(path, 16u << 20, "--kv-config file");
  if (!text.is_ok()) return text.status();
  return parse_kv_config(text.value(), path);
}

std::string kv_config_json(const KvConfig& cfg, const std::string& extra) {
  // Written by hand so that each layer sits on one line: the file is meant to be read and edited.
  std::string s = "{\n  \"model\": " + json(cfg.model).dump() + ",\n  \"layers\": [\n";
  for (size_t l = 0; l * 2 + 1 < cfg.plane_formats.size(); ++l) {
    s += "    {\"k\": \"" + std::string(format_name(cfg.plane_formats[2 * l])) + "\", \"v\": \"" +
         format_name(cfg.plane_formats[2 * l + 1]) + "\"}";
    s += l * 2 + 3 < cfg.plane_formats.size() ? ",\n" : "\n";
  }
  s += "  ]";
  if (!extra.empty()) {
    const json e = json::parse(extra, nullptr, false);
    if (e.is_object())
      for (auto it = e.begin(); it != e.end(); ++it) s += ",\n  " + json(it.key()).dump() + ": " + it.value().dump();
  }
  return s + "\n}\n";
}

}  // namespace kvq
