#pragma once
// The sampled sweep of attention test cases, shared by the CPU and CUDA tests (no gtest here).
//
// The full product (4 formats x 3 granularities x 4 head dims x 4 GQA ratios x 2 block sizes x
// sinks) is too slow for CI, so each quantized format x granularity pair runs three of six shapes,
// rotated so that every format and every granularity still meets all six shapes (every head_dim,
// GQA ratio 1/2/4/8 and block size 16/32), with sinks rotating through 0, one page, 20 (ending
// mid-page) and two pages. The bf16 baseline runs all six shapes.
#include <algorithm>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kvq/attention/synthetic.h"
#include "kvq/format/format.h"
#include "kvq/quant/spec.h"

namespace kvq::attention::testing {

struct AttnCase {
  Format format = Format::kBf16;
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  bool outliers = false;  // int4_outlier
  int head_dim = 64, num_kv_heads = 1, group = 1, block_size = 16, sink = 0;
  ScaleDtype scale_dtype = ScaleDtype::kFp32;
  std::vector<int> lens;
  uint64_t seed = 0;

  int num_q_heads() const { return num_kv_heads * group; }
  // gtest-safe name (letters, digits, underscores).
  std::string name() const {
    std::string n = std::string(format_name(format)) + (outliers ? "_outlier" : "");
    if (is_quantized(format)) n += std::string("_") + granularity_name(granularity);
    if (is_quantized(format) && scale_dtype == ScaleDtype::kFp16) n += "_fp16scales";
    return n + "_D" + std::to_string(head_dim) + "_Hkv" + std::to_string(num_kv_heads) + "_G" +
           std::to_string(group) + "_B" + std::to_string(block_size) + "_S" + std::to_string(sink);
  }
  SyntheticCacheOptions cache_options() const {
    SyntheticCacheOptions o;
    o.spec.format = format;
    o.spec.granularity = granularity;
    o.spec.outliers = outliers;
    o.spec.block_size = block_size;
    o.spec.sink_tokens = sink;
    o.spec.scale_dtype = scale_dtype;
    o.kv.num_kv_heads = num_kv_heads;
    o.kv.head_dim = head_dim;
    o.seq_lens = lens;
    o.seed = seed;
    return o;
  }
};

// What gtest prints for GetParam() and what ctest lists: the case, not its raw bytes.
inline void PrintTo(const AttnCase& c, std::ostream* os) {
  *os << c.name() << " lens{";
  for (size_t i = 0; i < c.lens.size(); ++i) *os << (i ? "," : "") << c.lens[i];
  *os << "} seed " << c.seed;
}

// Ragged lengths that hit the edges: 1 token, exact page boundaries, the sink boundary (all sink,
// one quantized token, one quantized page) and two longer random lengths.
inline std::vector<int> edge_lengths(int block_size, int sink, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> longer(100, 300);
  std::vector<int> lens = {1, block_size, 2 * block_size + 1, sink, sink + 1, sink + block_size,
                           longer(rng), longer(rng)};
  std::vector<int> out;
  for (int l : lens)
    if (l >= 1 && std::find(out.begin(), out.end(), l) == out.end()) out.push_back(l);
  return out;
}

inline std::vector<AttnCase> sampled_sweep() {
  struct Shape {
    int head_dim, num_kv_heads, group, block_size;
  };
  // head_dim 8 with 4 kv heads and GQA 2 is stories260K's shape.
  const Shape shapes[] = {{128, 2, 4, 16}, {64, 4, 2, 32}, {256, 1, 8, 16},
                          {8, 4, 2, 16},   {128, 1, 1, 32}, {64, 2, 8, 16}};
  struct Pair {
    Format f;
    ScaleGranularity g;
    bool outliers = false;
  };
  std::vector<Pair> pairs = {{Format::kBf16, ScaleGranularity::kPerTokenHead}};
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4})
    for (ScaleGranularity g :
         {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead, ScaleGranularity::kPerTensor})
      pairs.push_back({f, g});
  pairs.push_back({Format::kInt4, ScaleGranularity::kPerTokenHead, true});
  std::vector<AttnCase> cases;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const int n_shapes = is_quantized(pairs[i].f) ? 3 : 6;  // the bf16 baseline runs every shape
    for (int j = 0; j < n_shapes; ++j) {
      const Shape& s = shapes[(3 * i + j) % 6];
      AttnCase c;
      c.format = pairs[i].f;
      c.granularity = pairs[i].g;
      c.outliers = pairs[i].outliers;
      c.head_dim = s.head_dim;
      c.num_kv_heads = s.num_kv_heads;
      c.group = s.group;
      c.block_size = s.block_size;
      const int sinks[] = {0, s.block_size, 20, 2 * s.block_size};  // 20: a sink ending mid-page
      c.sink = sinks[(i + j) % 4];
      c.seed = 1000 + 17 * i + j;
      c.lens = edge_lengths(c.block_size, c.sink, c.seed);
      cases.push_back(c);
    }
  }
  // fp16 scale planes: each quantized pair once more on a shape its fp32 runs skip (and the
  // shapes rotate, so every granularity still meets every head_dim).
  for (size_t i = 1; i < pairs.size(); ++i) {
    AttnCase c;
    const Shape& s = shapes[(3 * i + 3 + i % 3) % 6];
    c.format = pairs[i].f;
    c.granularity = pairs[i].g;
    c.scale_dtype = ScaleDtype::kFp16;
    c.head_dim = s.head_dim;
    c.num_kv_heads = s.num_kv_heads;
    c.group = s.group;
    c.block_size = s.block_size;
    const int sinks[] = {0, s.block_size, 20, 2 * s.block_size};
    c.sink = sinks[(i + 1) % 4];
    c.seed = 5000 + 17 * i;
    c.lens = edge_lengths(c.block_size, c.sink, c.seed);
    cases.push_back(c);
  }
  return cases;
}

}  // namespace kvq::attention::testing
