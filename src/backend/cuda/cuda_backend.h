#pragma once
// The CUDA backend (private header; reached through backend::create_backend).
#include "kvq/backend/backend.h"

namespace kvq::backend {

Result<std::unique_ptr<Backend>> create_cuda_backend(const BackendOptions& opts);

}  // namespace kvq::backend
