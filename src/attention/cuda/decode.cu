// Host side of the CUDA decode: checks, split planning, launch.
#include <algorithm>
#include <cmath>
#include <string>

#include "decode_dispatch.cuh"
#include "kvq/attention/cuda/decode.h"
#include "kvq/format/traits.h"

namespace kvq::attention::cuda {
namespace {

using detail::ScaleMode;

std::string str(long long v) { return std::to_string(v); }

ScaleMode scale_mode(const cache::CacheGeometry& g) {
  if (!g.has_scales()) return ScaleMode::kNone;
  return g.granularity == ScaleGranularity::kPerTensor ? ScaleMode::kTensor : ScaleMode::kToken;
}

// ring_16bit: 16-bit caches through the bulk-copy kernel where it has an instance (DecodePlan::ring_16bit).
// timeline: the instances that write DecodePlan::cta_timeline; evict_first: those of DecodePlan::l2_evict_first
// (8- and 4-bit formats). The same plan fits all three (same launch bounds, ring and threads).
detail::DecodeKernelFn kernel_for(const cache::CacheGeometry& g, bool ring_16bit = true, bool timeline = false,
                                  bool evict_first = false) {
  if (timeline) return detail::decode_kernel_timeline(g.format, g.head_dim, scale_mode(g), ring_16bit);
  const ScaleMode sm = scale_mode(g);
  switch (g.format) {
    case Format::kBf16:
    case Format::kFp16: return detail::decode_kernel_16bit(g.format, g.head_dim, ring_16bit);
    case Format::kFp8E4m3:
    case Format::kFp8E4m3Fnuz:
      return evict_first ? detail::decode_kernel_evict_first_fp8(g.head_dim, sm) : detail::decode_kernel_fp8(g.head_dim, sm);
    case Format::kInt8:
      return evict_first ? detail::decode_kernel_evict_first_int8(g.head_dim, sm) : detail::decode_kernel_int8(g.head_dim, sm);
    case Format::kInt4:
      return evict_first ? detail::decode_kernel_evict_first_int4(g.head_dim, sm) : detail::decode_kernel_int4(g.head_dim, sm);
    default: return {};
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Raises a kernel's dynamic shared-memory limit to at least `bytes` (never lowers it: other plans share the
// instance).
Status allow_dynamic_smem(void (*fn)(detail::DecodeParams), int bytes) {
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, fn) != cudaSuccess) {
    cudaGetLastError();
    return internal_error("cuda decode: cannot read the kernel's shared-memory size");
  }
  if (fa.maxDynamicSharedSizeBytes >= bytes) return Status::ok();
  return detail::cuda_status(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                             "cuda decode: reserving the timeline kernel's ring");
}

int ceil_div(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

// Bytes of one ring stage of the bulk kernel: its pages (ring_pages_per_stage) of bulk_stage_bytes each.
int ring_stage_bytes(const cache::CacheGeometry& g) {
  return detail::ring_pages_per_stage(format_traits(g.format).bits, g.head_dim, g.block_size) * detail::bulk_stage_bytes(g);
}

// Allows a ring kernel the device's whole opt-in shared memory (the attribute is per function, and plans of
// other geometries share the instance with rings of other sizes); returns the dynamic bytes it may use.
// Occupancy queries for rings over 48 KB fail until this is set.
Result<int> reserve_ring_smem(void (*fn)(detail::DecodeParams), const CudaDeviceInfo& dev) {
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, fn) != cudaSuccess) {
    cudaGetLastError();
    return internal_error("cuda decode: cannot read the kernel's shared-memory size");
  }
  // A CudaDeviceInfo filled by hand may lack the opt-in limit: every CUDA GPU grants 48 KB.
  const size_t optin = dev.smem_per_block_optin > 0 ? dev.smem_per_block_optin : size_t{48} << 10;
  const int max_dyn = static_cast<int>(optin) - static_cast<int>(fa.sharedSizeBytes);
  KVQ_RETURN_IF_ERROR(detail::cuda_status(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, max_dyn),
                                          "cuda decode: reserving the ring"));
  return max_dyn;
}

}  // namespace

Status can_implement(const DecodeArgs& a) {
  const cache::CacheGeometry& g = a.geom;
  if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256)
    return unsupported("cuda decode: head_dim " + str(g.head_dim) + " is not supported; the CUDA kernels take 64, 128 or 256 (the CPU backend takes any multiple of 8)");
  if (g.block_size != 16 && g.block_size != 32)
    return unsupported("cuda decode: block_size " + str(g.block_size) + " is not supported; use 16 or 32");
  if (!format_traits(g.format).device_ready)
    return unsupported(std::string("cuda decode: ") + format_name(g.format) + " caches are not read by these kernels");
  if (g.outlier_capacity > 0 || g.recent_tokens > 0)
    return unsupported("cuda decode: caches with an outlier plane (int4_outlier) or a bf16 recent window are not read "
                       "by these kernels (the CUDA backend reads them through its generic kernels)");
  if (g.num_kv_heads < 1) return invalid_argument("cuda decode: geometry has no kv heads");
  if (a.num_q_heads < 1 || a.num_q_heads % g.num_kv_heads != 0)
    return invalid_argument("cuda decode: num_q_heads (" + str(a.num_q_heads) + ") must be a positive multiple of num_kv_heads (" + str(g.num_kv_heads) + ")");
  if (!(a.softmax_scale > 0.f) || !std::isfinite(a.softmax_scale))
    return invalid_argument("cuda decode: softmax_scale must be positive and finite (usually 1/sqrt(head_dim))");
  if (a.q == nullptr || a.out == nullptr) return invalid_argument("cuda decode: q and out must be device pointers, got null");
  const cache::BatchTablesView& t = a.tables;
  if (t.num_seqs < 0) return invalid_argument("cuda decode: num_seqs is negative");
  if (t.num_seqs > 65535) return unsupported("cuda decode: at most 65535 sequences per launch (got " + str(t.num_seqs) + "); split the batch");
  if (t.num_seqs == 0) return Status::ok();
  if (t.seq_lens == nullptr || t.sink_lens == nullptr) return invalid_argument("cuda decode: seq_lens and sink_lens must not be null");
  if (t.max_blocks < 0 || t.max_sink_blocks < 0) return invalid_argument("cuda decode: block table widths must not be negative");
  if (t.max_blocks > 0 && t.block_tables == nullptr) return invalid_argument("cuda decode: block_tables is null but max_blocks > 0");
  if (t.max_sink_blocks > 0 && t.sink_tables == nullptr) return invalid_argument("cuda decode: sink_tables is null but max_sink_blocks > 0");
  if (t.max_blocks > 0 && (a.layer.k_codes == nullptr || a.layer.v_codes == nullptr))
    return invalid_argument("cuda decode: the layer's K/V code planes are null");
  if (t.max_blocks > 0 && g.has_scales() && (a.layer.k_scales == nullptr || a.layer.v_scales == nullptr))
    return invalid_argument(std::string("cuda decode: format ") + format_name(g.format) + " needs scale planes, but they are null");
  if (t.max_sink_blocks > 0 && (a.layer.k_sink == nullptr || a.layer.v_sink == nullptr))
    return invalid_argument("cuda decode: the batch has sink tables but the layer's sink planes are null");
  for (const void* p : {static_cast<const void*>(a.layer.k_codes), static_cast<const void*>(a.layer.v_codes),
                        static_cast<const void*>(a.layer.k_scales), static_cast<const void*>(a.layer.v_scales),
                        static_cast<const void*>(a.layer.k_sink), static_cast<const void*>(a.layer.v_sink),
                        static_cast<const void*>(a.out)})
    if (p != nullptr && !aligned16(p)) return invalid_argument("cuda decode: cache planes (codes, scales, sink) and out must be 16-byte aligned");
  if (!kernel_for(g)) return unsupported(std::string("cuda decode: no kernel for ") + format_name(g.format));
  return Status::ok();
}

Result<DecodePlan> plan(const DecodeArgs& a, const CudaDeviceInfo& dev, const DecodeOptions& opts) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  DecodePlan p;
  const int group = a.num_q_heads / a.geom.num_kv_heads;
  p.head_groups = ceil_div(group, detail::kMaxGroupPerCta);
  p.max_blocks = a.tables.max_blocks;
  p.max_sink_blocks = a.tables.max_sink_blocks;
  p.num_seqs = a.tables.num_seqs;
  p.num_q_heads = a.num_q_heads;
  p.max_tokens = (a.tables.max_blocks + a.tables.max_sink_blocks) * a.geom.block_size;
  const long long base = static_cast<long long>(std::max(a.tables.num_seqs, 1)) * a.geom.num_kv_heads * p.head_groups;
  // 16-bit caches: the ring streams 90-96% of the read ceiling where the register kernel gave 80-85%,
  // except when one split of the batch is a handful of CTAs (B1 x 8 kv heads: 54.8 vs 52.0 us),
  // where each CTA is one long chain and the register kernel's loads start sooner (docs/GPU_NOTES.md §16).
  p.ring_16bit = opts.ring_16bit >= 0 ? opts.ring_16bit == 1 : base >= std::max(dev.sm_count, 1) / 8;
  // 8- and 4-bit caches: the ring's copies under L2 evict_first where the batch's pages (bounded by the table
  // widths) outgrow L2, so bytes read once per step leave L2 first. On an H100 (L2 50 MiB, two runs,
  // docs/GPU_NOTES.md §33) every fp8, int8 and int4 case of the bench above L2 took 0.90-1.00 of the plain copies'
  // time (0.90-0.98 up to 3x L2), every one below it 0.99-1.08; bf16's arms, one kernel, spread 0.98-1.02. 16-bit
  // caches have no such instances.
  {
    // K and V pages of every table entry (main and sink, both counted in the cache's format).
    const double kv_bytes = 2.0 * std::max(a.tables.num_seqs, 0) * (a.tables.max_blocks + a.tables.max_sink_blocks) *
                            static_cast<double>(a.geom.bytes_per_page());
    p.l2_evict_first = format_bits(a.geom.format) <= 8 && (opts.l2_evict_first >= 0 ? opts.l2_evict_first == 1
                                                                                    : kv_bytes > static_cast<double>(dev.l2_bytes));
  }
  const detail::DecodeKernelFn kern = kernel_for(a.geom, p.ring_16bit, false, p.l2_evict_first);
  p.packed_heads = kern.has_packed() && group <= 4 && opts.packed_heads != 0;
  if (kern.bulk) {
    // A producer warp when a split of the batch has few CTAs, each a long chain of pages (docs/GPU_NOTES.md
    // §13) -- except for 8- and 4-bit pages of 16 tokens at head dim <= 128 with at least sm_count / 16
    // CTAs per split: there the attending warps feeding themselves were 1-13% faster at every batch
    // measured (B1 Hkv8 L32768 .. B16 Hkv4 L8192, §18; their CTA is a warp smaller, so four fit an SM
    // instead of three), but 3-9% slower with 2 or 4 CTAs per split and 4-6% slower for 16-bit pages.
    const int sms = std::max(dev.sm_count, 1);
    const bool self_pages = format_bits(a.geom.format) <= 8 && a.geom.block_size <= 16 && a.geom.head_dim <= 128 && base >= sms / 16;
    // Since the query is loaded first and the sink goes through the ring (§21, §22), at head dim 128 the
    // producer's CTAs (three per SM) beat four self-fed ones again where one wave of them holds at least two
    // splits of the batch and fills >= 90% of its slots, for batches of at least sm_count / 8 CTAs per split:
    // fp8 / int8 / int4 0.979 / 0.991 / 0.968 of the time on B8 Hkv8 L8192, 0.975 / 0.979 / 0.962 on B8 Hkv16
    // L16384; on B1 L32768 (8 CTAs per split) forced producers measured 0.98-1.01, so it keeps the self-fed ring;
    // where a wave of them holds one split (B32 L4096, B16 L32768: 256 of 396 slots) or less than the batch (B64
    // L8192) the producer lost up to 34%. Not int4 since its kernels lost the timeline's marks (§28): its self-fed
    // CTAs, whose page loop lost a tenth of its instructions, now beat the producer's (H200, block 16: B8 Hkv16
    // L16384 89.9 vs 95.5 us, B8 Hkv8 L8192 34.7 vs 35.4; on an H100, whose slower memory leaves int4 less bound
    // by its instructions, they lose 0.5% and 1.9%), while fp8 and int8 still gain 0-2% with it.
    bool producer_fills = false;
    if (self_pages && a.geom.head_dim == 128 && base >= sms / 8 && a.geom.format != Format::kInt4) {
      void (*const fp)(detail::DecodeParams) = kern.kernel(true, p.packed_heads);
      auto max_dyn = reserve_ring_smem(fp, dev);
      if (!max_dyn.is_ok()) return max_dyn.status();
      // Its shared memory with an 8-stage ring (what the rule below gives it at three CTAs per SM).
      int occ = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fp, kern.threads(true),
                                                        detail::kRingOffset + 8 * ring_stage_bytes(a.geom)) != cudaSuccess) {
        cudaGetLastError();
        occ = 0;
      }
      const long long slots = static_cast<long long>(sms) * occ, splits = slots / base;
      producer_fills = splits >= 2 && base * splits * 10 >= slots * 9;
    }
    // One split in two producer-fed CTAs per SM where the batch's rows fill that (2 sm_count rows, >= 95% of
    // them), instead of two splits in four self-fed CTAs per SM: the same balance without the split merge and
    // a second ramp. Head dim 128; fp8 (2-5% faster at block 16 and 32), int8 at block 32 (2-5%; at block 16
    // its dequantization's extra instructions made it 2-4% slower with half the warps), bf16/fp16 at block 16
    // (1-2%; at 32 they already plan two CTAs of one split); not int4 (up to 12% slower at block 16; §25).
    const int bits = format_bits(a.geom.format);
    const bool fp8 = a.geom.format == Format::kFp8E4m3 || a.geom.format == Format::kFp8E4m3Fnuz;
    const bool pairs_format = (bits == 8 && (fp8 || a.geom.block_size == 32)) || (bits == 16 && a.geom.block_size == 16);
    p.split_pairs = opts.ring_feed == RingFeed::kAuto && opts.ring_stages <= 0 && opts.force_splits <= 0 &&
                    a.geom.head_dim == 128 && pairs_format && base <= 2LL * sms && base * 20 >= 2LL * sms * 19;
    // fp8 at head dim 256 (one CTA of eight attending warps per SM): the warps feeding themselves were 2.5-3.4%
    // faster on B16 Hq8 Hkv1 L8192 and B64 Hq8 Hkv1 L2048 and level elsewhere; int8, whose warps spend more
    // instructions per page, lost up to 9% (docs/GPU_NOTES.md §25).
    const bool fp8_d256_self = fp8 && a.geom.head_dim == 256;
    p.producer_warp = opts.ring_feed == RingFeed::kProducer ||
                      (opts.ring_feed == RingFeed::kAuto &&
                       (p.split_pairs || producer_fills || (!self_pages && !fp8_d256_self && base < sms / 2)));
  }
  // The merge's launch overlapped with the decode's last CTAs: 0.5-4.5% faster on the split shapes at head dim
  // 64 and 128, 1-7% slower at 256 (docs/GPU_NOTES.md §21).
  p.overlap_merge = dev.cc_major >= 9 && (opts.overlap_merge > 0 || (opts.overlap_merge < 0 && a.geom.head_dim <= 128));
  void (*const fn)(detail::DecodeParams) = kern.kernel(p.producer_warp, p.packed_heads);
  p.threads = kern.threads(p.producer_warp);
  if (kern.bulk) {
    auto reserved = reserve_ring_smem(fn, dev);
    if (!reserved.is_ok()) return reserved.status();
    const int max_dyn = reserved.value();
    const int stage = ring_stage_bytes(a.geom);
    auto ring_bytes = [&](int s) { return detail::kRingOffset + s * stage; };
    auto occupancy = [&](int s) {
      int n = 0;
      if (ring_bytes(s) > max_dyn ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, p.threads, ring_bytes(s)) != cudaSuccess) {
        cudaGetLastError();
        n = 0;
      }
      return n;
    };
    const int step = kern.warps;  // a whole number of stages per attending warp
    int stages = step;
    if (opts.ring_stages > 0) {
      stages = std::clamp(opts.ring_stages / step * step, step, detail::kMaxStages);
    } else {
      // About kRingPerSm bytes of ring per SM, shared by the CTAs that fit with the shallowest ring,
      // and never so deep that one fewer fits. Measured best depths (docs/GPU_NOTES.md §9, §13): with
      // the producer warp 16 pages of 2 KB (D64) and 8 of 4 KB (D128) at 3 CTAs/SM, 16 of 8 KB (D256) at
      // 1 CTA/SM; self-fed, 8 of 4 KB at 4 CTAs/SM (D128) beat 12 at 3 and 16 at 2. With three or
      // more CTAs per SM, at most 8 stages: int4's 2 KB pages were 4-7% faster at 8 than at the 16 this
      // rule gave them, fp8 at D64 the same at 8, 12 and 16 (§16). Since §17 a stage is one softmax
      // step's pages (two 2 KB pages at 8-bit D64 and int4 D64/D128), so the rule counts stages.
      constexpr int kRingPerSm = 136 << 10;
      // Head dim 256 with 8-bit pages (8 KB at block 16): one CTA per SM with the whole ring (16 stages) beat
      // two CTAs of 8 stages by 3-6% (fp8/int8, B16 Hq8 Hkv1 and B4 Hq32 Hkv8 at L8192; docs/GPU_NOTES.md §22),
      // as at block 32, where a stage is 16 KB and the rule below already gives one CTA of 8.
      const int ctas_per_sm = a.geom.head_dim == 256 && format_bits(a.geom.format) == 8 ? 1 : occupancy(step);
      const int cap = ctas_per_sm >= 3 ? 8 : detail::kMaxStages;
      stages = std::clamp(kRingPerSm / std::max(ctas_per_sm, 1) / stage / step * step, step, cap);
      while (stages > step && occupancy(stages) < ctas_per_sm) stages -= step;
      // At head dim 256, with two or fewer CTAs per SM, few warps hide a page's latency, and a ring of one
      // stage per attending warp leaves that warp nothing in flight while it computes: take two per warp
      // even where that halves the CTAs per SM (D256 block 32: 2 CTAs x 4 stages 44.5 us, 1 x 8 41.8;
      // docs/GPU_NOTES.md §17). Not at 128: bf16 pages of 32 tokens (16 KB) went from two CTAs of 4 stages
      // to one of 8 and lost 4-5% (B64 Hkv8 L8192 494.6 -> 516.4 us, B32 L4096 131.7 -> 138.5; §24).
      if (a.geom.head_dim == 256 && ctas_per_sm <= 2 && stages < 2 * step && occupancy(2 * step) >= 1)
        stages = 2 * step;  // occupancy 0: the ring does not fit
      // Two CTAs per SM (split_pairs): at least 48 KB of ring each, whole steps: 12 stages of fp8 pages of 16
      // tokens (2-3% faster than 8), 8 of 8-bit pages of 32 tokens or of bf16 pages of 16 (§25). Where two such
      // CTAs do not fit (never on an H200: two of 51-66 KB), the plan keeps the producer and its usual splits.
      if (p.split_pairs) {
        constexpr int kPairRingBytes = 48 << 10;
        const int pair = std::clamp(ceil_div(ceil_div(kPairRingBytes, stage), step) * step, step, detail::kMaxStages);
        if (occupancy(pair) >= 2) {
          stages = pair;
        } else {
          p.split_pairs = false;
        }
      }
    }
    while (stages > step && ring_bytes(stages) > max_dyn) stages -= step;
    if (ring_bytes(stages) > max_dyn)
      return unsupported("cuda decode: a page tile of " + str(stage) + " bytes does not fit the ring in shared memory");
    p.ring_stages = stages;
    p.smem_bytes = ring_bytes(stages);
    // The bf16 sink's tiles through the ring, ahead of the pages (docs/GPU_NOTES.md §21): 8- and 4-bit
    // caches where a tile (16 x head_dim bytes of K and of V) fits a stage.
    p.sink_in_ring = format_bits(a.geom.format) <= 8 && 32 * a.geom.head_dim <= stage && opts.sink_in_ring != 0;
  }
  int occ = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, p.threads, p.smem_bytes) != cudaSuccess ||
      occ < 1) {
    cudaGetLastError();
    occ = 2;
  }
  p.ctas_per_sm = occ;
  const long long wave = static_cast<long long>(std::max(dev.sm_count, 1)) * occ;
  // One wave: every split's CTA runs at once and the slowest sets the time, so the sink (bf16 tiles on
  // the register path) is dealt over all splits; more waves absorb a few long CTAs, and a sink in
  // every split would add its load latency to every CTA (split_work.h, docs/GPU_NOTES.md §14).
  // Once the splits are known: the sink's spread, and whether the decode is launched as a programmatic dependent
  // of the kernel before it (the engine's cache write, which lets its dependents launch at its start). Its
  // kernels wait for that kernel before their first read, so the choice needs no contract from the caller. On
  // an H100 the write + decode step took 0.965-1.004x with it where the plan has three or more splits (the short
  // one-wave plans), but 1.05-1.08x on some one- and two-split plans, whose CTAs fill the SMs (our reading, not
  // measured per CTA: placed while the write's CTAs were still resident, they land unevenly; GPU_NOTES §34).
  auto settle_split_choices = [&] {
    p.spread_sink = opts.spread_sink >= 0 ? opts.spread_sink == 1 : base * p.num_splits <= wave;
    p.overlap_previous =
        dev.cc_major >= 9 && (opts.overlap_previous > 0 || (opts.overlap_previous < 0 && p.num_splits >= 3));
  };
  if (opts.force_splits > 0 || p.split_pairs) {
    p.num_splits = p.split_pairs ? 1 : opts.force_splits;
    settle_split_choices();
    return p;
  }
  // Splits: as many as one wave of CTAs holds (sm_count x occupancy), at least 16 tiles each. The
  // kernel is memory-bound once a few CTAs share each SM, so a second wave buys no bandwidth and adds
  // a tail and a larger merge; fewer splits than a wave holds leave SMs without enough bytes in
  // flight. Measured optimum on every bench shape (docs/GPU_NOTES.md §16: split sweeps 1..32): e.g.
  // B64 Hq9 Hkv3 D64 L8192 fp8 2 splits 86 us, where the earlier cost model (waves x (tiles + overhead))
  // chose 8 (3 waves, 94 us).
  const int max_tiles = std::max(1, ceil_div(p.max_tokens, detail::kTileTokens));
  constexpr int kMinTilesPerSplit = 16, kMaxSplits = 256;
  const int s_max = std::clamp(max_tiles / kMinTilesPerSplit, 1, kMaxSplits);
  p.num_splits = static_cast<int>(std::clamp<long long>(wave / std::max<long long>(base, 1), 1, s_max));
  settle_split_choices();
  return p;
}

long long cta_timeline_entries(const DecodePlan& p, int num_kv_heads) {
  return static_cast<long long>(p.num_splits) * num_kv_heads * p.head_groups * p.num_seqs;
}

size_t workspace_size(const DecodeArgs& a, const DecodePlan& p) {
  if (p.num_splits <= 1) return 0;
  const size_t rows = static_cast<size_t>(std::max(a.tables.num_seqs, 0)) * a.num_q_heads * p.num_splits;
  const size_t out_bytes = rows * a.geom.head_dim * sizeof(float);
  return cache::align_up(out_bytes, 256) + cache::align_up(rows * sizeof(float), 256);
}

Status run(const DecodeArgs& a, const DecodePlan& p, void* workspace, Stream stream) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  if (a.tables.num_seqs == 0) return Status::ok();
  const bool timeline = p.cta_timeline != nullptr;
  const detail::DecodeKernelFn kern = kernel_for(a.geom, p.ring_16bit, timeline, p.l2_evict_first);
  if (a.tables.num_seqs != p.num_seqs || a.num_q_heads != p.num_q_heads || a.tables.max_blocks > p.max_blocks ||
      a.tables.max_sink_blocks > p.max_sink_blocks || p.num_splits < 1 ||
      (p.producer_warp && !kern.bulk) || p.threads != kern.threads(p.producer_warp) ||
      (p.sink_in_ring && (!kern.bulk || 32 * a.geom.head_dim > ring_stage_bytes(a.geom))) ||
      (p.packed_heads && (!kern.has_packed() || a.num_q_heads / a.geom.num_kv_heads > 4)) ||
      (kern.bulk && (p.ring_stages < kern.warps || p.ring_stages % kern.warps != 0 || p.ring_stages > detail::kMaxStages ||
                     p.smem_bytes != detail::kRingOffset + p.ring_stages * ring_stage_bytes(a.geom))))
    return invalid_argument("cuda decode: the plan was made for another batch shape or cache geometry (sequences, heads, table widths, format); call plan() again");
  if (p.num_splits > 1 && (workspace == nullptr || !aligned16(workspace)))
    return invalid_argument("cuda decode: this plan needs a 16-byte aligned workspace of workspace_size() bytes");
  const cache::CacheGeometry& g = a.geom;
  detail::DecodeParams k{};
  k.k_codes = a.layer.k_codes, k.v_codes = a.layer.v_codes;
  k.k_scales = a.layer.k_scales, k.v_scales = a.layer.v_scales;
  k.k_sink = reinterpret_cast<const uint8_t*>(a.layer.k_sink);
  k.v_sink = reinterpret_cast<const uint8_t*>(a.layer.v_sink);
  k.seq_lens = a.tables.seq_lens, k.sink_lens = a.tables.sink_lens;
  k.block_tables = a.tables.block_tables, k.sink_tables = a.tables.sink_tables;
  k.max_blocks = a.tables.max_blocks, k.max_sink_blocks = a.tables.max_sink_blocks;
  k.q = a.q, k.out = a.out, k.lse = a.lse;
  k.num_kv_heads = g.num_kv_heads, k.num_q_heads = a.num_q_heads;
  k.group = a.num_q_heads / g.num_kv_heads, k.head_groups = p.head_groups;
  k.block_size = g.block_size, k.num_splits = p.num_splits, k.spread_sink = p.spread_sink ? 1 : 0;
  k.geom = g;
  k.softmax_scale = a.softmax_scale;
  k.fnuz_factor = g.format == Format::kFp8E4m3Fnuz ? 0.5f : 1.f;
  k.ring_stages = p.ring_stages;
  k.stage_bytes = kern.bulk ? ring_stage_bytes(g) : 0;
  k.timeline = p.cta_timeline;
  k.sink_in_ring = p.sink_in_ring ? 1 : 0;
  if (p.num_splits > 1) {
    const size_t rows = static_cast<size_t>(a.tables.num_seqs) * a.num_q_heads * p.num_splits;
    k.part_out = static_cast<float*>(workspace);
    k.part_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + cache::align_up(rows * g.head_dim * sizeof(float), 256));
  }
  const dim3 grid(p.num_splits, g.num_kv_heads * p.head_groups, a.tables.num_seqs);
  if (grid.y > 65535) return unsupported("cuda decode: too many kv heads x head groups for one launch");
  void (*const fn)(detail::DecodeParams) = kern.kernel(p.producer_warp, p.packed_heads);
  if (timeline && kern.bulk) KVQ_RETURN_IF_ERROR(allow_dynamic_smem(fn, p.smem_bytes));  // plan() reserved the product's
  {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid, cfg.blockDim = dim3(p.threads), cfg.dynamicSmemBytes = static_cast<size_t>(p.smem_bytes);
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr, cfg.numAttrs = p.overlap_previous ? 1 : 0;
    KVQ_RETURN_IF_ERROR(detail::cuda_status(cudaLaunchKernelEx(&cfg, fn, k), "cuda decode kernel"));
  }
  if (p.num_splits > 1) {
    const int rows = a.tables.num_seqs * a.num_q_heads;
    // Programmatic dependent launch: the merge's CTAs may be scheduled once every decode CTA is past its
    // pages (pdl_launch_dependents) and wait in the kernel for the decode's results (pdl_wait_primary),
    // so its launch latency hides behind the decode's last CTAs. Captured into graphs as a programmatic edge.
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(rows), cfg.blockDim = dim3(detail::kMergeThreads), cfg.dynamicSmemBytes = 0, cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr, cfg.numAttrs = p.overlap_merge ? 1 : 0;
    KVQ_RETURN_IF_ERROR(detail::cuda_status(cudaLaunchKernelEx(&cfg, detail::decode_merge_kernel_for(g.head_dim),
                                                       static_cast<const float*>(k.part_out),
                                                       static_cast<const float*>(k.part_lse), p.num_splits, a.out, a.lse),
                                    "cuda decode merge kernel"));
  }
  return Status::ok();
}

}  // namespace kvq::attention::cuda
