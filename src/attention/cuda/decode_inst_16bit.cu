// bf16 / fp16 cache instances (no scales; bulk-copy ring and register kernels) and the split merge.
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

template <Format F>
static DecodeKernelFn pick_16(int head_dim, bool ring) {
  switch (head_dim) {
    case 64: return ring ? bulk_instance<F, 64, ScaleMode::kNone>() : register_instance<F, 64, ScaleMode::kNone>();
    case 128: return ring ? bulk_instance<F, 128, ScaleMode::kNone>() : register_instance<F, 128, ScaleMode::kNone>();
    case 256: return register_instance<F, 256, ScaleMode::kNone>();
    default: return {};
  }
}

DecodeKernelFn decode_kernel_16bit(Format f, int head_dim, bool ring) {
  if (f == Format::kBf16) return pick_16<Format::kBf16>(head_dim, ring);
  if (f == Format::kFp16) return pick_16<Format::kFp16>(head_dim, ring);
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
