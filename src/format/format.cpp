#include "kvq/format/format.h"

#include <cmath>
#include <cstdio>
#include <string>

namespace kvq {

const char* format_name(Format f) { return format_traits(f).name; }
const char* format_description(Format f) { return format_traits(f).description; }

Result<Format> parse_format_name(std::string_view name) {
  for (Format f : kAllFormats)
    if (name == format_name(f)) return f;
  std::string known;
  for (Format f : kAllFormats) {
    if (!known.empty()) known += ", ";
    known += format_name(f);
  }
  return invalid_argument("unknown format '" + std::string(name) + "' (known: " + known + ")");
}

namespace {

void append_code_line(std::string& out, unsigned code, float value) {
  char line[64];
  if (std::isnan(value))
    std::snprintf(line, sizeof line, "0x%02x nan\n", code);
  else
    std::snprintf(line, sizeof line, "0x%02x %a\n", code, static_cast<double>(value));
  out += line;
}

}  // namespace

Result<std::string> dump_codes(Format f) {
  std::string out;
  switch (f) {
    case Format::kFp8E4m3:
    case Format::kFp8E4m3Fnuz:
    case Format::kInt8:
      out.reserve(256 * 20);
      for (unsigned c = 0; c < 256; ++c) append_code_line(out, c, decode_byte(f, static_cast<uint8_t>(c)));
      return out;
    case Format::kInt4:
      for (unsigned c = 0; c < 16; ++c)
        append_code_line(out, c, static_cast<float>(format::unpack_int4_lo(static_cast<uint8_t>(c))));
      return out;
    case Format::kInt4Kivi:  // unsigned: the value before the zero point is subtracted
      for (unsigned c = 0; c < 16; ++c) append_code_line(out, c, static_cast<float>(c));
      return out;
    case Format::kBf16:
    case Format::kFp16:
      break;
  }
  return invalid_argument(std::string("--dump lists the codes of 8-bit and 4-bit formats; ") +
                          format_name(f) + " has 65536 codes (use fp8_e4m3, fp8_e4m3_fnuz, int8, int4 or int4_kivi)");
}

}  // namespace kvq
