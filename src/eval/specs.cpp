#include "kvq/eval/specs.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "kvq/eval/gate.h"

namespace kvq::eval {

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  auto flush = [&] {
    size_t b = cur.find_first_not_of(" \t"), e = cur.find_last_not_of(" \t");
    if (b != std::string::npos) out.push_back(cur.substr(b, e - b + 1));
    cur.clear();
  };
  for (char c : s) {
    if (c == ',') flush();
    else cur += c;
  }
  flush();
  return out;
}

namespace {

std::vector<std::string> split_colon(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t p = s.find(':', start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) return out;
    start = p + 1;
  }
}

// "sink256" / "b32" -> the number; false when `s` is not prefix + digits.
bool parse_prefixed_int(const std::string& s, const std::string& prefix, int* out) {
  if (s.size() <= prefix.size() || s.compare(0, prefix.size(), prefix) != 0) return false;
  const std::string digits = s.substr(prefix.size());
  if (digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); }))
    return false;
  *out = std::atoi(digits.c_str());
  return true;
}

}  // namespace

Result<std::vector<SpecRequest>> parse_spec_list(const SpecListOptions& o) {
  const std::vector<std::string> entries = split_csv(o.kv_cache_dtypes);
  if (entries.empty()) return invalid_argument("--kv-cache-dtype lists no cache dtype");
  std::vector<std::string> grans = split_csv(o.granularities);
  if (grans.empty()) return invalid_argument("--kv-scale-granularity lists no granularity");
  for (const auto& g : grans) {
    auto pg = parse_granularity(g);
    if (!pg.is_ok()) return invalid_argument("--kv-scale-granularity: " + pg.status().message());
  }

  {
    // The settings every entry shares are checked once, so their errors name the flag alone.
    QuantOptions base;
    base.kv_cache_dtype = "bf16";
    base.scale_dtype = o.scale_dtype;
    base.block_size = o.block_size;
    base.sink_tokens = o.sink_tokens;
    base.rotate = o.rotate;
    base.recent_tokens = o.recent_tokens;
    auto checked = parse_quant_spec(base);
    if (!checked.is_ok()) return checked.status();
  }

  std::vector<SpecRequest> out;
  auto add = [&](SpecRequest r) {
    for (const auto& e : out) {
      if (e.is_auto != r.is_auto) continue;
      if (o.distinct_block_sizes && e.spec.block_size != r.spec.block_size) continue;
      // An auto request is identified by its candidates (its own spec is only their settings).
      if (r.is_auto ? same_cache(e.auto_chain.front(), r.auto_chain.front()) : same_cache(e.spec, r.spec)) return;
    }
    out.push_back(std::move(r));
  };

  for (const auto& entry : entries) {
    std::vector<std::string> parts = split_colon(entry);
    const std::string dtype = parts[0];
    QuantOptions qo;
    qo.kv_cache_dtype = dtype == "auto" ? "bf16" : dtype;  // auto's own format comes from its chain
    qo.scale_dtype = o.scale_dtype;
    qo.block_size = o.block_size;
    qo.sink_tokens = o.sink_tokens;
    qo.rotate = o.rotate;
    qo.recent_tokens = o.recent_tokens;
    std::string inline_gran;
    for (size_t i = 1; i < parts.size(); ++i) {
      const std::string& p = parts[i];
      int v = 0;
      if (parse_prefixed_int(p, "sink", &v)) qo.sink_tokens = v;
      else if (parse_prefixed_int(p, "recent", &v)) qo.recent_tokens = v;
      else if (parse_prefixed_int(p, "b", &v)) qo.block_size = v;
      else if (parse_granularity(p).is_ok()) inline_gran = p;
      else if (parse_rotation(p).is_ok()) qo.rotate = p;
      else if (p == "fp16_scales" || p == "fp32_scales") qo.scale_dtype = p.substr(0, 4);
      else
        return invalid_argument("--kv-cache-dtype entry '" + entry + "': unknown option '" + p +
                                "' (expected a granularity such as per_tensor, sinkN, recentN, bN, hadamard or fp16_scales)");
    }
    const std::vector<std::string> use = inline_gran.empty() ? grans : std::vector<std::string>{inline_gran};
    for (const auto& g : use) {
      qo.granularity = g;
      auto spec = parse_quant_spec(qo);
      if (!spec.is_ok())
        return invalid_argument("--kv-cache-dtype entry '" + entry + "': " + spec.status().message());
      SpecRequest r;
      r.spec = spec.value();
      r.label = entry;
      if (inline_gran.empty() && grans.size() > 1 && (dtype == "auto" || r.spec.quantized())) r.label += ":" + g;
      if (dtype == "auto") {
        r.is_auto = true;
        r.auto_chain = auto_fallback_chain(r.spec, o.auto_first);
      }
      const bool expands = r.is_auto || r.spec.quantized();  // bf16/fp16 have no granularity
      add(std::move(r));
      if (!expands) break;
    }
  }
  return out;
}

}  // namespace kvq::eval
