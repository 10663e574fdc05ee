// int8 instances.
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

template <int D>
static DecodeKernelFn pick_int8(ScaleMode sm) {
  switch (sm) {
    case ScaleMode::kTensor: return decode_instance<Format::kInt8, D, ScaleMode::kTensor>();
    case ScaleMode::kToken: return decode_instance<Format::kInt8, D, ScaleMode::kToken>();
    default: return {};
  }
}

DecodeKernelFn decode_kernel_int8(int head_dim, ScaleMode sm) {
  switch (head_dim) {
    case 64: return pick_int8<64>(sm);
    case 128: return pick_int8<128>(sm);
    case 256: return pick_int8<256>(sm);
    default: return {};
  }
}

}  // namespace kvq::attention::cuda::detail
