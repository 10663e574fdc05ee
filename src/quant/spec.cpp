#include "kvq/quant/spec.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace kvq {
namespace {

constexpr const char* kDtypeChoices = "auto, bf16, fp16, fp8, fp8_e4m3, fp8_fnuz, int8, int4, int4_outlier, int4_kivi";
constexpr const char* kGranularityChoices = "per_tensor, per_token_head, per_block_head";

Status check_storable(Format f, std::string_view origin) {
  if (!format_traits(f).cache_ready) {
    return unsupported(std::string(format_name(f)) + " KV cache not implemented yet (" + std::string(origin) +
                       "); use --kv-cache-dtype int8 or fp8");
  }
  return Status::ok();
}

// int4_kivi groups K per channel over a page, so a page is quantized only once it is complete and
// no query reads it in bf16 any more: the recent window is part of the format.
Status apply_kivi_rules(const QuantOptions& opts, QuantSpec& spec) {
  if (spec.granularity != ScaleGranularity::kPerTokenHead)
    return invalid_argument("--kv-cache-dtype int4_kivi groups K per channel of a page and V per token by itself; "
                            "drop --kv-scale-granularity " + opts.granularity);
  spec.scale_dtype = ScaleDtype::kFp16;  // its scales and zero points are fp16 (quant/kivi_policy.h)
  if (spec.recent_tokens == 0) spec.recent_tokens = kKiviDefaultRecentTokens;
  if (spec.recent_tokens < spec.block_size)
    return invalid_argument("--kv-cache-dtype int4_kivi quantizes a page once its first token leaves the bf16 recent "
                            "window, so the window must hold at least a page: --kv-recent-tokens " +
                            std::to_string(spec.recent_tokens) + " is below --block-size " +
                            std::to_string(spec.block_size) + "; use --kv-recent-tokens " +
                            std::to_string(kKiviDefaultRecentTokens) + " (the default for int4_kivi) or at least " +
                            std::to_string(spec.block_size));
  return Status::ok();
}

}  // namespace

const char* granularity_name(ScaleGranularity g) {
  switch (g) {
    case ScaleGranularity::kPerTensor: return "per_tensor";
    case ScaleGranularity::kPerTokenHead: return "per_token_head";
    case ScaleGranularity::kPerBlockHead: return "per_block_head";
  }
  return "?";
}

const char* rotation_name(KvRotation r) {
  return r == KvRotation::kHadamard ? "hadamard" : "none";
}

Result<KvRotation> parse_rotation(std::string_view s) {
  if (s == "none") return KvRotation::kNone;
  if (s == "hadamard") return KvRotation::kHadamard;
  return invalid_argument("unknown --kv-rotate '" + std::string(s) + "'; accepted: none, hadamard");
}

bool QuantSpec::quantized() const {
  if (plane_formats.empty()) return is_quantized(format);
  return std::any_of(plane_formats.begin(), plane_formats.end(), [](Format f) { return is_quantized(f); });
}

std::string QuantSpec::to_string() const {
  std::string s = outliers ? "int4_outlier" : format_name(format);
  if (mixed()) {
    uint32_t h = 2166136261u;  // FNV-1a: a short tag that tells two mixes apart in tables and logs
    for (Format f : plane_formats) h = (h ^ static_cast<uint32_t>(f)) * 16777619u;
    char tag[16];
    std::snprintf(tag, sizeof tag, "%08x", h);
    s = "mixed:" + std::to_string(plane_formats.size()) + "x" + tag;
  }
  // A granularity or scale dtype means nothing for unquantized storage (nor for int4_kivi, whose
  // grouping and fp16 parameters are the format's own), so it is not printed.
  if (quantized() && (mixed() || format != Format::kInt4Kivi)) {
    s += '/';
    s += granularity_name(granularity);
    if (scale_dtype == ScaleDtype::kFp16) s += "/fp16_scales";
  }
  s += "/b" + std::to_string(block_size);
  s += "/sink" + std::to_string(sink_tokens);
  if (quantized() && recent_tokens > 0) s += "/recent" + std::to_string(recent_tokens);
  if (rotation != KvRotation::kNone) s += std::string("/") + rotation_name(rotation);
  return s;
}

Status check_plane_formats(const QuantSpec& spec, int num_layers) {
  if (!spec.mixed()) return Status::ok();
  if (spec.plane_formats.size() != static_cast<size_t>(2) * static_cast<size_t>(std::max(num_layers, 0)))
    return invalid_argument("the per-layer cache config has " + std::to_string(spec.plane_formats.size() / 2) +
                            " layers but the model has " + std::to_string(num_layers) +
                            "; write one {\"k\": ..., \"v\": ...} entry per layer (kvq eval --search makes one)");
  for (size_t i = 0; i < spec.plane_formats.size(); ++i) {
    const Format f = spec.plane_formats[i];
    if (!format_traits(f).cache_ready)
      return unsupported("layer " + std::to_string(i / 2) + (i % 2 ? " V" : " K") + ": " + format_name(f) +
                         " caches are not implemented yet");
    if (f == Format::kInt4Kivi)
      return unsupported("layer " + std::to_string(i / 2) + (i % 2 ? " V" : " K") +
                         ": int4_kivi is not available in a per-layer config (it quantizes whole pages of K and V "
                         "together as they leave the recent window); use --kv-cache-dtype int4_kivi for all layers");
  }
  return Status::ok();
}

Result<Format> parse_kv_cache_dtype(std::string_view s) {
  if (s == "bf16" || s == "bfloat16") return Format::kBf16;
  if (s == "fp16" || s == "float16") return Format::kFp16;
  // vLLM's `fp8` means OCP E4M3; FNUZ is only ever chosen explicitly (or by `auto` on gfx942).
  if (s == "fp8" || s == "fp8_e4m3") return Format::kFp8E4m3;
  if (s == "fp8_fnuz" || s == "fp8_e4m3_fnuz") return Format::kFp8E4m3Fnuz;
  if (s == "int8") return Format::kInt8;
  if (s == "int4" || s == "int4_outlier") return Format::kInt4;  // int4_outlier: the spec adds the side plane
  if (s == "int4_kivi") return Format::kInt4Kivi;
  if (s == "fp8_e5m2") {
    return unsupported("--kv-cache-dtype fp8_e5m2 is not supported: kvq stores E4M3, which has one "
                       "more mantissa bit; use fp8 (OCP E4M3) or fp8_fnuz");
  }
  if (s == "auto") {
    return invalid_argument("--kv-cache-dtype auto must be resolved by parse_quant_spec, which knows "
                            "the machine's preferred format");
  }
  return invalid_argument("unknown --kv-cache-dtype '" + std::string(s) + "'; accepted: " + kDtypeChoices);
}

Result<ScaleGranularity> parse_granularity(std::string_view s) {
  if (s == "per_tensor") return ScaleGranularity::kPerTensor;
  if (s == "per_token_head") return ScaleGranularity::kPerTokenHead;
  if (s == "per_block_head") return ScaleGranularity::kPerBlockHead;
  return invalid_argument("unknown --kv-scale-granularity '" + std::string(s) +
                          "'; accepted: " + kGranularityChoices);
}

Result<QuantSpec> parse_quant_spec(const QuantOptions& opts, Format auto_format) {
  QuantSpec spec;
  if (opts.kv_cache_dtype == "auto") {
    KVQ_RETURN_IF_ERROR(check_storable(auto_format, "chosen by --kv-cache-dtype auto"));
    spec.format = auto_format;
    spec.from_auto = true;
  } else {
    Result<Format> f = parse_kv_cache_dtype(opts.kv_cache_dtype);
    if (!f.is_ok()) return f.status();
    spec.format = f.value();
    spec.outliers = opts.kv_cache_dtype == "int4_outlier";
  }

  Result<ScaleGranularity> g = parse_granularity(opts.granularity);
  if (!g.is_ok()) return g.status();
  spec.granularity = g.value();
  if (spec.outliers && spec.granularity != ScaleGranularity::kPerTokenHead)
    return unsupported("--kv-cache-dtype int4_outlier takes --kv-scale-granularity per_token_head only (got " +
                       opts.granularity + ")");

  if (opts.scale_dtype == "fp32" || opts.scale_dtype == "float32") {
    spec.scale_dtype = ScaleDtype::kFp32;
  } else if (opts.scale_dtype == "fp16" || opts.scale_dtype == "float16") {
    spec.scale_dtype = ScaleDtype::kFp16;
  } else {
    return invalid_argument("unknown --kv-scale-dtype '" + opts.scale_dtype + "'; accepted: fp32, fp16");
  }

  if (opts.block_size != 16 && opts.block_size != 32) {
    return invalid_argument("--block-size " + std::to_string(opts.block_size) +
                            " is not supported; accepted: 16, 32");
  }
  spec.block_size = opts.block_size;

  if (opts.sink_tokens < 0 || opts.sink_tokens > kMaxSinkTokens) {
    return invalid_argument("--kv-sink-tokens " + std::to_string(opts.sink_tokens) +
                            " is out of range; accepted: 0 (no sink) to " +
                            std::to_string(kMaxSinkTokens));
  }
  spec.sink_tokens = opts.sink_tokens;

  if (opts.recent_tokens < 0 || opts.recent_tokens > kMaxSinkTokens) {
    return invalid_argument("--kv-recent-tokens " + std::to_string(opts.recent_tokens) +
                            " is out of range; accepted: 0 (no bf16 window) to " + std::to_string(kMaxSinkTokens));
  }
  spec.recent_tokens = opts.recent_tokens;
  if (spec.format == Format::kInt4Kivi) KVQ_RETURN_IF_ERROR(apply_kivi_rules(opts, spec));

  Result<KvRotation> r = parse_rotation(opts.rotate);
  if (!r.is_ok()) return r.status();
  spec.rotation = r.value();
  return spec;
}

}  // namespace kvq
