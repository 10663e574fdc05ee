#include "kvq/format/selfcheck.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "kvq/format/format.h"

namespace kvq::format {

namespace {

// Values from the OCP 8-bit floating point specification (E4M3) and AMD's FNUZ variant, worked
// out by hand: normal/subnormal boundaries, round-to-nearest-even ties, saturation, and kvq's
// NaN/inf policy.
struct Fp8Point {
  float x;
  uint8_t ocp, fnuz;  // plain (saturating) encoders
};

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

constexpr Fp8Point kFp8Points[] = {
    {0.0f, 0x00, 0x00},
    {-0.0f, 0x80, 0x00},          // FNUZ has no -0
    {1.0f, 0x38, 0x40},
    {-1.0f, 0xB8, 0xC0},
    {1.125f, 0x39, 0x41},
    {1.0625f, 0x38, 0x40},        // tie -> even mantissa 0
    {1.1875f, 0x3A, 0x42},        // tie -> even mantissa 2
    {0.001953125f, 0x01, 0x02},   // 2^-9: OCP min subnormal, FNUZ 2 * 2^-10
    {0.0009765625f, 0x00, 0x01},  // 2^-10: tie to 0 in OCP; FNUZ min subnormal
    {0.00048828125f, 0x00, 0x00}, // 2^-11: tie to 0 in FNUZ
    {0.013671875f, 0x07, 0x0E},   // 7 * 2^-9: largest OCP subnormal
    {0.015625f, 0x08, 0x10},      // 2^-6: OCP min normal
    {0.0078125f, 0x04, 0x08},     // 2^-7: FNUZ min normal
    {240.0f, 0x77, 0x7F},         // FNUZ max
    {248.0f, 0x78, 0x7F},         // FNUZ: beyond max saturates
    {448.0f, 0x7E, 0x7F},         // OCP max
    {464.0f, 0x7E, 0x7F},         // tie above OCP max: saturates, never NaN
    {1e9f, 0x7E, 0x7F},
    {-1e9f, 0xFE, 0xFF},
    {kInf, 0x7E, 0x7F},           // inf -> +max (policy)
    {-kInf, 0xFE, 0xFF},
    {kNaN, 0x00, 0x00},           // NaN -> +0 (policy)
};

struct HalfPoint {
  float x;
  uint16_t fp16, bf16;
};

constexpr HalfPoint kHalfPoints[] = {
    {1.0f, 0x3C00, 0x3F80},
    {-2.0f, 0xC000, 0xC000},
    {1.00390625f, 0x3C04, 0x3F80},        // 1 + 2^-8: exact in fp16, bf16 tie -> even
    {1.01171875f, 0x3C0C, 0x3F82},        // 1 + 3 * 2^-8: bf16 tie -> even (up)
    {65504.0f, 0x7BFF, 0x4780},           // fp16 max
    {65520.0f, 0x7C00, 0x4780},           // fp16 tie above max -> inf
    {5.9604644775390625e-8f, 0x0001, 0x3380},  // 2^-24: fp16 min subnormal
    {2.98023223876953125e-8f, 0x0000, 0x3300},  // 2^-25: tie to 0
    {kInf, 0x7C00, 0x7F80},
    {-0.0f, 0x8000, 0x8000},
};

std::string hex(unsigned v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%02x", v);
  return s;
}

std::string fmt(float x) {
  char s[48];
  std::snprintf(s, sizeof s, "%a", static_cast<double>(x));
  return s;
}

Status mismatch(const std::string& what, unsigned got, unsigned want) {
  return internal_error("codec self-check: " + what + " gave " + hex(got) + ", expected " + hex(want));
}

bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return float_bits(a) == float_bits(b);
}

}  // namespace

Status check_codecs_on_host() {
  for (const auto& p : kFp8Points) {
    if (encode_fp8_e4m3(p.x) != p.ocp) return mismatch("encode_fp8_e4m3(" + fmt(p.x) + ")", encode_fp8_e4m3(p.x), p.ocp);
    if (encode_fp8_e4m3_fnuz(p.x) != p.fnuz)
      return mismatch("encode_fp8_e4m3_fnuz(" + fmt(p.x) + ")", encode_fp8_e4m3_fnuz(p.x), p.fnuz);
  }
  for (const auto& p : kHalfPoints) {
    if (float_to_fp16(p.x) != p.fp16) return mismatch("float_to_fp16(" + fmt(p.x) + ")", float_to_fp16(p.x), p.fp16);
    if (float_to_bf16(p.x) != p.bf16) return mismatch("float_to_bf16(" + fmt(p.x) + ")", float_to_bf16(p.x), p.bf16);
  }
  struct IntPoint { float x; int q8, q4; };
  constexpr IntPoint kIntPoints[] = {{2.5f, 2, 2},  {3.5f, 4, 4},    {-2.5f, -2, -2}, {6.5f, 6, 6},
                                     {7.5f, 8, 7},  {126.5f, 126, 7}, {127.5f, 127, 7},
                                     {-1e6f, -127, -7}, {kNaN, 0, 0},  {-kInf, -127, -7}};
  for (const auto& p : kIntPoints) {
    if (encode_int8(p.x) != p.q8) return internal_error("codec self-check: encode_int8(" + fmt(p.x) + ") is wrong");
    if (encode_int4(p.x) != p.q4) return internal_error("codec self-check: encode_int4(" + fmt(p.x) + ") is wrong");
  }

  for (unsigned c = 0; c < 256; ++c) {
    const auto b = static_cast<uint8_t>(c);
    const float ocp = decode_fp8_e4m3(b), fnuz = decode_fp8_e4m3_fnuz(b);
    const bool ocp_nan = (c & 0x7f) == 0x7f, fnuz_nan = c == 0x80;
    if (std::isnan(ocp) != ocp_nan) return internal_error("codec self-check: decode_fp8_e4m3(" + hex(c) + ") NaN-ness is wrong");
    if (std::isnan(fnuz) != fnuz_nan) return internal_error("codec self-check: decode_fp8_e4m3_fnuz(" + hex(c) + ") NaN-ness is wrong");
    if (!ocp_nan && encode_fp8_e4m3(ocp) != b) return mismatch("encode(decode_fp8_e4m3(" + hex(c) + "))", encode_fp8_e4m3(ocp), c);
    if (!fnuz_nan && encode_fp8_e4m3_fnuz(fnuz) != b)
      return mismatch("encode(decode_fp8_e4m3_fnuz(" + hex(c) + "))", encode_fp8_e4m3_fnuz(fnuz), c);
    // The interchange rule: the writers' codes mean value_fnuz = value_ocp / 2.
    if (c != 0x80 && (c & 0x7f) <= 0x7e && !same_float(fnuz, ocp * 0.5f))
      return internal_error("codec self-check: code " + hex(c) + " breaks value_fnuz = value_ocp / 2");
    const unsigned want_ocp_writer = c == 0x80 ? 0x00u : c;
    if (!ocp_nan && write_fp8_e4m3(ocp) != want_ocp_writer)
      return mismatch("write_fp8_e4m3(" + fmt(ocp) + ")", write_fp8_e4m3(ocp), want_ocp_writer);
    const unsigned want_fnuz_writer = (c & 0x7f) == 0x7f ? (c & 0x80u) | kFp8MaxCode : c;
    if (!fnuz_nan && write_fp8_e4m3_fnuz(fnuz) != want_fnuz_writer)
      return mismatch("write_fp8_e4m3_fnuz(" + fmt(fnuz) + ")", write_fp8_e4m3_fnuz(fnuz), want_fnuz_writer);
  }
  for (unsigned h = 0; h < 65536; ++h) {
    const auto b = static_cast<uint16_t>(h);
    const float f16 = fp16_to_float(b), bf = bf16_to_float(b);
    if (!std::isnan(f16) && float_to_fp16(f16) != b) return mismatch("float_to_fp16(fp16_to_float(" + hex(h) + "))", float_to_fp16(f16), h);
    if (!std::isnan(bf) && float_to_bf16(bf) != b) return mismatch("float_to_bf16(bf16_to_float(" + hex(h) + "))", float_to_bf16(bf), h);
  }
  return Status::ok();
}

}  // namespace kvq::format
