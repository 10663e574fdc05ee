#pragma once
// CPU reference backend: float32 accumulation, sink pages and quantized pages attended as two
// parts merged by log-sum-exp (the GPU kernels' structure). The oracle every other backend is
// tested against, and the CPU engine's attention.
//
// decode and prefill call can_implement first and return its Status without touching `out`.
// Prefill computes Q K^T and P V with BLAS sgemm in blocks of queries; decode uses plain loops.
#include <cstddef>

#include "kvq/attention/args.h"
#include "kvq/common/status.h"

namespace kvq::attention::cpu {

// kInvalidArgument for bad shapes, pointers and tables (num_q_heads % num_kv_heads, softmax scale,
// empty sequences, sink_len > seq_len, tables too short, page ids outside the pools);
// kUnsupported for valid requests this backend does not serve (head_dim outside 8..256 or not a
// multiple of 8, block size other than 16/32, int4).
Status can_implement(const DecodeArgs& args);
// Bytes of scratch decode allocates internally (the CPU backend owns it; reported for parity with
// backends that take a workspace).
size_t workspace_size(const DecodeArgs& args);
Status decode(const DecodeArgs& args);

Status can_implement(const PrefillArgs& args);
Status prefill(const PrefillArgs& args);

}  // namespace kvq::attention::cpu
