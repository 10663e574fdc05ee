#pragma once
// Argument checks for arrays that arrive through DLPack / the buffer protocol. Every op checks all
// of its arrays here, before any kernel runs, and refuses with a ValueError naming the argument,
// what was expected and what came: the C++ ops below would only see raw pointers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "kvq/common/status.h"

namespace kvq::py {

namespace nb = nanobind;
using InArray = nb::ndarray<nb::ro>;  // read-only inputs (numpy arrays may be non-writable)
using OutArray = nb::ndarray<>;

// Where an array lives: nb::device::cpu::value or nb::device::cuda::value, and the ordinal.
struct Place {
  int type = nb::device::cpu::value;
  int id = 0;
  bool operator==(const Place& o) const { return type == o.type && (type == nb::device::cpu::value || id == o.id); }
  std::string name() const;
};

[[noreturn]] void throw_value_error(const std::string& msg);
// Raises the Python exception for a failed Status with the Status's own message:
// kInvalidArgument / kCorruptInput -> ValueError, kUnsupported -> NotImplementedError,
// kOutOfMemory -> MemoryError, kNotFound -> LookupError, anything else -> RuntimeError.
void throw_if_error(const Status& s);

std::string dtype_name(nb::dlpack::dtype t);

// What an argument must be. Shape entries < 0 accept any extent (kAny).
inline constexpr int64_t kAny = -1;
struct ArraySpec {
  const char* op;    // "paged_decode"
  const char* name;  // "query"
  nb::dlpack::dtype dtype;
  std::initializer_list<int64_t> shape;
  const char* shape_text;  // "[num_seqs, num_q_heads, head_dim]" for the message
};

// Checks dtype, rank, extents, C-contiguity and place; returns the array's extents.
template <class A>
void check_array(const A& a, const ArraySpec& spec, const Place& place);

Place place_of(int device_type, int device_id);
template <class A>
Place place_of(const A& a) { return place_of(a.device_type(), a.device_id()); }

}  // namespace kvq::py
