#pragma once
// Attention of one query over the paged cache as stored, in reproducible numerics
// (common/reproducible_math.h): the one definition that the CPU backend runs per (query, head) and
// the CUDA backend runs per thread, so both give the same bits.
//
// The order is fixed and independent of tiling, batching and split counts:
//   s_j  = dot(q, k_j) * scale           dot in dimension order, one FMA a term
//   m    = max_j s_j
//   l    = sum_j e^(s_j - m)             in key order (rp::exp)
//   o_i  = sum_j e^(s_j - m) * v_j[i]    in key order, one FMA a term
//   out_i = o_i / l
// Two passes over the keys (the scores are recomputed identically in the second unless the caller
// keeps them): no running rescale, so no order-dependent rounding of the max.
#include <cmath>
#include <string>
#include <type_traits>

#include "kvq/attention/token_reader.h"
#include "kvq/common/macros.h"
#include "kvq/common/reproducible_math.h"
#include "kvq/common/status.h"

namespace kvq::attention {

// Largest head size the reproducible path takes (the device keeps one accumulator row per thread).
inline constexpr int kReproducibleMaxHeadDim = 256;

// The row of `seq` with `len` keys (query at position len - 1; sink_len already clamped to len),
// query head vector q of kv head kvh. acc receives the d outputs; scores, when not null, has room
// for len floats (the host keeps them instead of recomputing). Returns the log-sum-exp of the
// scaled scores (-inf for len == 0), computed with the platform's log (not part of the bitwise
// contract: the engine does not use it).
template <Format F, class P>
KVQ_HD float attend_reproducible(const P& p, int seq, int len, int sink_len, int kvh, const float* q, float scale,
                                 float* acc, float* scores) {
  const int d = p.geom.head_dim;
  const int q_pos = len - 1;
  auto score = [&](int j) {
    const TokRef t = token_ref<F>(p, seq, j, sink_len, kvh, q_pos);
    float dot = 0.f;
    for (int i = 0; i < d; ++i) dot = rp::fma(q[i], token_value<F>(p, false, t, i), dot);
    return rp::mul(dot, scale);
  };
  float m = -__builtin_huge_valf();
  for (int j = 0; j < len; ++j) {
    const float s = score(j);
    if (scores != nullptr) scores[j] = s;
    m = rp::max(m, s);
  }
  for (int i = 0; i < d; ++i) acc[i] = 0.f;
  float l = 0.f;
  for (int j = 0; j < len; ++j) {
    const float s = scores != nullptr ? scores[j] : score(j);
    const float w = rp::exp(rp::sub(s, m));
    l = rp::add(l, w);
    const TokRef t = token_ref<F>(p, seq, j, sink_len, kvh, q_pos);
    for (int i = 0; i < d; ++i) acc[i] = rp::fma(w, token_value<F>(p, true, t, i), acc[i]);
  }
  if (l > 0.f)
    for (int i = 0; i < d; ++i) acc[i] = rp::div(acc[i], l);
  return l > 0.f ? m + logf(l) : -__builtin_huge_valf();
}

// Host side of both backends: calls fn(std::integral_constant<Format, F>{}) for the cache format the
// reproducible attention is instantiated for, or returns kUnsupported.
template <class Fn>
Status with_reproducible_format(Format f, Fn&& fn) {
  switch (f) {
    case Format::kBf16: return fn(std::integral_constant<Format, Format::kBf16>{});
    case Format::kFp16: return fn(std::integral_constant<Format, Format::kFp16>{});
    case Format::kFp8E4m3: return fn(std::integral_constant<Format, Format::kFp8E4m3>{});
    case Format::kFp8E4m3Fnuz: return fn(std::integral_constant<Format, Format::kFp8E4m3Fnuz>{});
    case Format::kInt8: return fn(std::integral_constant<Format, Format::kInt8>{});
    case Format::kInt4: return fn(std::integral_constant<Format, Format::kInt4>{});
    case Format::kInt4Kivi: return fn(std::integral_constant<Format, Format::kInt4Kivi>{});
    default: return unsupported(std::string("reproducible attention: ") + format_name(f) + " caches are not supported");
  }
}

}  // namespace kvq::attention
