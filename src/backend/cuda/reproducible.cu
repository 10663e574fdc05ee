// Reproducible numerics on the device: the same rp:: operations in the same order as the CPU
// backend's reproducible ops (src/backend/cpu/reproducible.cpp), laid out for a GPU only where the
// layout cannot change an element's arithmetic (which thread computes it, what is staged in shared
// memory). Correct first, then fast enough for an eval: these are references, not serving kernels.
#include "reproducible.h"

#include <cstdint>
#include <string>

#include "kvq/attention/reproducible.h"
#include "kvq/common/reproducible_math.h"
#include "kvq/format/bf16.h"

namespace kvq::backend::cuda_reproducible {
namespace {

Status launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::ok();
  return internal_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// GEMM: a CTA computes a 64 x 64 tile of y (rows x outputs), a thread 4 x 4 of it. Operands pass
// through shared memory 16 k at a time; every output accumulates acc = fma(x[k], w[k], acc) for
// k = 0, 1, ... in order from 0, as the CPU's panels do, then beta's add.
constexpr int kTile = 64, kTk = 16, kGemmThreads = 256;

template <bool kBf16>
__global__ void __launch_bounds__(kGemmThreads)
    gemm_kernel(const float* __restrict__ x, int rows, int in, const void* __restrict__ w, int out, float* y, bool add) {
  __shared__ float xs[kTk][kTile + 4];
  __shared__ float ws[kTk][kTile + 4];
  const int r0 = blockIdx.y * kTile, o0 = blockIdx.x * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int k0 = 0; k0 < in; k0 += kTk) {
    for (int idx = threadIdx.x; idx < kTile * kTk; idx += kGemmThreads) {
      const int t = idx / kTk, kk = idx % kTk, k = k0 + kk;
      float xv = 0.f, wv = 0.f;
      if (r0 + t < rows && k < in) {
        xv = x[size_t(r0 + t) * in + k];
        if (kBf16) xv = format::bf16_to_float(format::float_to_bf16(xv));
      }
      if (o0 + t < out && k < in) {
        const size_t wi = size_t(o0 + t) * in + k;
        wv = kBf16 ? format::bf16_to_float(static_cast<const uint16_t*>(w)[wi]) : static_cast<const float*>(w)[wi];
      }
      xs[kk][t] = xv;
      ws[kk][t] = wv;
    }
    __syncthreads();
    const int kn = min(kTk, in - k0);
    for (int kk = 0; kk < kn; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i], b[i] = ws[kk][tx * 4 + i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = rp::fma(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = r0 + ty * 4 + i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int o = o0 + tx * 4 + j;
      if (o >= out) continue;
      float* yo = y + size_t(r) * out + o;
      *yo = add ? rp::add(*yo, acc[i][j]) : acc[i][j];
    }
  }
}

// One warp per row: lane 0 sums the squares in order (rp::rms_factor), every lane scales.
__global__ void rmsnorm_kernel(const float* x, const float* __restrict__ wt, float* y, int rows, int dim, float eps) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* xr = x + size_t(row) * dim;
  float* yr = y + size_t(row) * dim;
  float s = 0.f;
  if (lane == 0) s = rp::rms_factor(xr, dim, eps);
  s = __shfl_sync(0xffffffffu, s, 0);  // every read of x is done before y (which may alias x) is written
  for (int i = lane; i < dim; i += 32) yr[i] = rp::mul(rp::mul(xr[i], s), wt[i]);
}

__global__ void swiglu_kernel(float* gate, const float* __restrict__ up, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    gate[i] = rp::silu_mul(gate[i], up[i]);
}

// One thread per (row, query head): attention::attend_reproducible, the CPU's function, scores
// recomputed in the second pass (the same bits as the CPU's kept scores).
constexpr int kAttendThreads = 64;

template <Format F>
__global__ void __launch_bounds__(kAttendThreads)
    attend_kernel(const attention::TokenSource src, const float* q, float* out, float* lse, int rows, int num_q_heads,
                  float scale, int prefill_pos0) {
  const size_t item = blockIdx.x * size_t(kAttendThreads) + threadIdx.x;
  if (item >= size_t(rows) * num_q_heads) return;
  const int r = static_cast<int>(item / num_q_heads), hq = static_cast<int>(item % num_q_heads);
  const int d = src.geom.head_dim, group = num_q_heads / src.geom.num_kv_heads;
  const bool prefill = prefill_pos0 >= 0;
  const int seq = prefill ? 0 : r;
  const int len = prefill ? prefill_pos0 + r + 1 : src.tables.seq_lens[r];
  const int sink_len = min(max(src.tables.sink_lens[seq], 0), max(len, 0));
  float acc[attention::kReproducibleMaxHeadDim];
  const size_t at = item * d;
  const float l = attention::attend_reproducible<F>(src, seq, len, sink_len, hq / group, q + at, scale, acc, nullptr);
  for (int i = 0; i < d; ++i) out[at + i] = acc[i];
  if (lse != nullptr) lse[item] = l;
}

}  // namespace

Status gemm(const GemmArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return Status::ok();
  const dim3 grid((a.w.rows + kTile - 1) / kTile, (a.rows + kTile - 1) / kTile);
  if (grid.y > 65535) return unsupported("cuda gemm (reproducible): too many rows for one launch");
  if (a.w.dtype == DType::kBf16)
    gemm_kernel<true><<<grid, kGemmThreads, 0, stream>>>(a.x, a.rows, a.w.cols, a.w.data, a.w.rows, a.y, a.beta != 0.f);
  else
    gemm_kernel<false><<<grid, kGemmThreads, 0, stream>>>(a.x, a.rows, a.w.cols, a.w.data, a.w.rows, a.y, a.beta != 0.f);
  return launched("cuda gemm (reproducible)");
}

Status rmsnorm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return Status::ok();
  constexpr int kWarps = 4;
  rmsnorm_kernel<<<(a.rows + kWarps - 1) / kWarps, 32 * kWarps, 0, stream>>>(a.x, a.weight, a.y, a.rows, a.dim, a.eps);
  return launched("cuda rmsnorm (reproducible)");
}

Status swiglu(const SwigluArgs& a, cudaStream_t stream) {
  if (a.n == 0) return Status::ok();
  const size_t blocks = (a.n + 255) / 256;
  swiglu_kernel<<<static_cast<unsigned>(blocks < 65535u * 16 ? blocks : 65535u * 16), 256, 0, stream>>>(a.gate, a.up, a.n);
  return launched("cuda swiglu (reproducible)");
}

Status attend(const cache::CacheGeometry& g, const cache::LayerView& layer, const cache::BatchTablesView& t,
              const float* q, float* out, float* lse, int rows, int num_q_heads, float scale, int prefill_pos0,
              cudaStream_t stream) {
  if (rows == 0) return Status::ok();
  if (g.head_dim > attention::kReproducibleMaxHeadDim)
    return unsupported("cuda attention (reproducible): head_dim " + std::to_string(g.head_dim) + " > " +
                       std::to_string(attention::kReproducibleMaxHeadDim));
  const attention::TokenSource src{g, layer, t};
  const size_t items = size_t(rows) * num_q_heads;
  const unsigned blocks = static_cast<unsigned>((items + kAttendThreads - 1) / kAttendThreads);
  KVQ_RETURN_IF_ERROR(attention::with_reproducible_format(g.format, [&](auto f) {
    attend_kernel<decltype(f)::value><<<blocks, kAttendThreads, 0, stream>>>(src, q, out, lse, rows, num_q_heads, scale,
                                                                             prefill_pos0);
    return Status::ok();
  }));
  return launched(prefill_pos0 < 0 ? "cuda decode (reproducible)" : "cuda prefill (reproducible)");
}

}  // namespace kvq::backend::cuda_reproducible
