#pragma once
// CPU reference backend: float32 accumulation, sink pages and quantized pages merged by
// log-sum-exp. The oracle every other backend is tested against.
#include <cstddef>

#include "kvq/attention/args.h"
#include "kvq/common/status.h"

namespace kvq::attention::cpu {

Status can_implement(const DecodeArgs& args);
size_t workspace_size(const DecodeArgs& args);
Status decode(const DecodeArgs& args);

Status can_implement(const PrefillArgs& args);
Status prefill(const PrefillArgs& args);

}  // namespace kvq::attention::cpu
