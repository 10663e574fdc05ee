// bf16 / fp16 cache instances (no scales; bulk-copy ring and register kernels) and the split merge.
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

DecodeKernelFn decode_kernel_16bit(Format f, int head_dim, bool ring) {
  if (f == Format::kBf16) return instances_16bit<Format::kBf16>(head_dim, ring);
  if (f == Format::kFp16) return instances_16bit<Format::kFp16>(head_dim, ring);
  return {};
}

MergeKernelFn decode_merge_kernel_for(int head_dim) {
  switch (head_dim) {
    case 64: return decode_merge_kernel<64>;
    case 128: return decode_merge_kernel<128>;
    case 256: return decode_merge_kernel<256>;
    default: return nullptr;
  }
}

}  // namespace kvq::attention::cuda::detail
