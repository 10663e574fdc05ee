#pragma once
// Checked integer arithmetic for sizes and counts read from files. Every loader computes lengths
// through these, so a forged header yields a kCorruptInput naming the quantity, never a wrapped
// (or negative) number. The bool forms return false on overflow and leave *out unspecified.
#include <cmath>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "kvq/common/status.h"

namespace kvq {

template <std::integral T>
[[nodiscard]] constexpr bool checked_add(T a, T b, T* out) {
  return !__builtin_add_overflow(a, b, out);
}

template <std::integral T>
[[nodiscard]] constexpr bool checked_mul(T a, T b, T* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// `v` as To when it is representable (sign and range), false otherwise.
template <std::integral To, std::integral From>
[[nodiscard]] constexpr bool checked_narrow(From v, To* out) {
  if (!std::in_range<To>(v)) return false;
  *out = static_cast<To>(v);
  return true;
}

// A floating-point value as an integer type: false for NaN, infinities, values outside To's range
// and values with a fractional part (a file that stores an integer as a float must store it
// exactly). Never performs the undefined out-of-range conversion.
template <std::integral To>
[[nodiscard]] bool checked_float_to_int(double v, To* out) {
  if (!std::isfinite(v) || std::trunc(v) != v) return false;
  // [min, 2^digits) is exactly the range of To; both bounds are exact doubles.
  const double lo = static_cast<double>(std::numeric_limits<To>::min());
  const double hi = std::ldexp(1.0, std::numeric_limits<To>::digits);
  if (v < lo || v >= hi) return false;
  *out = static_cast<To>(v);
  return true;
}

// Product / sum of unsigned quantities, or kCorruptInput "<what> overflows 64 bits".
inline Result<uint64_t> checked_product(std::initializer_list<uint64_t> factors, std::string_view what) {
  uint64_t p = 1;
  for (uint64_t f : factors)
    if (!checked_mul(p, f, &p)) return corrupt_input(std::string(what) + " overflows 64 bits");
  return p;
}

inline Result<uint64_t> checked_sum(std::initializer_list<uint64_t> terms, std::string_view what) {
  uint64_t s = 0;
  for (uint64_t t : terms)
    if (!checked_add(s, t, &s)) return corrupt_input(std::string(what) + " overflows 64 bits");
  return s;
}

}  // namespace kvq
