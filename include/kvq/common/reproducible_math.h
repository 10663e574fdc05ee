#pragma once
// The arithmetic of reproducible numerics (backend::Numerics::kReproducible, docs/ARCHITECTURE.md
// §8): every operation is one IEEE-754 fp32 operation rounded to nearest even, written out so that
// no compiler fuses, reorders or approximates it. Host and device call the same functions, so a
// computation written with them gives the same bits on the CPU and on a GPU.
//
// Why it exists: a quantized KV cache makes the forward pass chaotic. A one-ulp difference in a K
// row flips an fp8 code that sits on a rounding midpoint; the flip changes the next layers' inputs
// by far more than an ulp, which flips more codes, and after a few layers the two runs carry two
// different draws of the quantization noise. Two correct backends that only sum in another order
// then disagree on fp8 perplexity by about the noise of one window (docs/GPU_NOTES.md §15). With
// one arithmetic on both sides the CUDA forward reproduces the CPU's codes, scales and logits bit for
// bit, so any difference left is a bug, not noise.
//
// On the device the intrinsics (__fmul_rn & co.) are never contracted into FMAs; on the host the
// translation units that use these functions are compiled with -ffp-contract=off (CMakeLists.txt).
// Division and square root are correctly rounded on both (nvcc's defaults, no fast math).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvq/common/bits.h"
#include "kvq/common/macros.h"

namespace kvq::rp {

KVQ_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVQ_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVQ_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVQ_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// a * b + c with one rounding.
KVQ_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}
// max that ignores a NaN operand, as fmaxf on both sides.
KVQ_HD float max(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}
KVQ_HD float round_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // the default rounding mode: to nearest even
#endif
}

// The float with these bits (common/bits.h).
KVQ_HD float from_bits(uint32_t u) { return bits_float(u); }
// 2^n for n in [-126, 127], built from its bits (exact).
KVQ_HD float pow2i(int n) { return from_bits(static_cast<uint32_t>(n + 127) << 23); }

// e^x from fp32 operations only: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite, ln2 split in a
// part with 12 significant bits, so n * kLn2Hi is exact), e^r by a degree-7 Taylor polynomial in
// Horner form (truncation < 2^-27 relative), then the exact scaling by 2^n in two steps (subnormal
// results round once, in the last step). Within 2 ulp of e^x over the fp32 range (tested against
// std::exp in double); e^x overflows to +inf above 88.72, is 0 below -103.98, NaN stays NaN.
KVQ_HD float exp(float x) {
  if (!(x == x)) return x;
  if (x > 88.72283935546875f) return from_bits(0x7f800000u);
  if (x < -103.97908020019531f) return 0.f;
  constexpr float kLog2e = 1.44269502162933349609f;
  constexpr float kLn2Hi = 0.693145751953125f;          // 12 significant bits
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;  // ln 2 - kLn2Hi
  const float n = round_even(mul(x, kLog2e));
  float r = fma(-n, kLn2Hi, x);
  r = fma(-n, kLn2Lo, r);
  float p = 1.f / 5040.f;
  p = fma(p, r, 1.f / 720.f);
  p = fma(p, r, 1.f / 120.f);
  p = fma(p, r, 1.f / 24.f);
  p = fma(p, r, 1.f / 6.f);
  p = fma(p, r, 0.5f);
  p = fma(p, r, 1.f);
  p = fma(p, r, 1.f);
  const int ni = static_cast<int>(n);  // in [-150, 128]
  const int n1 = ni / 2, n2 = ni - n1;
  return mul(mul(p, pow2i(n1)), pow2i(n2));
}

// sum_i a[i] * b[i], accumulated in index order from 0 with one FMA a term.
KVQ_HD float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
  for (int i = 0; i < n; ++i) acc = fma(a[i], b[i], acc);
  return acc;
}

// silu(g) * u = g / (1 + e^-g) * u, each step rounded.
KVQ_HD float silu_mul(float g, float u) { return mul(div(g, add(1.f, exp(-g))), u); }

// The RMSNorm factor of a row: 1 / sqrt(mean(x^2) + eps), the squares summed in index order in
// double (each square is exact there), then one rounding to float. The CPU backend's RMSNorm in
// both numerics modes.
KVQ_HD float rms_factor(const float* x, int dim, float eps) {
  double ss = 0;
  for (int i = 0; i < dim; ++i) {
    const double v = static_cast<double>(x[i]);
#if defined(__CUDA_ARCH__)
    ss = __dadd_rn(ss, __dmul_rn(v, v));
#else
    ss += v * v;
#endif
  }
  return static_cast<float>(1.0 / std::sqrt(ss / dim + static_cast<double>(eps)));
}

}  // namespace kvq::rp
