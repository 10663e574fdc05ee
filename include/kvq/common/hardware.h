#pragma once
// What kvq knows about the machine it runs on: the CPU (always) and the GPU the build can see.
// The probe fills GpuInfo from cuda_device_info() in CUDA builds; a CPU build leaves it empty.
#include <cstdint>
#include <string>

namespace kvq {

struct CpuInfo {
  std::string model;  // "model name" from /proc/cpuinfo (or the CPUID brand string)
  bool avx2 = false, avx512f = false, fma = false;
  int logical_cores = 0;
};

enum class GpuVendor { kNone, kNvidia, kAmd };

struct GpuInfo {
  GpuVendor vendor = GpuVendor::kNone;
  std::string name;
  int cc_major = 0, cc_minor = 0;  // NVIDIA compute capability
  std::string gfx_arch;            // AMD, e.g. "gfx942" or "gfx942:sramecc+:xnack-"
};

struct HardwareInfo {
  CpuInfo cpu;
  GpuInfo gpu;
};

// Never fails: fields it cannot read stay empty/false.
CpuInfo detect_cpu();

// Physical memory of the machine in bytes (0 when unknown). Loaders compare what a file asks them
// to allocate against it, so an oversized model is refused by name instead of dying in new.
uint64_t physical_memory_bytes();

}  // namespace kvq
