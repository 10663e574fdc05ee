// fp8 instances (OCP and FNUZ share them: FNUZ is read as OCP with the scales halved).
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

DecodeKernelFn decode_kernel_fp8(int head_dim, ScaleMode sm) { return scaled_instances<Format::kFp8E4m3>(head_dim, sm); }

}  // namespace kvq::attention::cuda::detail
