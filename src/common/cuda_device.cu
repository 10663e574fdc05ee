#include <cuda_runtime.h>

#include "kvq/common/cuda_device.h"

namespace kvq {

Result<CudaDeviceInfo> cuda_device_info() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    return unsupported(std::string("no CUDA device: ") +
                       (e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0"));
  }
  cudaDeviceProp p{};
  e = cudaGetDeviceProperties(&p, 0);
  if (e != cudaSuccess) return Status(StatusCode::kCudaError, cudaGetErrorString(e));
  CudaDeviceInfo info;
  info.name = p.name;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.sm_count = p.multiProcessorCount;
  info.l2_bytes = static_cast<size_t>(p.l2CacheSize);
  info.global_mem_bytes = p.totalGlobalMem;
  info.smem_per_block_optin = p.sharedMemPerBlockOptin;
  cudaDriverGetVersion(&info.driver_version);
  cudaRuntimeGetVersion(&info.runtime_version);
  return info;
}

}  // namespace kvq
