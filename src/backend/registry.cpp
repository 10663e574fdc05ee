// Backend factory. Compiled into the top library of the build (kvq_cuda when the CUDA backend is
// built, else kvq_core; see CMakeLists.txt), so the CPU-only build never references CUDA symbols.
#include <string>

#include "cpu/cpu_backend.h"
#include "cpu/reproducible.h"
#include "kvq/backend/backend.h"
#include "kvq/common/hardware.h"
#include "kvq/format/auto_format.h"
#ifdef KVQ_HAVE_CUDA
#include "cuda/cuda_backend.h"
#include "kvq/common/cuda_device.h"
#endif

namespace kvq::backend {

const char* backend_name(BackendKind k) { return k == BackendKind::kCuda ? "cuda" : "cpu"; }

size_t dtype_size(DType t) { return t == DType::kBf16 ? 2 : 4; }

const char* numerics_name(Numerics n) { return n == Numerics::kReproducible ? "reproducible" : "fast"; }
Result<Numerics> parse_numerics(std::string_view name) {
  if (name == "fast") return Numerics::kFast;
  if (name == "reproducible") return Numerics::kReproducible;
  return invalid_argument("unknown numerics '" + std::string(name) + "' (use fast or reproducible)");
}

namespace {
Status cuda_usable() {
#ifdef KVQ_HAVE_CUDA
  auto info = cuda_device_info();
  if (!info.is_ok()) return info.status();
  return Status::ok();
#else
  return unsupported("this kvq was built without CUDA (configure with -DKVQ_CUDA=ON on a machine with nvcc)");
#endif
}
}  // namespace

Result<BackendKind> resolve_backend(std::string_view name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") {
    Status st = cuda_usable();
    if (!st.is_ok()) return Status(StatusCode::kUnsupported, "--backend cuda: " + st.message());
    return BackendKind::kCuda;
  }
  if (name == "auto") return cuda_usable().is_ok() ? BackendKind::kCuda : BackendKind::kCpu;
  return invalid_argument("unknown backend '" + std::string(name) + "' (use cpu, cuda or auto)");
}

std::vector<BackendKind> available_backends() {
  std::vector<BackendKind> v{BackendKind::kCpu};
  if (cuda_usable().is_ok()) v.push_back(BackendKind::kCuda);
  return v;
}

Format auto_cache_format(BackendKind kind) {
  HardwareInfo hw;
  hw.cpu = detect_cpu();
#ifdef KVQ_HAVE_CUDA
  if (kind == BackendKind::kCuda) {
    auto dev = cuda_device_info();
    if (dev.is_ok()) {
      hw.gpu.vendor = GpuVendor::kNvidia;
      hw.gpu.name = dev.value().name;
      hw.gpu.cc_major = dev.value().cc_major;
      hw.gpu.cc_minor = dev.value().cc_minor;
    }
  }
#else
  (void)kind;
#endif
  return choose_auto_format(hw).format;
}

Result<std::unique_ptr<Backend>> create_backend(BackendKind kind, const BackendOptions& opts) {
  if (kind == BackendKind::kCpu) {
    if (opts.numerics == Numerics::kReproducible) KVQ_RETURN_IF_ERROR(cpu_reproducible::supported());
    return std::unique_ptr<Backend>(new CpuBackend(opts));
  }
#ifdef KVQ_HAVE_CUDA
  KVQ_RETURN_IF_ERROR(cuda_usable());
  return create_cuda_backend(opts);
#else
  return cuda_usable();
#endif
}

}  // namespace kvq::backend
