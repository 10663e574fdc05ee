#pragma once
// What each cache format is, described once. Everything that differs between formats and is not a
// codec (fp8.h, integer.h, bf16.h) is read from this table: storage size and packing, the code
// range a scale maps amax to, where encoding starts to clip, and the names `kvq formats` prints.
// format.h's helpers (is_quantized, format_bits, format_qmax), quant/'s scale policy and row
// sizes, and the CLI's listings are views of it, so a new format is one entry here plus its
// codec and kernels.
#include <cstdint>

#include "kvq/common/macros.h"
#include "kvq/format/fp8.h"
#include "kvq/format/integer.h"

namespace kvq {

// Storage format of cached K/V values.
enum class Format : uint8_t { kBf16, kFp16, kFp8E4m3, kFp8E4m3Fnuz, kInt8, kInt4, kInt4Kivi };

// How a code turns into a value (before the scale).
enum class CodeKind : uint8_t {
  kHalf,     // a 16-bit float stored as is (bf16, fp16); no scale
  kFp8,      // an 8-bit float (fp8.h), value = decode(code) * scale
  kInteger,  // an integer code, value = (code - zero_point) * scale
};

// What one scale covers along the cached [token][head][channel] tensor. The granularity
// (QuantSpec) picks how many tokens; the axis says which channels.
enum class GroupAxis : uint8_t {
  kNone,        // unscaled storage
  kHeadVector,  // all head_dim channels of a head (per_token_head / per_block_head / per_tensor)
  // KIVI's 2D grouping (int4_kivi): K one (scale, zero point) per channel of a page head (the
  // page's block_size tokens), V one per (token, head); set once, when the page leaves the bf16
  // recent window (quant/kivi_policy.h). The granularity option does not apply.
  kKivi,
};

struct FormatTraits {
  const char* name;         // as `kvq formats` and QuantSpec::to_string print it
  const char* description;  // one line for `kvq formats`
  CodeKind kind;
  int bits;                 // stored bits per element
  int elems_per_byte;       // packing: 2 = two codes per byte (element 2i in the low nibble); 0 = wider
  bool is_signed;           // codes carry their own sign (symmetric grid)
  bool zero_point;          // asymmetric: code = x / scale + zero_point (int4_kivi)
  GroupAxis axis;
  float qmax;               // largest code magnitude the writer emits: what amax / scale maps to
  // |x / scale| at which the encoder saturates: beyond the midpoint between qmax and the next grid
  // value the format lacks (or the writer refuses). clip_at_equal: the midpoint itself clips too
  // (integer rint's tie goes to the even neighbour qmax + 1; 16-bit floats round it to inf),
  // whereas fp8's tie rounds to the even largest code and does not clip.
  float clip_limit;
  bool clip_at_equal;
  // The host cache, the CPU attention and the engine store and read it. A format whose codec
  // exists first stays false until they do; every layer refuses it by this flag, not by name.
  bool cache_ready;
  // The CUDA backend stores and reads it too (int4 through its generic kernels; the fast kernels
  // of attention/cuda take whole-byte codes); the CUDA layers refuse a format by this flag. A
  // format becomes cache_ready on the CPU reference first.
  bool device_ready;
};

// One entry per Format, in enum order.
KVQ_HD constexpr FormatTraits format_traits(Format f) {
  switch (f) {
    case Format::kBf16:
      return {"bf16", "bfloat16, round to nearest even (baseline and sink)", CodeKind::kHalf, 16, 0, true, false,
              GroupAxis::kNone, 1.0f, 0x1.ffp+127f /* bits 0x7F7F8000: rounds to bf16 inf */, true, true, true};
    case Format::kFp16:
      return {"fp16", "IEEE binary16, round to nearest even (baseline, fp16 scales)", CodeKind::kHalf, 16, 0, true,
              false, GroupAxis::kNone, 1.0f, 65520.0f /* rounds to binary16 inf */, true, true, true};
    case Format::kFp8E4m3:
      return {"fp8_e4m3", "FP8 E4M3 OCP 'fn' (NVIDIA sm_89+): bias 7, max 448, NaN S.1111.111; writer never emits -0",
              CodeKind::kFp8, 8, 1, true, false, GroupAxis::kHeadVector, format::kFp8E4m3Max,
              464.0f /* 448 | 480 */, false, true, true};
    case Format::kFp8E4m3Fnuz:
      return {"fp8_e4m3_fnuz", "FP8 E4M3 FNUZ (AMD CDNA3): bias 8, max 240, NaN 0x80; writer caps at 224 (0x7E)",
              CodeKind::kFp8, 8, 1, true, false, GroupAxis::kHeadVector, format::kFp8FnuzWriterMax,
              232.0f /* 224 | 240, the interchange cap */, false, true, true};
    case Format::kInt8:
      return {"int8", "int8 symmetric, -127..127", CodeKind::kInteger, 8, 1, true, false, GroupAxis::kHeadVector,
              static_cast<float>(format::kInt8Max), 127.5f, true, true, true};
    case Format::kInt4:
      return {"int4", "int4 symmetric, -7..7, two per byte (element 2i in the low nibble)", CodeKind::kInteger, 4,
              2, true, false, GroupAxis::kHeadVector, static_cast<float>(format::kInt4Max), 7.5f, true, true, true};
    case Format::kInt4Kivi:
      // Codes are computed against the group's [min, max], so nothing clips unless an fp16 scale
      // was clamped (quant/kivi_policy.h); clip_limit is the code grid's edge 15.5.
      return {"int4_kivi",
              "KIVI int4: asymmetric 0..15, K per channel within a page, V per token, fp16 scale + zero point; "
              "needs the bf16 recent window",
              CodeKind::kInteger, 4, 2, false, true, GroupAxis::kKivi, static_cast<float>(format::kUint4Max), 15.5f,
              true, true, true};
  }
  return {"unknown", "unknown", CodeKind::kHalf, 16, 0, true, false, GroupAxis::kNone, 1.0f, 0.0f, true, false, false};
}

}  // namespace kvq
