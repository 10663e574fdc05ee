#pragma once
// The CUDA backend's ops in reproducible numerics (backend.h, Numerics::kReproducible): the device
// side of src/backend/cpu/reproducible.cpp. Each launch enqueues on `stream` and is capturable.
#include <cuda_runtime.h>

#include "kvq/backend/backend.h"

namespace kvq::backend::cuda_reproducible {

Status gemm(const GemmArgs& a, cudaStream_t stream);
Status rmsnorm(const RmsNormArgs& a, cudaStream_t stream);
Status swiglu(const SwigluArgs& a, cudaStream_t stream);
// Decode (prefill_pos0 < 0: row r = sequence r) or causal prefill of sequence 0 from prefill_pos0.
Status attend(const cache::CacheGeometry& g, const cache::LayerView& layer, const cache::BatchTablesView& t,
              const float* q, float* out, float* lse, int rows, int num_q_heads, float scale, int prefill_pos0,
              cudaStream_t stream);

}  // namespace kvq::backend::cuda_reproducible
