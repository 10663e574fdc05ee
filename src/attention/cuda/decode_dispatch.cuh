#pragma once
// Kernel instances live in several translation units so they compile in parallel.
#include "decode_kernel.cuh"

namespace kvq::attention::cuda::detail {

using DecodeKernelFn = void (*)(DecodeParams);
using MergeKernelFn = void (*)(const float*, const float*, int, float*, float*);

// nullptr for a head_dim without an instance.
DecodeKernelFn decode_kernel_fp8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_int8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_16bit(Format f, int head_dim);
MergeKernelFn decode_merge_kernel_for(int head_dim);

}  // namespace kvq::attention::cuda::detail
