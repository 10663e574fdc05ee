// The timeline instances of every format (DecodePlan::cta_timeline): the product's kernels with their marks
// compiled in, in a translation unit of their own so the product's compile in parallel with them.
#include "decode_dispatch.cuh"

namespace kvq::attention::cuda::detail {

DecodeKernelFn decode_kernel_timeline(Format f, int head_dim, ScaleMode sm, bool ring) {
  switch (f) {
    case Format::kBf16: return instances_16bit<Format::kBf16, true>(head_dim, ring);
    case Format::kFp16: return instances_16bit<Format::kFp16, true>(head_dim, ring);
    case Format::kFp8E4m3:
    case Format::kFp8E4m3Fnuz: return scaled_instances<Format::kFp8E4m3, true>(head_dim, sm);
    case Format::kInt8: return scaled_instances<Format::kInt8, true>(head_dim, sm);
    case Format::kInt4: return scaled_instances<Format::kInt4, true>(head_dim, sm);
    default: return {};
  }
}

}  // namespace kvq::attention::cuda::detail
