// int8 instances.
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

template <int D>
static DecodeKernelFn pick_int8(ScaleMode sm, int variant) {
  switch (sm) {
    case ScaleMode::kTensor: return decode_instance<Format::kInt8, D, ScaleMode::kTensor>(variant);
    case ScaleMode::kToken: return decode_instance<Format::kInt8, D, ScaleMode::kToken>(variant);
    default: return {};
  }
}

DecodeKernelFn decode_kernel_int8(int head_dim, ScaleMode sm, int variant) {
  switch (head_dim) {
    case 64: return pick_int8<64>(sm, variant);
    case 128: return pick_int8<128>(sm, variant);
    case 256: return pick_int8<256>(sm, variant);
    default: return {};
  }
}

}  // namespace kvq::attention::cuda::detail
