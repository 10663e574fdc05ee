#pragma once
// `--kv-cache-dtype auto` (DESIGN §7): the cache format this machine stores natively and fast.
#include <string>

#include "kvq/common/hardware.h"
#include "kvq/format/format.h"

namespace kvq {

struct AutoFormatChoice {
  Format format = Format::kInt8;
  std::string reason;  // one line for `kvq probe`, e.g. "NVIDIA sm_90 converts OCP fp8 in hardware"
};

// NVIDIA sm_89+ -> fp8_e4m3 (OCP); older NVIDIA -> int8; AMD gfx940/941/942 (CDNA3) ->
// fp8_e4m3_fnuz; AMD gfx950 (CDNA4, OCP fp8) -> fp8_e4m3; other AMD -> int8; no GPU -> int8.
AutoFormatChoice choose_auto_format(const HardwareInfo& hw);

}  // namespace kvq
