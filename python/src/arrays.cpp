#include "arrays.h"

#include <Python.h>

#include <vector>

namespace kvq::py {

std::string Place::name() const {
  if (type == nb::device::cpu::value) return "cpu";
  if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
  return "device type " + std::to_string(type);
}

Place place_of(int device_type, int device_id) { return Place{device_type, device_id}; }

void throw_value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

void throw_if_error(const Status& s) {
  if (s.is_ok()) return;
  PyObject* type = PyExc_RuntimeError;
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kCorruptInput: type = PyExc_ValueError; break;
    case StatusCode::kUnsupported: type = PyExc_NotImplementedError; break;
    case StatusCode::kOutOfMemory: type = PyExc_MemoryError; break;
    case StatusCode::kNotFound: type = PyExc_LookupError; break;
    default: break;
  }
  PyErr_SetString(type, s.message().c_str());
  throw nb::python_error();
}

std::string dtype_name(nb::dlpack::dtype t) {
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: kind = "bool"; break;
    default: kind = "other"; break;  // fp8/fp6/fp4 kinds: never accepted by an op
  }
  return std::string(kind) + std::to_string(t.bits);
}

namespace {

template <class It>
std::string join_shape(It first, It last) {
  std::string s = "[";
  for (It it = first; it != last; ++it) s += (it == first ? "" : ", ") + std::to_string(*it);
  return s + "]";
}

}  // namespace

template <class A>
void check_array(const A& a, const ArraySpec& spec, const Place& place) {
  const std::string what = std::string(spec.op) + ": " + spec.name;
  if (a.dtype() != spec.dtype)
    throw_value_error(what + " must be " + dtype_name(spec.dtype) + ", got " + dtype_name(a.dtype()));
  std::vector<int64_t> got(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) got[i] = static_cast<int64_t>(a.shape(i));
  bool ok = got.size() == spec.shape.size();
  for (size_t i = 0; ok && i < got.size(); ++i) {
    const int64_t want = spec.shape.begin()[i];
    ok = want < 0 || want == got[i];
  }
  if (!ok)
    throw_value_error(what + " must have shape " + spec.shape_text + " = " +
                      join_shape(spec.shape.begin(), spec.shape.end()) + " (-1: any), got " +
                      join_shape(got.begin(), got.end()));
  // C-contiguous: the ops index raw memory. Extents of 1 may carry any stride; an empty array
  // has no memory to index.
  int64_t expect = 1;
  for (size_t i = got.size(); a.size() > 0 && i-- > 0;) {
    if (got[i] != 1 && a.stride(i) != expect)
      throw_value_error(what + " must be C-contiguous (make it with .contiguous() / np.ascontiguousarray)");
    expect *= got[i];
  }
  const Place p = place_of(a);
  if (!(p == place)) throw_value_error(what + " is on " + p.name() + " but must be on " + place.name());
}

template void check_array(const InArray&, const ArraySpec&, const Place&);
template void check_array(const OutArray&, const ArraySpec&, const Place&);

}  // namespace kvq::py
