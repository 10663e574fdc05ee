#pragma once
// Reference (scalar, host) quantize/dequantize. The fast paths must match these bit for bit
// on the codes they emit.
#include <cstdint>

#include "kvq/format/format.h"

namespace kvq::quant {

struct QuantStats {
  uint64_t values = 0;     // values quantized
  uint64_t nonfinite = 0;  // NaN/inf inputs: written as 0 and left out of amax (documented policy)
  uint64_t saturated = 0;  // finite values clipped to qmax (only per_tensor can clip)
  uint64_t requantized_page_heads = 0;  // per_block_head growth events
  void merge(const QuantStats& o) {
    values += o.values; nonfinite += o.nonfinite; saturated += o.saturated;
    requantized_page_heads += o.requantized_page_heads;
  }
};

// amax over finite values; non-finite values are counted into stats (if given).
float finite_amax(const float* x, int n, QuantStats* stats = nullptr);

// Scale so that amax maps to the format's qmax; an all-zero input gets scale 1 (any positive
// scale decodes zeros exactly, and 1 keeps the plane free of denormals).
float scale_for_amax(Format f, float amax);

// codes[i] = encode(x[i] / scale); bf16/fp16 ignore the scale and write 2-byte values.
// Non-finite inputs are written as 0 and counted.
void quantize_row(Format f, const float* x, int n, float scale, uint8_t* codes, QuantStats* stats);
void dequantize_row(Format f, const uint8_t* codes, int n, float scale, float* out);

}  // namespace kvq::quant
