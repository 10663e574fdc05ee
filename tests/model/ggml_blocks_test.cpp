// ggml block decoders, checked two ways:
//  1. Encoders written here from the format description pack chosen integer codes and scales;
//     the decoder must give back value = f(codes, scales) computed in float64.
//  2. Fixed pseudo-random bytes decoded by the `gguf` Python package (llama.cpp's gguf-py 0.19.0,
//     gguf.quants.dequantize), values hard-coded below, so a misreading of a layout shared by the
//     encoder here and the decoder would still be caught.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/format/bf16.h"
#include "kvq/model/gguf.h"

namespace kvq::model::gguf {
namespace {

void put_f16(std::vector<uint8_t>& b, size_t off, float v) {
  uint16_t h = format::float_to_fp16(v);
  b[off] = static_cast<uint8_t>(h & 0xFF);
  b[off + 1] = static_cast<uint8_t>(h >> 8);
}
double f16(float v) { return format::fp16_to_float(format::float_to_fp16(v)); }

std::vector<float> decode(TensorType t, const std::vector<uint8_t>& bytes, size_t n) {
  std::vector<float> out(n, NAN);
  Status s = dequantize(static_cast<uint32_t>(t), bytes.data(), n, out.data());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rel = 2e-6) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], rel * (1 + std::fabs(want[i]))) << "value " << i;
}

TEST(GgmlBlocks, Q4_0FromCodes) {
  std::mt19937 rng(1);
  const int nb = 3;
  std::vector<uint8_t> b(18 * nb);
  std::vector<double> want(32 * nb);
  for (int k = 0; k < nb; ++k) {
    float d = 0.01f * (k + 1) + 0.003f;
    put_f16(b, 18 * k, d);
    int q[32];
    for (int& x : q) x = static_cast<int>(rng() % 16);
    for (int j = 0; j < 16; ++j) b[18 * k + 2 + j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
    for (int j = 0; j < 32; ++j) want[32 * k + j] = (q[j] - 8) * f16(d);
  }
  expect_close(decode(TensorType::kQ4_0, b, 32 * nb), want);
}

TEST(GgmlBlocks, Q4_1FromCodes) {
  std::mt19937 rng(2);
  const int nb = 3;
  std::vector<uint8_t> b(20 * nb);
  std::vector<double> want(32 * nb);
  for (int k = 0; k < nb; ++k) {
    float d = 0.02f * (k + 1), m = -0.3f + 0.25f * k;
    put_f16(b, 20 * k, d);
    put_f16(b, 20 * k + 2, m);
    int q[32];
    for (int& x : q) x = static_cast<int>(rng() % 16);
    for (int j = 0; j < 16; ++j) b[20 * k + 4 + j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
    for (int j = 0; j < 32; ++j) want[32 * k + j] = q[j] * f16(d) + f16(m);
  }
  expect_close(decode(TensorType::kQ4_1, b, 32 * nb), want);
}

TEST(GgmlBlocks, Q8_0FromCodes) {
  std::mt19937 rng(3);
  const int nb = 3;
  std::vector<uint8_t> b(34 * nb);
  std::vector<double> want(32 * nb);
  for (int k = 0; k < nb; ++k) {
    float d = 0.005f * (k + 1);
    put_f16(b, 34 * k, d);
    for (int j = 0; j < 32; ++j) {
      int q = static_cast<int>(rng() % 255) - 127;
      b[34 * k + 2 + j] = static_cast<uint8_t>(static_cast<int8_t>(q));
      want[32 * k + j] = q * f16(d);
    }
  }
  expect_close(decode(TensorType::kQ8_0, b, 32 * nb), want);
}

// Q4_K scale bytes: groups 0..3 keep scale and min in the low 6 bits of bytes g and g+4; groups
// 4..7 keep their low 4 bits in byte g+4 (scale low, min high) and their top 2 bits in the high
// bits of bytes g-4 (scale) and g (min).
void pack_q4k_scales(const int sc[8], const int mn[8], uint8_t s[12]) {
  for (int g = 0; g < 4; ++g) {
    s[g] = static_cast<uint8_t>(sc[g] | ((sc[g + 4] >> 4) << 6));
    s[g + 4] = static_cast<uint8_t>(mn[g] | ((mn[g + 4] >> 4) << 6));
    s[g + 8] = static_cast<uint8_t>((sc[g + 4] & 15) | ((mn[g + 4] & 15) << 4));
  }
}

TEST(GgmlBlocks, Q4_KFromCodes) {
  std::mt19937 rng(4);
  const int nb = 2;
  std::vector<uint8_t> b(144 * nb);
  std::vector<double> want(256 * nb);
  for (int k = 0; k < nb; ++k) {
    uint8_t* blk = b.data() + 144 * k;
    float d = 0.0137f * (k + 1), dmin = 0.0071f / (k + 1);
    put_f16(b, 144 * k, d);
    put_f16(b, 144 * k + 2, dmin);
    int sc[8], mn[8];
    for (int g = 0; g < 8; ++g) {
      sc[g] = static_cast<int>(rng() % 64);
      mn[g] = static_cast<int>(rng() % 64);
    }
    sc[7] = 63;  // exercise the top bits of the upper groups
    mn[5] = 48;
    pack_q4k_scales(sc, mn, blk + 4);
    int q[256];
    for (int& x : q) x = static_cast<int>(rng() % 16);
    // Each 32-byte run holds groups 2p (low nibbles) and 2p+1 (high nibbles).
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l) blk[16 + 32 * p + l] = static_cast<uint8_t>(q[64 * p + l] | (q[64 * p + 32 + l] << 4));
    for (int i = 0; i < 256; ++i) want[256 * k + i] = f16(d) * sc[i / 32] * q[i] - f16(dmin) * mn[i / 32];
  }
  expect_close(decode(TensorType::kQ4_K, b, 256 * nb), want, 1e-5);
}

TEST(GgmlBlocks, Q6_KFromCodes) {
  std::mt19937 rng(5);
  const int nb = 2;
  std::vector<uint8_t> b(210 * nb);
  std::vector<double> want(256 * nb);
  for (int k = 0; k < nb; ++k) {
    uint8_t* blk = b.data() + 210 * k;
    float d = 0.0021f * (k + 1);
    int q[256], sc[16];
    for (int& x : q) x = static_cast<int>(rng() % 64);
    for (int& x : sc) x = static_cast<int>(rng() % 256) - 128;
    // Per 128-value half: bytes l and l+32 of the low plane hold values l, l+64 (low/high nibble)
    // and l+32, l+96; byte l of the high plane holds the top 2 bits of l, l+32, l+64, l+96.
    for (int h = 0; h < 2; ++h) {
      const int* qq = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        blk[64 * h + l] = static_cast<uint8_t>((qq[l] & 15) | ((qq[64 + l] & 15) << 4));
        blk[64 * h + 32 + l] = static_cast<uint8_t>((qq[32 + l] & 15) | ((qq[96 + l] & 15) << 4));
        blk[128 + 32 * h + l] = static_cast<uint8_t>((qq[l] >> 4) | ((qq[32 + l] >> 4) << 2) | ((qq[64 + l] >> 4) << 4) |
                                                     ((qq[96 + l] >> 4) << 6));
      }
    }
    for (int j = 0; j < 16; ++j) blk[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(sc[j]));
    put_f16(b, 210 * k + 208, d);
    for (int i = 0; i < 256; ++i) want[256 * k + i] = f16(d) * sc[i / 16] * (q[i] - 32);
  }
  expect_close(decode(TensorType::kQ6_K, b, 256 * nb), want, 1e-5);
}

TEST(GgmlBlocks, PlainFloatTypes) {
  std::vector<float> v = {0.f, 1.f, -2.5f, 3.14159f, 65504.f, -1e-3f, 1e-7f, 123.456f};
  std::vector<uint8_t> f16b(v.size() * 2), bf16b(v.size() * 2), f32b(v.size() * 4);
  std::vector<double> want16, wantbf;
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = format::float_to_fp16(v[i]), bb = format::float_to_bf16(v[i]);
    std::memcpy(&f16b[2 * i], &h, 2);
    std::memcpy(&bf16b[2 * i], &bb, 2);
    want16.push_back(format::fp16_to_float(h));
    wantbf.push_back(format::bf16_to_float(bb));
  }
  std::memcpy(f32b.data(), v.data(), f32b.size());
  expect_close(decode(TensorType::kF16, f16b, v.size()), want16, 0);
  expect_close(decode(TensorType::kBf16, bf16b, v.size()), wantbf, 0);
  expect_close(decode(TensorType::kF32, f32b, v.size()), std::vector<double>(v.begin(), v.end()), 0);
  // Spot values against hand-derived fp16/bf16 values.
  EXPECT_EQ(decode(TensorType::kF16, f16b, v.size())[3], 3.140625f);
  EXPECT_EQ(decode(TensorType::kBf16, bf16b, v.size())[3], 3.140625f);
}

// Bytes b[i] = (37 i + (i^2 mod 251) + 11) mod 256 with the fp16 scale fields overwritten, two
// blocks per type; expected values from gguf-py (see the file comment).
std::vector<uint8_t> pattern(size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>((i * 37 + (i * i) % 251 + 11) & 0xFF);
  return b;
}

struct Spot {
  int index;
  double value;
};

void check_reference(TensorType t, const std::vector<uint8_t>& b, size_t n, double sum, double sumsq,
                     std::initializer_list<Spot> spots) {
  auto y = decode(t, b, n);
  double s = 0, s2 = 0;
  for (float x : y) {
    s += x;
    s2 += static_cast<double>(x) * x;
  }
  EXPECT_NEAR(s, sum, 1e-6 * (1 + std::fabs(sum)) + 1e-4);
  EXPECT_NEAR(s2, sumsq, 1e-6 * sumsq);
  for (const Spot& sp : spots) EXPECT_NEAR(y[sp.index], sp.value, 1e-6 * (1 + std::fabs(sp.value))) << "index " << sp.index;
}

TEST(GgmlBlocks, MatchesGgufPyReference) {
  {
    auto b = pattern(36);
    put_f16(b, 0, 0.0625f);
    put_f16(b, 18, 0.125f);
    check_reference(TensorType::kQ4_0, b, 64, -3.0625, 11.9179688,
                    {{0, 0.0625}, {1, -0.3125}, {2, 0.4375}, {5, 0.4375}, {15, -0.125}, {16, -0.1875}, {17, 0},
                     {31, 0.125}, {32, -0.5}, {39, -0.375}, {63, 0.875}});
  }
  {
    auto b = pattern(40);
    put_f16(b, 0, 0.03125f);
    put_f16(b, 2, -0.5f);
    put_f16(b, 20, 0.0625f);
    put_f16(b, 22, 0.5f);
    check_reference(TensorType::kQ4_1, b, 64, 24.15625, 37.4931641,
                    {{0, -0.03125}, {1, -0.09375}, {2, -0.09375}, {5, -0.21875}, {15, -0.25}, {16, -0.1875},
                     {17, -0.09375}, {31, -0.40625}, {32, 1.3125}, {39, 0.875}, {63, 1.1875}});
  }
  {
    auto b = pattern(68);
    put_f16(b, 0, 0.0078125f);
    put_f16(b, 34, 0.015625f);
    check_reference(TensorType::kQ8_0, b, 64, -3.0390625, 51.4155884,
                    {{0, 0.6953125}, {1, -0.9765625}, {2, -0.6328125}, {5, 0.4921875}, {15, -0.703125},
                     {16, -0.140625}, {17, 0.4375}, {31, 0.2890625}, {32, 1.625}, {39, -1.53125}, {63, -1.625}});
  }
  {
    auto b = pattern(288);
    put_f16(b, 0, 0.0123f);
    put_f16(b, 2, 0.0456f);
    put_f16(b, 144, 0.0246f);
    put_f16(b, 146, 0.0228f);
    check_reference(TensorType::kQ4_K, b, 512, 1534.54053, 14607.6494,
                    {{0, -2.32525635}, {1, 1.14294434}, {2, 5.76721191}, {5, -1.16918945}, {15, 1.14294434},
                     {16, 6.34524536}, {17, 0.564910889}, {31, 6.34524536}, {32, 0.270629883}, {33, 1.69726562},
                     {63, 1.34060669}, {64, -0.225524902}, {100, 2.64303589}, {127, 1.8682251}, {128, 2.87969971},
                     {130, 4.31863403}, {191, -0.565673828}, {200, -2.78118896}, {255, 0.126586914},
                     {256, 4.57748413}, {263, 11.9566345}, {511, 10.3260193}});
  }
  {
    auto b = pattern(420);
    put_f16(b, 208, 0.00789f);
    put_f16(b, 418, 0.01578f);
    check_reference(TensorType::kQ6_K, b, 512, 434.893433, 137070.494,
                    {{0, 15.0754852}, {1, -12.2039642}, {2, 16.5112457}, {5, -20.8185272}, {15, 17.9470062},
                     {16, -10.7287598}, {17, -17.4342346}, {31, 14.7520447}, {32, -0.268218994}, {33, 0.0788879395},
                     {63, -1.1675415}, {64, -13.6318359}, {100, -1.84597778}, {127, -13.2531738}, {128, -12.9218445},
                     {130, -1.23065186}, {191, -20.5029755}, {200, -19.564209}, {255, -17.8444519},
                     {256, 3.53417969}, {263, -2.01953125}, {511, 0.993988037}});
  }
}

TEST(GgmlBlocks, RejectsUnknownTypesAndPartialBlocks) {
  std::vector<uint8_t> b(256);
  std::vector<float> out(256);
  Status s = dequantize(6 /* q5_0 */, b.data(), 32, out.data());
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("q5_0"), std::string::npos) << s.message();
  EXPECT_EQ(dequantize(999, b.data(), 32, out.data()).code(), StatusCode::kUnsupported);
  EXPECT_EQ(dequantize(static_cast<uint32_t>(TensorType::kQ8_0), b.data(), 33, out.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(tensor_type_name(14), "q6_k");
  EXPECT_EQ(tensor_type_name(1234), "type1234");
}

}  // namespace
}  // namespace kvq::model::gguf
