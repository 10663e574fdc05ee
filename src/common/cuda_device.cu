#include <cuda_runtime.h>

#include <string>

#include "kvq/common/cuda_device.h"

namespace kvq {

namespace {

std::string cuda_version_text(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

// Why there is no usable device, in words a user can act on. The runtime answers "driver version is
// insufficient" also when no driver is installed at all (cudaDriverGetVersion then reports 0), which
// on a machine without a GPU reads as if an old driver were the problem.
std::string no_device_reason(cudaError_t e) {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  switch (e) {
    case cudaSuccess:  // the count was 0
    case cudaErrorNoDevice:
      return "no NVIDIA GPU found (the CUDA driver sees no device)";
    case cudaErrorInsufficientDriver:
      if (driver == 0) return "no NVIDIA GPU/driver found (no CUDA driver is installed on this machine)";
      return "the NVIDIA driver supports CUDA " + cuda_version_text(driver) + " but this kvq needs CUDA " +
             cuda_version_text(runtime) + "; update the driver";
    default:
      return std::string("no usable NVIDIA GPU: ") + cudaGetErrorString(e);
  }
}

}  // namespace

Result<CudaDeviceInfo> cuda_device_info() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    return unsupported(no_device_reason(e));
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
