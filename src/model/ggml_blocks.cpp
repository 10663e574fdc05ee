// Decoders for the ggml block formats kvq reads weights from. Layouts (all little endian):
//   q4_0  32 values: fp16 d, 16 bytes of nibbles; value j = (nib_j - 8) * d, where byte b holds
//         value b in its low nibble and value b+16 in its high nibble.
//   q4_1  32 values: fp16 d, fp16 m, 16 bytes of nibbles (same order); value = nib * d + m.
//   q8_0  32 values: fp16 d, 32 int8; value = q * d.
//   q4_k  256 values: fp16 d, fp16 dmin, 12 bytes of packed 6-bit (scale, min) for 8 groups of 32,
//         128 bytes of nibbles; value = d * scale_g * nib - dmin * min_g. Each 32-byte run of
//         nibbles holds two consecutive groups: low nibbles the first, high nibbles the second.
//   q6_k  256 values: 128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per
//         16 values), fp16 d; value = d * scale * (q6 - 32).
#include <cstring>

#include "kvq/format/bf16.h"
#include "kvq/model/gguf.h"

namespace kvq::model::gguf {
namespace {

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return format::fp16_to_float(h);
}

void decode_q4_0(const uint8_t* b, float* y) {
  float d = f16(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((q[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((q[j] >> 4) - 8) * d;
  }
}

void decode_q4_1(const uint8_t* b, float* y) {
  float d = f16(b), m = f16(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(q[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(q[j] >> 4) * d + m;
  }
}

void decode_q8_0(const uint8_t* b, float* y) {
  float d = f16(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}

// The 12 scale bytes hold, for groups 0..3, scale and min in the low 6 bits of bytes g and g+4;
// groups 4..7 keep their low 4 bits in byte g+4 (scale low nibble, min high nibble) and their top
// 2 bits in the spare high bits of bytes g-4 (scale) and g (min).
void q4k_scale_min(int g, const uint8_t* s, int* sc, int* mn) {
  if (g < 4) {
    *sc = s[g] & 63;
    *mn = s[g + 4] & 63;
  } else {
    *sc = (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
    *mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

void decode_q4_k(const uint8_t* b, float* y) {
  float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int pair = 0; pair < 4; ++pair) {
    int sc0, m0, sc1, m1;
    q4k_scale_min(2 * pair, scales, &sc0, &m0);
    q4k_scale_min(2 * pair + 1, scales, &sc1, &m1);
    float d0 = d * static_cast<float>(sc0), o0 = dmin * static_cast<float>(m0);
    float d1 = d * static_cast<float>(sc1), o1 = dmin * static_cast<float>(m1);
    const uint8_t* qq = q + 32 * pair;
    float* yy = y + 64 * pair;
    for (int l = 0; l < 32; ++l) {
      yy[l] = d0 * static_cast<float>(qq[l] & 0x0F) - o0;
      yy[l + 32] = d1 * static_cast<float>(qq[l] >> 4) - o1;
    }
  }
}

// q6_k: each half (128 values) uses 64 low-nibble bytes and 32 high-bit bytes. Within a half,
// value l + 32*k (k = 0..3, l = 0..31) takes its low 4 bits from ql[l + 32*(k&1)] (low nibble for
// k < 2, high nibble otherwise) and its high 2 bits from bits 2k..2k+1 of qh[l].
void decode_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  float d = f16(b + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* l4 = ql + 64 * half;
    const uint8_t* h2 = qh + 32 * half;
    const int8_t* s = sc + 8 * half;
    float* yy = y + 128 * half;
    for (int k = 0; k < 4; ++k) {
      for (int l = 0; l < 32; ++l) {
        uint8_t lowbyte = l4[l + 32 * (k & 1)];
        int lo = k < 2 ? (lowbyte & 0x0F) : (lowbyte >> 4);
        int hi = (h2[l] >> (2 * k)) & 3;
        int q = (lo | (hi << 4)) - 32;
        yy[32 * k + l] = d * static_cast<float>(s[2 * k + l / 16]) * static_cast<float>(q);
      }
    }
  }
}

}  // namespace

std::string tensor_type_name(uint32_t type) {
  static const char* const kNames[] = {
      "f32", "f16", "q4_0", "q4_1", "q4_2", "q4_3", "q5_0", "q5_1", "q8_0", "q8_1",
      "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s",
      "iq4_nl", "iq3_s", "iq2_s", "iq4_xs", "i8", "i16", "i32", "i64", "f64", "iq1_m", "bf16"};
  if (type < sizeof(kNames) / sizeof(kNames[0])) return kNames[type];
  return "type" + std::to_string(type);
}

Result<BlockLayout> block_layout(uint32_t type) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::kF32: return BlockLayout{1, 4};
    case TensorType::kF16: return BlockLayout{1, 2};
    case TensorType::kBf16: return BlockLayout{1, 2};
    case TensorType::kQ4_0: return BlockLayout{32, 18};
    case TensorType::kQ4_1: return BlockLayout{32, 20};
    case TensorType::kQ8_0: return BlockLayout{32, 34};
    case TensorType::kQ4_K: return BlockLayout{256, 144};
    case TensorType::kQ6_K: return BlockLayout{256, 210};
  }
  return unsupported("ggml tensor type " + tensor_type_name(type) +
                     " is not supported (kvq decodes f32, f16, bf16, q4_0, q4_1, q8_0, q4_k, q6_k)");
}

Status dequantize(uint32_t type, const uint8_t* data, size_t n, float* out) {
  auto layout = block_layout(type);
  if (!layout.is_ok()) return layout.status();
  const size_t be = static_cast<size_t>(layout->elems), bb = static_cast<size_t>(layout->bytes);
  if (n % be != 0)
    return invalid_argument(std::to_string(n) + " values is not a whole number of " + tensor_type_name(type) +
                            " blocks of " + std::to_string(be));
  const size_t blocks = n / be;
  switch (static_cast<TensorType>(type)) {
    case TensorType::kF32: std::memcpy(out, data, n * 4); break;
    case TensorType::kF16:
      for (size_t i = 0; i < n; ++i) out[i] = f16(data + 2 * i);
      break;
    case TensorType::kBf16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        out[i] = format::bf16_to_float(h);
      }
      break;
    case TensorType::kQ4_0:
      for (size_t b = 0; b < blocks; ++b) decode_q4_0(data + b * bb, out + b * be);
      break;
    case TensorType::kQ4_1:
      for (size_t b = 0; b < blocks; ++b) decode_q4_1(data + b * bb, out + b * be);
      break;
    case TensorType::kQ8_0:
      for (size_t b = 0; b < blocks; ++b) decode_q8_0(data + b * bb, out + b * be);
      break;
    case TensorType::kQ4_K:
      for (size_t b = 0; b < blocks; ++b) decode_q4_k(data + b * bb, out + b * be);
      break;
    case TensorType::kQ6_K:
      for (size_t b = 0; b < blocks; ++b) decode_q6_k(data + b * bb, out + b * be);
      break;
  }
  return Status::ok();
}

}  // namespace kvq::model::gguf
