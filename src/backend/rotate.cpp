// The parts of the head rotation op (RotateHeadsArgs) every backend shares: its checks and its
// normalisation constant, so that backends cannot drift apart on either.
#include <cmath>
#include <string>

#include "kvq/backend/backend.h"

namespace kvq::backend {

Status check_rotate_heads(const RotateHeadsArgs& a) {
  if (a.x == nullptr || a.rows < 0 || a.num_heads <= 0)
    return invalid_argument("rotate heads: null operand or bad shape");
  const int d = a.head_dim;
  if (d < 2 || d > kMaxRotateHeadDim || (d & (d - 1)) != 0)
    return invalid_argument("--kv-rotate hadamard needs a head size that is a power of two in [2, " +
                            std::to_string(kMaxRotateHeadDim) + "]; this model's is " + std::to_string(d) +
                            " (use --kv-rotate none)");
  return Status::ok();
}

float rotate_heads_norm(int head_dim) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))); }

}  // namespace kvq::backend
