#pragma once
// Next-token choice on the device, following model::sample_with_uniform (src/model/generate.cpp):
//   sample_prep_kernel   per row: argmax (ties to the lowest id) and, for temperature > 0, the
//                        weights p[i] = exp((logit[i] - max) / T) in double and their sum;
//   (nucleus rows)       the host side sorts each row's weights descending with CUB's segmented
//                        radix sort, which is stable, so equal weights keep ascending ids (the CPU's
//                        tie order);
//   sample_pick_kernel   per row: greedy -> argmax; top_p = 1 -> first id whose running mass exceeds
//                        u * sum, in id order; top_p < 1 -> the smallest sorted prefix whose mass
//                        reaches top_p * sum, then the first of it whose running mass exceeds u * mass.
// Sums and running masses are exact-order on the CPU and block-parallel here (double both), so a
// pick can differ only when u lands within a few double ulps of a boundary.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace kvq::backend::cuda_ops {

constexpr int kSampleThreads = 1024;

struct ArgMax {
  float v;
  int i;
};
struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
  }
};

__global__ void __launch_bounds__(kSampleThreads) sample_prep_kernel(const float* logits, int vocab, const float* temps,
                                                                     int32_t* argmax_out, double* probs, double* sums) {
  const int r = blockIdx.x;
  const float* x = logits + size_t(r) * vocab;
  ArgMax best{-__builtin_huge_valf(), vocab};
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    if (x[i] > best.v || (x[i] == best.v && i < best.i)) best = ArgMax{x[i], i};
  using Reduce = cub::BlockReduce<ArgMax, kSampleThreads>;
  using Sum = cub::BlockReduce<double, kSampleThreads>;
  __shared__ union {
    typename Reduce::TempStorage r;
    typename Sum::TempStorage s;
  } tmp;
  __shared__ int arg;
  const ArgMax b = Reduce(tmp.r).Reduce(best, ArgMaxOp());
  if (threadIdx.x == 0) arg = b.i < vocab ? b.i : 0;  // all NaN / -inf: id 0, as the CPU's argmax
  __syncthreads();
  if (threadIdx.x == 0) argmax_out[r] = arg;
  const float t = temps[r];
  if (!(t > 0.f)) return;
  const double mx = x[arg];
  double* p = probs + size_t(r) * vocab;
  double s = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    p[i] = exp((static_cast<double>(x[i]) - mx) / t);
    s += p[i];
  }
  const double total = Sum(tmp.s).Sum(s);
  if (threadIdx.x == 0) sums[r] = total;
}

// First index j in [0, n) where the running sum of w[0..j] exceeds `bound` (kReach: reaches it),
// n when none; *sum_out (optional) gets the running sum there (the total when none).
template <bool kReach>
__device__ int block_first_cross(const double* w, int n, double bound, double* sum_out) {
  using Scan = cub::BlockScan<double, kSampleThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int found;
  __shared__ double found_sum;
  if (threadIdx.x == 0) found = n;
  __syncthreads();
  double carry = 0;
  for (int c = 0; c < n; c += blockDim.x) {
    const int i = c + threadIdx.x;
    const double v = i < n ? w[i] : 0.0;
    double incl, agg;
    Scan(tmp).InclusiveSum(v, incl, agg);
    incl += carry;
    const bool hit = i < n && (kReach ? incl >= bound : incl > bound);
    if (hit) atomicMin(&found, i);
    __syncthreads();
    const int f = found;
    if (f < n) {
      if (i == f) found_sum = incl;
      __syncthreads();
      if (sum_out != nullptr) *sum_out = found_sum;
      return f;
    }
    carry += agg;
  }
  if (sum_out != nullptr) *sum_out = carry;
  return n;
}

__global__ void __launch_bounds__(kSampleThreads) sample_pick_kernel(int vocab, const float* temps, const float* top_ps,
                                                                     const double* us, const int32_t* argmax,
                                                                     const double* probs, const double* sums,
                                                                     const double* sorted_p, const int32_t* sorted_ids,
                                                                     int32_t* out) {
  const int r = blockIdx.x;
  if (!(temps[r] > 0.f)) {
    if (threadIdx.x == 0) out[r] = argmax[r];
    return;
  }
  const double sum = sums[r], u = us[r];
  if (top_ps[r] >= 1.f) {
    const int j = block_first_cross<false>(probs + size_t(r) * vocab, vocab, u * sum, nullptr);
    if (threadIdx.x == 0) out[r] = j < vocab ? j : argmax[r];
    return;
  }
  const double* sp = sorted_p + size_t(r) * vocab;
  const int32_t* ids = sorted_ids + size_t(r) * vocab;
  double mass = 0;
  const int last = block_first_cross<true>(sp, vocab, static_cast<double>(top_ps[r]) * sum, &mass);
  const int keep = last < vocab ? last + 1 : vocab;
  __syncthreads();
  const int j = block_first_cross<false>(sp, keep, u * mass, nullptr);
  if (threadIdx.x == 0) out[r] = j < keep ? ids[j] : ids[0];
}

__global__ void iota_rows_kernel(int32_t* ids, int rows, int vocab, int32_t* offsets) {
  const size_t n = size_t(rows) * vocab;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    ids[i] = static_cast<int32_t>(i % vocab);
  if (blockIdx.x == 0)
    for (int r = threadIdx.x; r <= rows; r += blockDim.x) offsets[r] = r * vocab;
}

}  // namespace kvq::backend::cuda_ops
