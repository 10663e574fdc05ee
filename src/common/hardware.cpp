#include "kvq/common/hardware.h"

#include <unistd.h>

#include <fstream>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <cstring>
#endif

namespace kvq {

namespace {

std::string trim(std::string s) {
  size_t b = s.find_first_not_of(" \t");
  size_t e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::string model_from_proc_cpuinfo() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    // x86 says "model name", many Arm kernels only "CPU part"/"Hardware"; take the first that names it.
    if (line.rfind("model name", 0) == 0 || line.rfind("Hardware", 0) == 0) {
      size_t colon = line.find(':');
      if (colon != std::string::npos) return trim(line.substr(colon + 1));
    }
  }
  return {};
}

}  // namespace

CpuInfo detect_cpu() {
  CpuInfo info;
  info.model = model_from_proc_cpuinfo();
  info.logical_cores = static_cast<int>(std::thread::hardware_concurrency());
#if defined(__x86_64__) || defined(__i386__)
  if (info.model.empty()) {
    unsigned regs[12] = {};
    unsigned max_ext = __get_cpuid_max(0x80000000u, nullptr);
    if (max_ext >= 0x80000004u) {
      for (unsigned i = 0; i < 3; ++i)
        __get_cpuid(0x80000002u + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2], &regs[4 * i + 3]);
      char brand[49] = {};
      std::memcpy(brand, regs, 48);
      info.model = trim(brand);
    }
  }
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XGETBV), so a
  // feature reported here is one the process can actually use.
  __builtin_cpu_init();
  info.avx2 = __builtin_cpu_supports("avx2");
  info.avx512f = __builtin_cpu_supports("avx512f");
  info.fma = __builtin_cpu_supports("fma");
#endif
  return info;
}

uint64_t physical_memory_bytes() {
  long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

}  // namespace kvq
