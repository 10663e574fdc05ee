#pragma once
// CUDA cache write: quantize new K/V rows and scatter them into the pages (DESIGN §5, `write`).
// Emits the same codes and scales as PagedKvCache::write / quant::quantize_row, bit for bit
// (tests/attention/write_test.cu checks codes and scales against the host cache).
//
// Input rows are [num_tokens][num_kv_heads][head_dim] in bf16 (what engines produce; default) or
// fp32. Each token goes where `slot_mapping` says:
//   slot >= 0:  main page slot, page * block_size + slot_in_page   (quantized pool)
//   slot <  0:  sink slot, -(sink_page * block_size + slot_in_page) - 1 (bf16 sink pool)
// Scales follow the layer's granularity, as the host cache does:
//   per_token_head: amax of the (token, head) row / qmax (warp reduction per row);
//   per_block_head: amax of the page head's tokens / qmax; a page whose first new slot is 0
//     starts fresh, otherwise a larger amax re-quantizes the slots before it (at most
//     block_size x head_dim codes). The exact amax behind each page-head scale is kept in
//     `k_block_amax` / `v_block_amax` ([num_pages][num_kv_heads], the device twin of the host
//     cache's bookkeeping), so growth is decided exactly as on the host;
//   per_tensor: layer scale fixed by the first write that reaches the main pool (a zero scale
//     means "not yet set"): the amax over all of this call's main-pool rows / qmax.
// Non-finite inputs are stored as 0 and left out of amax (no counters on the GPU).
//
// Contract (the engine's normal use): a call appends tokens. For per_block_head, the tokens of
// one page are consecutive in the call, in slot order, and the page's earlier slots (before the
// call's first slot in that page) are exactly the ones already written. Rewriting written slots
// is a host-cache feature the GPU writer does not offer.
#include <cstddef>
#include <cstdint>

#include "kvq/cache/layout.h"
#include "kvq/common/status.h"

struct CUstream_st;

namespace kvq::attention::cuda {

enum class InputType : uint8_t { kBf16, kFp32 };

struct WriteArgs {
  cache::CacheGeometry geom;
  cache::LayerView layer;               // device planes
  float* k_block_amax = nullptr;        // per_block_head only, [num_pages][num_kv_heads], start 0
  float* v_block_amax = nullptr;
  const void* k = nullptr;              // [num_tokens][num_kv_heads][head_dim]
  const void* v = nullptr;
  InputType input = InputType::kBf16;
  int num_tokens = 0;
  const int32_t* slot_mapping = nullptr;  // [num_tokens], device
};

// slot_mapping entries are encoded by cache::encode_main_slot / encode_sink_slot (cache/layout.h).

Status can_implement(const WriteArgs& args);
size_t workspace_size(const WriteArgs& args);  // small scratch for per_tensor, else 0
// Enqueues the write on `stream` (capturable). `workspace`: workspace_size() bytes of device memory.
Status run(const WriteArgs& args, void* workspace, CUstream_st* stream);

// Self-check of the write kernels' fast encoders (hardware fp8 conversion, FNUZ through 2x, int8
// rounding): encodes every float bit pattern (NaN excluded: the writer zeroes it first) on the
// device and counts the codes that differ from the scalar writer in format/. Synchronous.
Result<uint64_t> count_encoder_mismatches(Format f);

// Self-check of the writer's division (one reciprocal per row plus an exact FMA correction) against
// IEEE division on `samples` random (value, scale) pairs whose quotient lies in [2^-20, 2^20).
Result<uint64_t> count_division_mismatches(uint64_t samples);

}  // namespace kvq::attention::cuda
