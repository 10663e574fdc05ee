#include "kvq/format/auto_format.h"

#include <string>

namespace kvq {

namespace {

// "gfx942:sramecc+:xnack-" -> "gfx942"
std::string base_gfx(const std::string& arch) { return arch.substr(0, arch.find(':')); }

}  // namespace

AutoFormatChoice choose_auto_format(const HardwareInfo& hw) {
  const GpuInfo& g = hw.gpu;
  switch (g.vendor) {
    case GpuVendor::kNvidia: {
      const std::string sm = "sm_" + std::to_string(g.cc_major) + std::to_string(g.cc_minor);
      // sm_89 (Ada) and sm_90+ convert E4M3 in hardware (cvt.*.e4m3x2); older parts would
      // emulate fp8 in software, where int8 is as small and cheaper to decode.
      if (g.cc_major > 8 || (g.cc_major == 8 && g.cc_minor >= 9))
        return {Format::kFp8E4m3, "NVIDIA " + sm + " has native OCP fp8 E4M3 conversions"};
      return {Format::kInt8, "NVIDIA " + sm + " predates fp8 (sm_89); int8 decodes fastest there"};
    }
    case GpuVendor::kAmd: {
      const std::string gfx = base_gfx(g.gfx_arch);
      if (gfx == "gfx940" || gfx == "gfx941" || gfx == "gfx942")
        return {Format::kFp8E4m3Fnuz, "AMD " + gfx + " (CDNA3) has native FNUZ fp8 E4M3"};
      if (gfx == "gfx950")
        return {Format::kFp8E4m3, "AMD gfx950 (CDNA4) has native OCP fp8 E4M3"};
      return {Format::kInt8, "AMD " + (gfx.empty() ? std::string("GPU") : gfx) + " has no fp8 we use; int8"};
    }
    case GpuVendor::kNone: break;
  }
  return {Format::kInt8, "no usable GPU: on a CPU int8 is the cheapest compact format to decode"};
}

}  // namespace kvq
