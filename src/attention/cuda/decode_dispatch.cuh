#pragma once
// Kernel instances live in several translation units so they compile in parallel.
#include <type_traits>

#include "decode_bulk_kernel.cuh"
#include "decode_kernel.cuh"

namespace kvq::attention::cuda::detail {

struct DecodeKernelFn {
  void (*fn)(DecodeParams) = nullptr;           // the register kernel, or the bulk kernel with Feed::kSelf
  void (*fn_producer)(DecodeParams) = nullptr;  // bulk kernels: the same with Feed::kProducer
  void (*fn_packed)(DecodeParams) = nullptr;    // 8- and 4-bit at head_dim <= 128: kPack instances (<= 4 heads
  void (*fn_producer_packed)(DecodeParams) = nullptr;  // per CTA, compute_tiles), else null
  bool bulk = false;  // decode_bulk_kernel: bulk_threads<Feed, W>() threads and a dynamic shared-memory ring
  int warps = 4;      // attending warps per CTA (decode_warps)
  explicit operator bool() const { return fn != nullptr; }
  bool has_packed() const { return fn_packed != nullptr; }
  // The kernel and its CTA size for a plan's feed and head packing (DecodePlan::producer_warp, packed_heads).
  void (*kernel(bool producer, bool packed = false) const)(DecodeParams) {
    if (packed) return producer ? fn_producer_packed : fn_packed;
    return producer ? fn_producer : fn;
  }
  int threads(bool producer) const { return (warps + (bulk && producer ? 1 : 0)) * 32; }
};
using MergeKernelFn = void (*)(const float*, const float*, int, float*, float*);

// 8- and 4-bit caches take the bulk-copy kernel; 16-bit caches take it at head_dim 64 and 128 and
// the register kernel at 256, where a 16-bit tile pair (K 32 + V 32 words per lane and tile) does not
// fit the bulk kernel's register budget (docs/GPU_NOTES.md §9, §11, §13, §16). The register cap
// (kMinCtas) lets that many CTAs share an SM with their rings: with Feed::kSelf (four warps) D64 and
// D128 at 4 (<= 128 registers), int4's D256 at 2; with Feed::kProducer (five warps) D64 at 4 (96
// registers), D128 at 3, int4's D256 at 2 (<= 204; it takes 166-178 with no spill, and two CTAs per SM
// were 9-21% faster than one at block 16, docs/GPU_NOTES.md §17). 8-bit pages at D256 have eight
// attending warps (decode_warps) and one CTA per SM, as their plan had with four (§22, §24).
// Packed-head instances (compute_tiles' kPack: two tiles per set of softmax instructions when a CTA
// has at most 4 query heads) for the 8- and 4-bit formats at head_dim 64 and 128, whose softmax step
// has an even number of tiles; 16-bit caches and head_dim 256 keep one instance per feed.
// kTL: the instances that write DecodePlan::cta_timeline (decode_kernel_timeline), apart from the product's.
// L2: L2Policy::kEvictFirst for the instances of DecodePlan::l2_evict_first (decode_kernel_evict_first_*).
template <Format F, int D, ScaleMode SM, bool kTL = false, L2Policy L2 = L2Policy::kNormal>
DecodeKernelFn bulk_instance() {
  constexpr int W = decode_warps(Path<F>::kBits, D);
  constexpr int kSelfCtas = D == 256 ? 8 / W : 4, kProducerCtas = D == 64 ? 4 : D == 128 ? 3 : 8 / W;
  DecodeKernelFn k;
  k.warps = W;
  k.fn = decode_bulk_kernel<F, D, SM, kSelfCtas, Feed::kSelf, false, kTL, L2>;
  k.fn_producer = decode_bulk_kernel<F, D, SM, kProducerCtas, Feed::kProducer, false, kTL, L2>;
  if constexpr (Path<F>::kBits <= 8 && D <= 128 && TileShape<F, D>::kRingStepTiles % 2 == 0) {
    k.fn_packed = decode_bulk_kernel<F, D, SM, kSelfCtas, Feed::kSelf, true, kTL, L2>;
    k.fn_producer_packed = decode_bulk_kernel<F, D, SM, kProducerCtas, Feed::kProducer, true, kTL, L2>;
  }
  k.bulk = true;
  return k;
}
template <Format F, int D, ScaleMode SM, bool kTL = false>
DecodeKernelFn register_instance() {
  DecodeKernelFn k;
  k.fn = decode_kernel<F, D, SM, 1, kTL>;
  k.warps = decode_warps(Path<F>::kBits, D);
  return k;
}
template <Format F, int D, ScaleMode SM, bool kTL = false, L2Policy L2 = L2Policy::kNormal>
DecodeKernelFn decode_instance() {
  if constexpr (Path<F>::kBits <= 8) {
    return bulk_instance<F, D, SM, kTL, L2>();
  } else {
    return register_instance<F, D, SM, kTL>();
  }
}

// The instances of a scaled format (per-tensor scale, or per-token / per-block scales); one
// translation unit per format instantiates them.
template <Format F, bool kTL = false, L2Policy L2 = L2Policy::kNormal>
DecodeKernelFn scaled_instances(int head_dim, ScaleMode sm) {
  auto pick = [sm](auto d) -> DecodeKernelFn {
    constexpr int D = decltype(d)::value;
    if (sm == ScaleMode::kTensor) return decode_instance<F, D, ScaleMode::kTensor, kTL, L2>();
    if (sm == ScaleMode::kToken) return decode_instance<F, D, ScaleMode::kToken, kTL, L2>();
    return {};
  };
  switch (head_dim) {
    case 64: return pick(std::integral_constant<int, 64>{});
    case 128: return pick(std::integral_constant<int, 128>{});
    case 256: return pick(std::integral_constant<int, 256>{});
    default: return {};
  }
}

// 16-bit caches: the bulk-copy ring at head_dim 64 and 128 when `ring`, else the register kernel.
template <Format F, bool kTL = false>
DecodeKernelFn instances_16bit(int head_dim, bool ring) {
  switch (head_dim) {
    case 64: return ring ? bulk_instance<F, 64, ScaleMode::kNone, kTL>() : register_instance<F, 64, ScaleMode::kNone, kTL>();
    case 128: return ring ? bulk_instance<F, 128, ScaleMode::kNone, kTL>() : register_instance<F, 128, ScaleMode::kNone, kTL>();
    case 256: return register_instance<F, 256, ScaleMode::kNone, kTL>();
    default: return {};
  }
}

// An empty DecodeKernelFn for a head_dim without an instance.
DecodeKernelFn decode_kernel_fp8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_int8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_int4(int head_dim, ScaleMode sm);
// ring: the bulk-copy kernel where a 16-bit instance exists (head_dim 64, 128), else the register kernel.
DecodeKernelFn decode_kernel_16bit(Format f, int head_dim, bool ring);
// The instances of DecodePlan::l2_evict_first: the 8- and 4-bit formats' kernels with every ring copy under the
// L2 evict_first policy; one translation unit each, like the product's.
DecodeKernelFn decode_kernel_evict_first_fp8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_evict_first_int8(int head_dim, ScaleMode sm);
DecodeKernelFn decode_kernel_evict_first_int4(int head_dim, ScaleMode sm);
// The instances that write DecodePlan::cta_timeline (kvq bench decode --timeline), for any of the formats above.
DecodeKernelFn decode_kernel_timeline(Format f, int head_dim, ScaleMode sm, bool ring);
MergeKernelFn decode_merge_kernel_for(int head_dim);

}  // namespace kvq::attention::cuda::detail
