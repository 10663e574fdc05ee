#pragma once
// The bits of an fp32 value and back, on the host and the device (no type punning on the host).
#include <cstdint>
#include <cstring>

#include "kvq/common/macros.h"

namespace kvq {

KVQ_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

KVQ_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

}  // namespace kvq
