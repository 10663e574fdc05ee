// `kvq probe`: what this machine is, what `--kv-cache-dtype auto` picks on it, and whether kvq's
// codecs agree with the platform (DESIGN §7). A codec mismatch is fatal: exit code 3.
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "kvq/cli_support.h"
#include "kvq/command.h"
#include "kvq/common/hardware.h"
#include "kvq/format/auto_format.h"
#include "kvq/format/selfcheck.h"
#ifdef KVQ_HAVE_CUDA
#include "kvq/common/cuda_device.h"
#endif

#ifndef KVQ_VERSION
#define KVQ_VERSION "unknown"
#endif

namespace kvq::tools {
namespace {

struct ProbeOptions {
  bool json = false;
};

struct CheckResult {
  std::string state;  // "ok", "skipped", "FAILED"
  std::string detail;
};

CheckResult classify(const Status& s) {
  if (s.is_ok()) return {"ok", ""};
  if (s.code() == StatusCode::kUnsupported) return {"skipped", s.message()};
  return {"FAILED", s.to_string()};
}

[[maybe_unused]] std::string gib(size_t bytes) {  // used by the CUDA build only
  char s[32];
  std::snprintf(s, sizeof s, "%.1f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return s;
}

int run_probe(const ProbeOptions& opt) {
  HardwareInfo hw;
  hw.cpu = detect_cpu();
  std::string backends = "cpu";
  std::string gpu_line = "none (this kvq was built without CUDA)";
  nlohmann::json j;
#ifdef KVQ_HAVE_CUDA
  backends += ", cuda";
  auto dev = cuda_device_info();
  if (dev.is_ok()) {
    const CudaDeviceInfo& d = dev.value();
    hw.gpu.vendor = GpuVendor::kNvidia;
    hw.gpu.name = d.name;
    hw.gpu.cc_major = d.cc_major;
    hw.gpu.cc_minor = d.cc_minor;
    gpu_line = d.name + " (sm_" + std::to_string(d.cc_major) + std::to_string(d.cc_minor) + ", " +
               std::to_string(d.sm_count) + " SMs, " + gib(d.global_mem_bytes) + ", L2 " +
               std::to_string(d.l2_bytes >> 20) + " MiB)";
    j["cuda_device"] = {{"name", d.name},
                        {"cc", std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor)},
                        {"sm_count", d.sm_count},
                        {"global_mem_bytes", d.global_mem_bytes},
                        {"l2_bytes", d.l2_bytes},
                        {"smem_per_block_optin", d.smem_per_block_optin},
                        {"driver_version", d.driver_version},
                        {"runtime_version", d.runtime_version}};
  } else {
    gpu_line = "none (" + dev.status().message() + ")";
    j["cuda_device"] = nullptr;
  }
#endif
  const AutoFormatChoice choice = choose_auto_format(hw);

  const CheckResult host = classify(format::check_codecs_on_host());
#ifdef KVQ_HAVE_CUDA
  const CheckResult device = classify(format::check_codecs_on_device());
#else
  const CheckResult device{"skipped", "built without CUDA"};
#endif
  const bool failed = host.state == "FAILED" || device.state == "FAILED";

  std::string features;
  if (hw.cpu.avx2) features += "avx2 ";
  if (hw.cpu.fma) features += "fma ";
  if (hw.cpu.avx512f) features += "avx512f ";
  if (features.empty()) features = "(none of avx2/fma/avx512f)";
  else features.pop_back();

  if (opt.json) {
    j["version"] = KVQ_VERSION;
    j["build"] = version_text();
    j["backends"] = backends;
    j["cpu"] = {{"model", hw.cpu.model}, {"avx2", hw.cpu.avx2}, {"fma", hw.cpu.fma},
                {"avx512f", hw.cpu.avx512f}, {"logical_cores", hw.cpu.logical_cores}};
    j["auto_format"] = {{"format", format_name(choice.format)}, {"reason", choice.reason}};
    j["codec_check"] = {{"host", {{"state", host.state}, {"detail", host.detail}}},
                        {"device", {{"state", device.state}, {"detail", device.detail}}}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("kvq probe\n");
    std::printf("  version       %s\n", version_text().c_str());
    std::printf("  backends      %s\n", backends.c_str());
    std::printf("  cpu           %s\n", hw.cpu.model.empty() ? "(unknown)" : hw.cpu.model.c_str());
    std::printf("  cpu features  %s\n", features.c_str());
    std::printf("  cores         %d\n", hw.cpu.logical_cores);
    std::printf("  cuda device   %s\n", gpu_line.c_str());
    std::printf("  auto format   %s (%s)\n", format_name(choice.format), choice.reason.c_str());
    std::printf("  codec check   host %s%s%s, device %s%s%s\n", host.state.c_str(),
                host.detail.empty() ? "" : ": ", host.detail.c_str(), device.state.c_str(),
                device.detail.empty() ? "" : ": ", device.detail.c_str());
  }
  if (failed) {
    std::fprintf(stderr,
                 "\nkvq: ERROR: CODEC SELF-CHECK FAILED. kvq's fp8/int/bf16 codecs disagree with this "
                 "platform, so any cache it writes or reads here could be silently wrong; refusing to run.\n"
                 "  host:   %s %s\n  device: %s %s\n"
                 "Report this with the output of `kvq probe --json`.\n",
                 host.state.c_str(), host.detail.c_str(), device.state.c_str(), device.detail.c_str());
    return 3;
  }
  return 0;
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto opt = std::make_shared<ProbeOptions>();
  CLI::App* sub = app.add_subcommand("probe", "Report the hardware, the `auto` KV cache format and the codec self-check");
  sub->add_flag("--json", opt->json, "Print the report as JSON");
  return [opt] { return run_probe(*opt); };
}}};

}  // namespace
}  // namespace kvq::tools
