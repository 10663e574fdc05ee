#pragma once
// Elementwise and row kernels of the CUDA backend: fp32 -> bf16 conversion, RMSNorm, RoPE, SwiGLU,
// embedding lookup. Each follows the CPU backend's arithmetic (cpu_backend.cpp) so the two differ
// only where the math library does (expf): products and sums that the CPU rounds separately are
// rounded separately here too (__fmul_rn & co. keep nvcc from contracting them into FMAs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/format/bf16.h"

namespace kvq::backend::cuda_ops {

constexpr int kEltThreads = 256;

inline unsigned elt_blocks(size_t n) {
  const size_t b = (n + kEltThreads - 1) / kEltThreads;
  return static_cast<unsigned>(b < 65535u * 16 ? (b > 0 ? b : 1) : 65535u * 16);
}

// Round to nearest even, as format::float_to_bf16 (the CPU backend's weight conversion).
__global__ void f32_to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ y, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = format::float_to_bf16(x[i]);
}

// One CTA per row. The sum of squares is accumulated in double like the CPU's, so the row scale
// differs from the CPU's only by the order of the additions.
__global__ void __launch_bounds__(kEltThreads) rmsnorm_kernel(const float* x, const float* __restrict__ w, float* y,
                                                              int dim, float eps) {
  const size_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float* yr = y + row * dim;
  double ss = 0;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += static_cast<double>(xr[i]) * xr[i];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  __shared__ double part[kEltThreads / 32];
  __shared__ float scale;
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) t += part[i];
    scale = static_cast<float>(1.0 / sqrt(t / dim + static_cast<double>(eps)));
  }
  __syncthreads();  // every read of x is done before y (which may alias x) is written
  const float s = scale;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = __fmul_rn(__fmul_rn(xr[i], s), w[i]);
}

// One thread per (row, head, pair).
__global__ void rope_kernel(float* x, int rows, int heads, int head_dim, const int32_t* __restrict__ pos,
                            const float* __restrict__ cos_t, const float* __restrict__ sin_t, bool half_split) {
  const int half = head_dim / 2;
  const size_t n = size_t(rows) * heads * half;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < n; idx += size_t(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const size_t rh = idx / half;
    const int r = static_cast<int>(rh / heads);
    float* hv = x + rh * head_dim;
    const float c = cos_t[size_t(pos[r]) * half + i], s = sin_t[size_t(pos[r]) * half + i];
    const int p0 = half_split ? i : 2 * i, p1 = half_split ? i + half : 2 * i + 1;
    const float x0 = hv[p0], x1 = hv[p1];
    hv[p0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    hv[p1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  }
}

// RotateHeadsArgs: one warp per (row, head) vector, staged in shared memory. Each butterfly is
// the CPU backend's (a + b, a - b) on the same pair, stage after stage, then one multiply by the
// same norm, so the result is bit-identical to the CPU's.
constexpr int kRotateWarps = 4;  // per CTA; shared memory kRotateWarps * head_dim floats

__global__ void __launch_bounds__(kRotateWarps * 32)
    hadamard_heads_kernel(float* x, size_t vecs, int d, float norm) {
  extern __shared__ float rot_sh[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s = rot_sh + size_t(warp) * d;
  for (size_t v = blockIdx.x * size_t(kRotateWarps) + warp; v < vecs; v += size_t(gridDim.x) * kRotateWarps) {
    float* g = x + v * d;
    for (int i = lane; i < d; i += 32) s[i] = g[i];
    __syncwarp();
    for (int h = 1; h < d; h <<= 1) {
      for (int j = lane; j < d / 2; j += 32) {
        const int i = (j / h) * 2 * h + j % h;
        const float p = s[i], q = s[i + h];
        s[i] = __fadd_rn(p, q);
        s[i + h] = __fsub_rn(p, q);
      }
      __syncwarp();
    }
    for (int i = lane; i < d; i += 32) g[i] = __fmul_rn(s[i], norm);
    __syncwarp();  // the next vector's loads must not overwrite s before every lane has read it
  }
}

__global__ void swiglu_kernel(float* gate, const float* __restrict__ up, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    gate[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), up[i]);
  }
}

// One CTA per row; table fp32 or bf16 (bf16 = true).
__global__ void embed_kernel(const int32_t* __restrict__ tokens, const void* table, bool bf16, int cols, float* out) {
  const size_t r = blockIdx.x;
  const size_t base = size_t(tokens[r]) * cols;
  float* o = out + r * cols;
  if (bf16) {
    const uint16_t* t = static_cast<const uint16_t*>(table) + base;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = format::bf16_to_float(t[i]);
  } else {
    const float* t = static_cast<const float*>(table) + base;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = t[i];
  }
}

}  // namespace kvq::backend::cuda_ops
