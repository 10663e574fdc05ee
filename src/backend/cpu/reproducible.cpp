// The CPU backend's reproducible ops. Compiled with -ffp-contract=off (CMakeLists.txt): every rp::
// operation is exactly one IEEE operation here, as on the device. On x86-64 the hot loops carry
// target("avx2,fma") attributes (the backend refuses the mode on a CPU without them), so fmaf is one
// instruction there; the rest of the library keeps the baseline ISA. Where fmaf is not inlined it
// is the C library's, which is exact too: speed changes, bits do not.
#include "reproducible.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "kvq/attention/cpu.h"
#include "kvq/attention/reproducible.h"
#include "kvq/common/reproducible_math.h"
#include "kvq/format/bf16.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVQ_RP_AVX2 1
#define KVQ_RP_TARGET __attribute__((target("avx2,fma")))
// Also inlines what the loop calls (attend_reproducible, rp::exp, ...) so their fmaf are instructions.
#define KVQ_RP_TARGET_FLAT __attribute__((target("avx2,fma"), flatten))
#else
#define KVQ_RP_TARGET
#define KVQ_RP_TARGET_FLAT
#endif

namespace kvq::backend::cpu_reproducible {
namespace {

// fn(begin, end) over [0, n) in `threads` contiguous parts (the calling thread takes the first).
template <class Fn>
void parallel_for(size_t n, int threads, const Fn& fn) {
  const size_t t = std::clamp<size_t>(static_cast<size_t>(std::max(threads, 1)), 1, std::max<size_t>(n, 1));
  if (t <= 1) {
    fn(size_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  const size_t step = (n + t - 1) / t;
  for (size_t i = 1; i < t; ++i) {
    const size_t b = std::min(n, i * step), e = std::min(n, b + step);
    if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(size_t{0}, std::min(n, step));
  for (auto& th : pool) th.join();
}

constexpr int kPanel = 16;  // output columns per packed weight panel
constexpr int kRowBlock = 4;

// y[r][o0 + c] for c < cols and every row, from a panel wp[k][kPanel] of the weights' columns.
// Each output is acc = 0; acc = fma(x[k], w[k], acc) for k = 0.. in order, then beta's add.
KVQ_RP_TARGET void panel_rows(const float* x, int rows, int in, const float* wp, int o0, int cols, float* y, int out,
                              bool add) {
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int nr = std::min(kRowBlock, rows - r0);
    float acc[kRowBlock][kPanel];
#if defined(KVQ_RP_AVX2)
    __m256 a[kRowBlock][2];
    for (int rr = 0; rr < kRowBlock; ++rr) a[rr][0] = a[rr][1] = _mm256_setzero_ps();
    const float* xr[kRowBlock];
    for (int rr = 0; rr < kRowBlock; ++rr) xr[rr] = x + static_cast<size_t>(r0 + std::min(rr, nr - 1)) * in;
    for (int k = 0; k < in; ++k) {
      const __m256 w0 = _mm256_loadu_ps(wp + static_cast<size_t>(k) * kPanel);
      const __m256 w1 = _mm256_loadu_ps(wp + static_cast<size_t>(k) * kPanel + 8);
      for (int rr = 0; rr < kRowBlock; ++rr) {
        const __m256 xb = _mm256_set1_ps(xr[rr][k]);
        a[rr][0] = _mm256_fmadd_ps(xb, w0, a[rr][0]);
        a[rr][1] = _mm256_fmadd_ps(xb, w1, a[rr][1]);
      }
    }
    for (int rr = 0; rr < kRowBlock; ++rr) {
      _mm256_storeu_ps(acc[rr], a[rr][0]);
      _mm256_storeu_ps(acc[rr] + 8, a[rr][1]);
    }
#else
    for (int rr = 0; rr < nr; ++rr)
      for (int c = 0; c < kPanel; ++c) {
        const float* xk = x + static_cast<size_t>(r0 + rr) * in;
        float s = 0.f;
        for (int k = 0; k < in; ++k) s = rp::fma(xk[k], wp[static_cast<size_t>(k) * kPanel + c], s);
        acc[rr][c] = s;
      }
#endif
    for (int rr = 0; rr < nr; ++rr) {
      float* yr = y + static_cast<size_t>(r0 + rr) * out + o0;
      for (int c = 0; c < cols; ++c) yr[c] = add ? rp::add(yr[c], acc[rr][c]) : acc[rr][c];
    }
  }
}

// Items [b, e) of (row, query head), each attention::attend_reproducible.
template <Format F>
KVQ_RP_TARGET_FLAT void attend_items(const attention::TokenSource& src, const float* q, float* out, float* lse,
                                int num_q_heads, float scale, int prefill_pos0, size_t b, size_t e) {
  const int d = src.geom.head_dim, group = num_q_heads / src.geom.num_kv_heads;
  std::vector<float> scores;
  for (size_t item = b; item < e; ++item) {
    const int r = static_cast<int>(item / num_q_heads), hq = static_cast<int>(item % num_q_heads);
    const bool prefill = prefill_pos0 >= 0;
    const int seq = prefill ? 0 : r;
    const int len = prefill ? prefill_pos0 + r + 1 : src.tables.seq_lens[r];
    const int sink_len = std::min(std::max(src.tables.sink_lens[seq], 0), std::max(len, 0));
    scores.resize(static_cast<size_t>(std::max(len, 1)));
    const size_t at = (static_cast<size_t>(r) * num_q_heads + hq) * d;
    const float l =
        attention::attend_reproducible<F>(src, seq, len, sink_len, hq / group, q + at, scale, out + at, scores.data());
    if (lse != nullptr) lse[static_cast<size_t>(r) * num_q_heads + hq] = l;
  }
}

template <Format F>
Status attend(const attention::TokenSource& src, const float* q, float* out, float* lse, int rows, int num_q_heads,
              float scale, int prefill_pos0, int threads) {
  parallel_for(static_cast<size_t>(rows) * num_q_heads, threads, [&](size_t b, size_t e) {
    attend_items<F>(src, q, out, lse, num_q_heads, scale, prefill_pos0, b, e);
  });
  return Status::ok();
}

Status attend_any(const attention::TokenSource& src, const float* q, float* out, float* lse, int rows, int num_q_heads,
                  float scale, int prefill_pos0, int threads) {
  if (src.geom.head_dim > attention::kReproducibleMaxHeadDim)
    return unsupported("reproducible attention: head_dim " + std::to_string(src.geom.head_dim) + " > " +
                       std::to_string(attention::kReproducibleMaxHeadDim));
  if (src.geom.mixed_kv) return unsupported("reproducible attention: per-layer K/V dtype mixes run in fast numerics");
  return attention::with_reproducible_format(src.geom.format, [&](auto f) {
    return attend<decltype(f)::value>(src, q, out, lse, rows, num_q_heads, scale, prefill_pos0, threads);
  });
}

}  // namespace

Status supported() {
#if defined(KVQ_RP_AVX2)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("fma") || !__builtin_cpu_supports("avx2"))
    return unsupported("--numerics reproducible on the CPU needs FMA and AVX2 (x86-64-v3); this CPU lacks them");
#endif
  return Status::ok();
}

Status gemm(const GemmArgs& a, int threads) {
  const int out = a.w.rows, in = a.w.cols;
  const bool bf16 = a.w.dtype == DType::kBf16;
  // bf16 weights: x rounded to bf16 as the fast path does (backend.h's GemmArgs).
  std::vector<float> xr;
  const float* x = a.x;
  if (bf16) {
    xr.resize(static_cast<size_t>(a.rows) * in);
    for (size_t i = 0; i < xr.size(); ++i) xr[i] = format::bf16_to_float(format::float_to_bf16(a.x[i]));
    x = xr.data();
  }
  const size_t panels = (static_cast<size_t>(out) + kPanel - 1) / kPanel;
  parallel_for(panels, threads, [&](size_t b, size_t e) {
    std::vector<float> wp(static_cast<size_t>(in) * kPanel);
    for (size_t p = b; p < e; ++p) {
      const int o0 = static_cast<int>(p) * kPanel, cols = std::min(kPanel, out - o0);
      for (int c = 0; c < kPanel; ++c)
        for (int k = 0; k < in; ++k) {
          const size_t wi = static_cast<size_t>(o0 + c) * in + k;
          float w = 0.f;
          if (c < cols) w = bf16 ? format::bf16_to_float(static_cast<const uint16_t*>(a.w.data)[wi])
                                 : static_cast<const float*>(a.w.data)[wi];
          wp[static_cast<size_t>(k) * kPanel + c] = w;
        }
      panel_rows(x, a.rows, in, wp.data(), o0, cols, a.y, out, a.beta != 0.f);
    }
  });
  return Status::ok();
}

KVQ_RP_TARGET_FLAT void swiglu(const SwigluArgs& a) {
  for (size_t i = 0; i < a.n; ++i) a.gate[i] = rp::silu_mul(a.gate[i], a.up[i]);
}

Status decode(const DecodeArgs& a, int threads) {
  KVQ_RETURN_IF_ERROR(attention::cpu::can_implement(a));
  const attention::TokenSource src{a.geom, a.layer, a.tables};
  return attend_any(src, a.q, a.out, a.lse, a.tables.num_seqs, a.num_q_heads, a.softmax_scale, -1, threads);
}

Status prefill(const PrefillArgs& a, int threads) {
  KVQ_RETURN_IF_ERROR(attention::cpu::can_implement(a));
  const attention::TokenSource src{a.geom, a.layer, a.tables};
  return attend_any(src, a.q, a.out, a.lse, a.n_q, a.num_q_heads, a.softmax_scale, a.q_pos0, threads);
}

}  // namespace kvq::backend::cpu_reproducible
