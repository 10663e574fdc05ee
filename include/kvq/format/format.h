#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "kvq/common/macros.h"
#include "kvq/common/status.h"
#include "kvq/format/bf16.h"
#include "kvq/format/fp8.h"
#include "kvq/format/integer.h"
#include "kvq/format/traits.h"

namespace kvq {

const char* format_name(Format f);                        // "bf16", "fp8_e4m3", ...
Result<Format> parse_format_name(std::string_view name);  // names of format_name, for `kvq formats`
const char* format_description(Format f);                 // one line for `kvq formats`

inline constexpr Format kAllFormats[] = {Format::kBf16, Format::kFp16, Format::kFp8E4m3,
                                         Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4,
                                         Format::kInt4Kivi};

// Every code of an 8-bit or 4-bit format and the value it decodes to, one per line:
// "0xNN <C99 hex float (%a)>", "nan" for NaN codes (256 lines; int4: 16 lines, 0x00..0x0F).
// bf16/fp16 (65536 codes) are kInvalidArgument.
Result<std::string> dump_codes(Format f);

// Views of format_traits (traits.h), kept because most code asks exactly this.
KVQ_HD bool is_quantized(Format f) { return format_traits(f).kind != CodeKind::kHalf; }
KVQ_HD int format_bits(Format f) { return format_traits(f).bits; }  // int4 = 4
// The value a scale maps amax to: the writer's largest code (FNUZ uses the interchange cap 224).
KVQ_HD float format_qmax(Format f) { return format_traits(f).qmax; }

// One code from an already scaled value (writer semantics: fp8 interchange rule applied).
// int4 gives the unpacked code -7..7 as a two's complement byte (pack it with pack_int4);
// int4_kivi the unsigned code 0..15 of a value whose zero point was added.
// bf16/fp16 have no 8-bit code; they are treated as int8 here and callers must not ask.
KVQ_HD uint8_t encode_byte(Format f, float scaled) {
  switch (f) {
    case Format::kFp8E4m3: return format::write_fp8_e4m3(scaled);
    case Format::kFp8E4m3Fnuz: return format::write_fp8_e4m3_fnuz(scaled);
    case Format::kInt4: return static_cast<uint8_t>(format::encode_int4(scaled));
    case Format::kInt4Kivi: return format::encode_uint4(scaled);  // zero point already added
    default: return static_cast<uint8_t>(format::encode_int8(scaled));
  }
}

// Inverse of encode_byte (int4: the byte is the sign-extended unpacked code).
KVQ_HD float decode_byte(Format f, uint8_t c) {
  switch (f) {
    case Format::kFp8E4m3: return format::decode_fp8_e4m3(c);
    case Format::kFp8E4m3Fnuz: return format::decode_fp8_e4m3_fnuz(c);
    case Format::kInt4Kivi: return static_cast<float>(c & 0xf);  // before the zero point
    default: return format::decode_int8(static_cast<int8_t>(c));
  }
}

}  // namespace kvq
