// int8 instances.
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

DecodeKernelFn decode_kernel_int8(int head_dim, ScaleMode sm) { return scaled_instances<Format::kInt8>(head_dim, sm); }

}  // namespace kvq::attention::cuda::detail
