// Placeholder until the CUDA backend lands.
#include "cuda_backend.h"

namespace kvq::backend {

Result<std::unique_ptr<Backend>> create_cuda_backend(const BackendOptions&) {
  return unsupported("the CUDA backend is not implemented yet");
}

}  // namespace kvq::backend
