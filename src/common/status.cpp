#include "kvq/common/status.h"

namespace kvq {

const char* to_string(StatusCode c) {
  switch (c) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kOutOfMemory: return "out of memory";
    case StatusCode::kCorruptInput: return "corrupt input";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kInternal: return "internal error";
    case StatusCode::kCudaError: return "cuda error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(kvq::to_string(code_)) + ": " + message_;
}

}  // namespace kvq
