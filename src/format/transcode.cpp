#include "kvq/format/transcode.h"

#include <cmath>
#include <cstdio>
#include <string>

namespace kvq::format {

namespace {

bool is_fp8(Format f) { return f == Format::kFp8E4m3 || f == Format::kFp8E4m3Fnuz; }

std::string hex_byte(uint8_t b) {
  char s[8];
  std::snprintf(s, sizeof s, "0x%02x", b);
  return s;
}

std::string float_text(float v) {
  char s[32];
  std::snprintf(s, sizeof s, "%.9g", static_cast<double>(v));
  return s;
}

}  // namespace

Status transcode_fp8(Format from, Format to, const uint8_t* codes, size_t n_codes, float* scales,
                     size_t n_scales) {
  if (!is_fp8(from) || !is_fp8(to))
    return invalid_argument(std::string("transcode_fp8 moves a cache between fp8_e4m3 and "
                                        "fp8_e4m3_fnuz; got ") +
                            format_name(from) + " -> " + format_name(to));
  if ((n_codes != 0 && codes == nullptr) || (n_scales != 0 && scales == nullptr))
    return invalid_argument("transcode_fp8: null codes or scales with a non-zero count");
  if (from == to) return Status::ok();

  // Validate everything before touching anything: a refused call leaves the scales as they were.
  for (size_t i = 0; i < n_codes; ++i) {
    if (!is_interchange_code(codes[i]))
      return corrupt_input(
          "fp8 cache byte at offset " + std::to_string(i) + " is " + hex_byte(codes[i]) + ", which " +
          (codes[i] == 0x80 ? "is -0 in fp8_e4m3 but NaN in fp8_e4m3_fnuz"
                            : "is NaN in fp8_e4m3 but +-240 in fp8_e4m3_fnuz") +
          "; only caches written by kvq's interchange writers can be moved between " +
          format_name(from) + " and " + format_name(to) + " (re-quantize from the source values)");
  }
  // Doubling and halving must be exact, or decoded values would drift by a rounding.
  const bool to_fnuz = to == Format::kFp8E4m3Fnuz;
  for (size_t i = 0; i < n_scales; ++i) {
    const float s = scales[i];
    const float r = to_fnuz ? s * 2.0f : s * 0.5f;
    const bool exact = std::isfinite(r) && (to_fnuz ? r * 0.5f : r * 2.0f) == s;
    if (!exact)
      return corrupt_input("fp8 cache scale " + std::to_string(i) + " is " + float_text(s) +
                           ", which cannot be " + (to_fnuz ? "doubled" : "halved") +
                           " exactly; the scale plane is damaged or was not written by kvq");
  }
  for (size_t i = 0; i < n_scales; ++i) scales[i] = to_fnuz ? scales[i] * 2.0f : scales[i] * 0.5f;
  return Status::ok();
}

}  // namespace kvq::format
