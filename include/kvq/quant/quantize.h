#pragma once
// Reference (scalar, host) quantize/dequantize. The fast paths must match these bit for bit
// on the codes they emit: the scaled value is the correctly rounded quotient x / scale (IEEE
// division, e.g. __fdiv_rn on the device, never x * (1 / scale)), encoded by format.h's writers;
// dequantization is decode(code) * scale.
//
// Storage per format: fp8 and int8 one byte per element; int4 two per byte (element 2i in the low
// nibble; an odd count leaves the last high nibble 0); bf16/fp16 two bytes per element, the
// 16-bit pattern little-endian (the scale is ignored).
//
// Non-finite policy: NaN and +-inf are written as 0, excluded from amax and counted in
// QuantStats::nonfinite. A finite input never produces NaN/inf codes: values beyond the format's
// range saturate to +-qmax (+-65504 for fp16, +-max bf16) and are counted in `saturated`.
#include <cstddef>
#include <cstdint>

#include "kvq/format/format.h"
#include "kvq/quant/policy.h"

namespace kvq::quant {

struct QuantStats {
  uint64_t values = 0;     // values quantized
  uint64_t nonfinite = 0;  // NaN/inf inputs: written as 0 and left out of amax (documented policy)
  uint64_t saturated = 0;  // finite values clipped to qmax (only per_tensor can clip)
  uint64_t requantized_page_heads = 0;  // per_block_head growth events
  uint64_t outliers = 0;          // int4_outlier: values kept as sparse fp16 entries
  uint64_t outlier_overflow = 0;  // int4_outlier: candidates beyond a row's share, left as int4 values
  uint64_t scale_clamped = 0;     // fp16 scales clamped to [2^-24, 65504] (policy.h), K and V apart
  void merge(const QuantStats& o) {
    values += o.values; nonfinite += o.nonfinite; saturated += o.saturated;
    requantized_page_heads += o.requantized_page_heads; scale_clamped += o.scale_clamped;
    outliers += o.outliers; outlier_overflow += o.outlier_overflow;
  }
};

// amax over finite values; non-finite values are counted into stats (if given). Pass stats to
// either this or quantize_row for the same values, not both, or they are counted twice.
float finite_amax(const float* x, int n, QuantStats* stats = nullptr);

// scale_for_amax, clips and the rest of the scale policy: quant/policy.h (host and device).

// Bytes that quantize_row writes for n elements.
size_t row_bytes(Format f, int n);

// codes[i] = encode(x[i] / scale); bf16/fp16 ignore the scale and write 2-byte values.
// Non-finite inputs are written as 0 and counted.
void quantize_row(Format f, const float* x, int n, float scale, uint8_t* codes, QuantStats* stats);
void dequantize_row(Format f, const uint8_t* codes, int n, float scale, float* out);

}  // namespace kvq::quant
