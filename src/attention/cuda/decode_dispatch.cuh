#pragma once
// Kernel instances live in several translation units so they compile in parallel.
#include "decode_kernel.cuh"

namespace kvq::attention::cuda::detail {

struct DecodeKernelFn {
  void (*fn)(DecodeParams) = nullptr;
  explicit operator bool() const { return fn != nullptr; }
};
using MergeKernelFn = void (*)(const float*, const float*, int, float*, float*);

// Occupancy target per instance: 8-bit caches with head_dim <= 128 are capped at 128 registers
// (4 CTAs = 16 warps per SM), measured faster than the uncapped kernel (docs/GPU_NOTES.md §5).
template <Format F, int D, ScaleMode SM>
DecodeKernelFn decode_instance() {
  constexpr bool k8bit = F != Format::kBf16 && F != Format::kFp16;
  if constexpr (k8bit && D <= 128) {
    return {decode_kernel<F, D, SM, 4>};
  } else {
    return {decode_kernel<F, D, SM, 1>};
  }
}

// An empty DecodeKernelFn for a head_dim without an instance.
DecodeKernelFn decode_kernel_fp8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_int8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_16bit(Format f, int head_dim);
MergeKernelFn decode_merge_kernel_for(int head_dim);

}  // namespace kvq::attention::cuda::detail
