#pragma once
// Kernel instances live in several translation units so they compile in parallel.
#include "decode_kernel.cuh"

namespace kvq::attention::cuda::detail {

struct DecodeKernelFn {
  void (*fn)(DecodeParams) = nullptr;
  int dyn_smem = 0;  // bytes of dynamic shared memory the launch needs
  explicit operator bool() const { return fn != nullptr; }
};

template <Format F, int D, ScaleMode SM>
DecodeKernelFn decode_instance() {
  return {decode_kernel<F, D, SM>, decode_dyn_smem_bytes<F, D, SM>()};
}
using MergeKernelFn = void (*)(const float*, const float*, int, float*, float*);

// nullptr for a head_dim without an instance.
DecodeKernelFn decode_kernel_fp8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_int8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_16bit(Format f, int head_dim);
MergeKernelFn decode_merge_kernel_for(int head_dim);

}  // namespace kvq::attention::cuda::detail
