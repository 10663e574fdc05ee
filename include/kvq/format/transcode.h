#pragma once
// Moving an fp8 cache between OCP and FNUZ (DESIGN §2): bytes stay, scales double or halve.
#include <cstddef>
#include <cstdint>

#include "kvq/common/status.h"
#include "kvq/format/format.h"

namespace kvq::format {

// True when `code` obeys the interchange rule, i.e. means the same thing in both formats:
// not 0x80 (-0 in OCP, NaN in FNUZ) and magnitude <= 0x7E (not NaN in OCP, <= 224 in FNUZ).
KVQ_HD bool is_interchange_code(uint8_t code) { return code != 0x80 && (code & 0x7f) <= 0x7e; }

// Checks every byte against the interchange rule, then rescales `scales` in place for the target
// format (OCP -> FNUZ: x2, FNUZ -> OCP: /2); the byte planes are never written. Refuses
// (kCorruptInput, naming the first bad offset) without touching anything if a byte breaks the
// rule, or if a scale cannot be doubled/halved exactly (non-finite, overflow, a subnormal that
// would lose its last bit): decoded values then stay bit-identical across the move. from == to
// is a no-op; non-fp8 formats and null pointers with non-zero counts are kInvalidArgument.
Status transcode_fp8(Format from, Format to, const uint8_t* codes, size_t n_codes, float* scales,
                     size_t n_scales);

}  // namespace kvq::format
