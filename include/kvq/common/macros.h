#pragma once
// KVQ_HD marks code that must compile for both host and device: the codecs and the cache
// geometry are shared by the CPU reference and the CUDA kernels so the two cannot drift.
#if defined(__CUDACC__)
#define KVQ_HD __host__ __device__ __forceinline__
#else
#define KVQ_HD inline
#endif
