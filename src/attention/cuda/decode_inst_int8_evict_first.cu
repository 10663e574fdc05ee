// int8 instances with every ring copy under the L2 evict_first policy (DecodePlan::l2_evict_first).
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

DecodeKernelFn decode_kernel_evict_first_int8(int head_dim, ScaleMode sm) {
  return scaled_instances<Format::kInt8, false, L2Policy::kEvictFirst>(head_dim, sm);
}

}  // namespace kvq::attention::cuda::detail
