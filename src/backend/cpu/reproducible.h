#pragma once
// The CPU backend's ops in reproducible numerics (backend.h, Numerics::kReproducible): the host side
// of the arithmetic that src/backend/cuda/reproducible.cu runs on the device. Work is split over
// `threads` threads by output element, which never changes an element's order of operations.
#include "kvq/backend/backend.h"

namespace kvq::backend::cpu_reproducible {

// Whether this CPU runs the mode (x86-64 needs AVX2 and FMA: the hot loops are compiled for them).
// The reason when not.
Status supported();

Status gemm(const GemmArgs& a, int threads);
void swiglu(const SwigluArgs& a);
Status decode(const DecodeArgs& a, int threads);
Status prefill(const PrefillArgs& a, int threads);

}  // namespace kvq::backend::cpu_reproducible
