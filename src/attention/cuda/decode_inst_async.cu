// Variant 2 (cp.async ring) instances: 8-bit formats, per-token/per-page scales, head_dim 64/128.
#include "decode_dispatch.cuh"
#include "decode_kernel_async.cuh"

namespace kvq::attention::cuda::detail {

DecodeAsyncKernel decode_kernel_async_for(Format f, int head_dim, ScaleMode sm) {
  if (sm != ScaleMode::kToken) return {};
  const bool fp8 = f == Format::kFp8E4m3 || f == Format::kFp8E4m3Fnuz;
  if (!fp8 && f != Format::kInt8) return {};
  switch (head_dim) {
    case 64:
      return fp8 ? DecodeAsyncKernel{async::decode_kernel_async<Format::kFp8E4m3, 64, ScaleMode::kToken>,
                                     async::decode_dyn_smem_bytes<Format::kFp8E4m3, 64, ScaleMode::kToken>()}
                 : DecodeAsyncKernel{async::decode_kernel_async<Format::kInt8, 64, ScaleMode::kToken>,
                                     async::decode_dyn_smem_bytes<Format::kInt8, 64, ScaleMode::kToken>()};
    case 128:
      return fp8 ? DecodeAsyncKernel{async::decode_kernel_async<Format::kFp8E4m3, 128, ScaleMode::kToken>,
                                     async::decode_dyn_smem_bytes<Format::kFp8E4m3, 128, ScaleMode::kToken>()}
                 : DecodeAsyncKernel{async::decode_kernel_async<Format::kInt8, 128, ScaleMode::kToken>,
                                     async::decode_dyn_smem_bytes<Format::kInt8, 128, ScaleMode::kToken>()};
    default: return {};
  }
}

}  // namespace kvq::attention::cuda::detail
