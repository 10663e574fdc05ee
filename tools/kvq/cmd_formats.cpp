// `kvq formats`: the storage formats kvq knows; `--dump FORMAT` lists every code and its value.
#include <cstdio>
#include <string>

#include "kvq/command.h"
#include "kvq/format/format.h"

namespace kvq::tools {
namespace {

struct FormatsOptions {
  std::string dump;
};

int run_formats(const FormatsOptions& opt) {
  if (!opt.dump.empty()) {
    auto f = parse_format_name(opt.dump);
    if (!f.is_ok()) {
      std::fprintf(stderr, "kvq formats: %s\n", f.status().message().c_str());
      return 2;
    }
    auto text = dump_codes(f.value());
    if (!text.is_ok()) {
      std::fprintf(stderr, "kvq formats: %s\n", text.status().message().c_str());
      return 2;
    }
    std::fputs(text.value().c_str(), stdout);
    return 0;
  }
  std::printf("%-14s %4s %7s %-9s  %s\n", "format", "bits", "qmax", "cache", "description");
  for (Format f : kAllFormats) {
    const FormatTraits t = format_traits(f);
    // Where a KV cache of this format runs: the CPU reference first, then the CUDA backend.
    const char* where = !t.cache_ready ? "-" : t.device_ready ? "cpu,cuda" : "cpu";
    char qmax[16] = "-";
    if (is_quantized(f)) std::snprintf(qmax, sizeof qmax, "%g", static_cast<double>(format_qmax(f)));
    std::printf("%-14s %4d %7s %-9s  %s\n", format_name(f), format_bits(f), qmax, where, format_description(f));
  }
  // Not a code format of its own: int4 codes plus a side plane (quant/outlier.h).
  std::printf("%-14s %4d %7d %-9s  %s\n", "int4_outlier", 4, 7, "cpu,cuda",
              "int4, K per channel (page scales from running RMS) and V per token, + per-page sparse fp16 outliers (1 per token)");
  return 0;
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto opt = std::make_shared<FormatsOptions>();
  CLI::App* sub = app.add_subcommand("formats", "List the KV cache storage formats, or dump one format's codes");
  sub->add_option("--dump", opt->dump,
                  "Print every code of FORMAT (fp8_e4m3, fp8_e4m3_fnuz, int8, int4, int4_kivi) as '0xNN <value as %a>'");
  return [opt] { return run_formats(*opt); };
}}};

}  // namespace
}  // namespace kvq::tools
