// int4 instances (symmetric, two codes per byte; int4_outlier and the recent window take the
// CUDA backend's generic kernels).
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

DecodeKernelFn decode_kernel_int4(int head_dim, ScaleMode sm) { return scaled_instances<Format::kInt4>(head_dim, sm); }

}  // namespace kvq::attention::cuda::detail
