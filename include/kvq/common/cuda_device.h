#pragma once
// What the CUDA runtime reports about device 0. Declared always; defined only in the CUDA build
// (callers check KVQ_HAVE_CUDA), so the CPU build never links the CUDA runtime.
#include <cstddef>
#include <string>

#include "kvq/common/status.h"

namespace kvq {

struct CudaDeviceInfo {
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t l2_bytes = 0;
  size_t global_mem_bytes = 0;
  size_t smem_per_block_optin = 0;
  int driver_version = 0, runtime_version = 0;
};

// kUnsupported with a readable reason when there is no usable GPU (no device, no driver).
Result<CudaDeviceInfo> cuda_device_info();

}  // namespace kvq
