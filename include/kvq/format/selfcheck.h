#pragma once
// Codec self-checks (DESIGN §7): kvq refuses to run when its codecs disagree with the platform.
#include "kvq/common/status.h"

namespace kvq::format {

// Host encoders against a table of published values (OCP/FNUZ spec points, ties, saturation,
// NaN/inf policy) plus decode -> encode round trips of every fp8 code. kInternal names the first
// disagreement.
Status check_codecs_on_host();

// Runs the same __host__ __device__ codecs on GPU 0 for all fp8, fp16 and bf16 codes and ~10^6
// floats, and compares them with the host results and with the hardware conversions of
// cuda_fp8.h / cuda_fp16.h / cuda_bf16.h (OCP E4M3 saturating; fp16/bf16 round to nearest).
// kUnsupported without a usable GPU; kInternal on any disagreement; kCudaError on CUDA failures.
// Declared always, defined only in the CUDA build (callers check KVQ_HAVE_CUDA).
Status check_codecs_on_device();

}  // namespace kvq::format
