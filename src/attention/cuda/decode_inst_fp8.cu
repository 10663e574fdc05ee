// fp8 instances (OCP and FNUZ share them: FNUZ is read as OCP with the scales halved).
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

template <int D>
static DecodeKernelFn pick_fp8(ScaleMode sm) {
  switch (sm) {
    case ScaleMode::kTensor: return decode_instance<Format::kFp8E4m3, D, ScaleMode::kTensor>();
    case ScaleMode::kToken: return decode_instance<Format::kFp8E4m3, D, ScaleMode::kToken>();
    default: return {};
  }
}

DecodeKernelFn decode_kernel_fp8(int head_dim, ScaleMode sm) {
  switch (head_dim) {
    case 64: return pick_fp8<64>(sm);
    case 128: return pick_fp8<128>(sm);
    case 256: return pick_fp8<256>(sm);
    default: return {};
  }
}

}  // namespace kvq::attention::cuda::detail
