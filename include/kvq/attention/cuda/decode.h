#pragma once
// CUDA decode attention over the paged, quantized KV cache (DESIGN §5), CUTLASS-style:
//
//   DecodePlan plan;   KVQ_RETURN_IF_ERROR(cuda::can_implement(args));
//   auto p = cuda::plan(args, device_info);          // host only: split count from SMs/occupancy
//   device buffer of cuda::workspace_size(args, *p) bytes
//   cuda::run(args, *p, workspace, stream);          // launches only: capturable in a CUDA graph
//
// All pointers in `args` (planes, tables, q, out, lse) are device pointers. run() reads the
// lengths from the device tables; plan() sizes the split from the host-known table widths
// (max_blocks, max_sink_blocks), so a plan stays valid for every batch with the same widths.
//
// One CTA handles (sequence, kv head, group of <= 8 query heads, KV split): every K/V byte of a
// kv head is read once for its whole GQA group (groups larger than 8 query heads take several
// CTAs). 8- and 4-bit caches (fp8, FNUZ, int8, int4): whole page tiles (K, V, scales: each
// contiguous in the pool) are copied with cp.async.bulk into a ring of `ring_stages` stages (each one
// online-softmax step's pages) in shared memory, and four warps attend them from there; the plan picks who refills the ring (`ring_feed`):
// the attending warps themselves when the grid has many CTAs, a fifth (producer) warp when it has
// few, each a long chain of pages. 16-bit caches take the same ring at head_dim 64 and 128 and load
// per lane into registers at 256 (the register kernel, which the bf16 sink tokens always use).
// Dequantisation is fused: codes are converted in registers and multiplied on tensor cores
// (mma.sync; fp8/int8/int4 through exact fp16 values, bf16 natively) with the query and the
// probabilities split into a high and a low half, so the products keep ~22 bits. Per-token and
// per-page K scales multiply the logits, V scales ride on the probabilities in the log domain,
// per-tensor scales fold into the same places. Sink (bf16) tokens and quantized tokens are
// attended in the same pass; splits are merged by log-sum-exp in a second kernel.
//
// Supported: head_dim 64/128/256, block_size 16/32, formats bf16, fp16, fp8_e4m3, fp8_e4m3_fnuz,
// int8 and int4 (symmetric; not int4_outlier, no bf16 recent window) with any scale granularity and
// fp32 or fp16 scale planes; num_q_heads a multiple of num_kv_heads.
// Needs sm_80 or newer for the mma instructions and sm_89+ for the fp8 conversion (the build
// targets sm_90a). FNUZ is read with the OCP conversion: every byte kvq's FNUZ writer emits decodes
// to exactly half its OCP value (DESIGN §2), so the 0.5 is folded into the scales.
#include <cstddef>

#include "kvq/attention/args.h"
#include "kvq/common/cuda_device.h"
#include "kvq/common/status.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace kvq::attention::cuda {

using Stream = CUstream_st*;

struct DecodePlan {
  int num_splits = 1;       // KV splits per (sequence, kv head, head group)
  bool spread_sink = false;  // the bf16 sink's tiles dealt over all splits (one-wave plans), else the first ones
  int head_groups = 1;      // ceil(group / 8)
  int ctas_per_sm = 0;      // occupancy the plan assumed
  int max_tokens = 0;       // per sequence, from the table widths the plan was made for
  int max_blocks = 0, max_sink_blocks = 0, num_seqs = 0, num_q_heads = 0;  // what run() checks
  int threads = 0;          // per CTA
  int ring_stages = 0;      // ring-kernel caches: stages in flight per CTA in the shared-memory ring; a stage is
                            // one softmax step's pages (two 16-token pages at 8-bit D64 and int4 D64/D128, else one)
  int smem_bytes = 0;       // dynamic shared memory per CTA (the ring and its barriers)
  bool producer_warp = false;  // ring kernels: a warp more refills the ring (else the attending warps)
  bool split_pairs = false;    // one split in two producer-fed CTAs per SM: the batch's rows fill 2 x sm_count
                               // (>= 95%), where two splits of four CTAs per SM would add a merge (§25 of GPU_NOTES)
  bool ring_16bit = true;      // bf16/fp16 caches at head_dim 64/128: the bulk-copy kernel (else the register kernel)
  bool packed_heads = false;   // 8- and 4-bit caches at head_dim <= 128 with <= 4 query heads per kv head: lanes of
                               // the idle heads score a second tile (docs/GPU_NOTES.md §18)
  bool sink_in_ring = false;   // 8- and 4-bit rings whose stage holds a sink tile: the bf16 sink's tiles go through
                               // the ring ahead of the pages (else through the register path first)
  bool overlap_merge = false;  // several splits: the merge kernel is launched as a programmatic dependent of the
                               // decode (sm_90), so its launch overlaps the decode's last CTAs
  bool overlap_previous = false;  // the decode is launched as a programmatic dependent of the kernel before it on
                                 // the stream (sm_90; in the engine, the cache write): its CTAs become resident
                                 // and set up while that kernel runs, and read nothing (lengths, tables, query,
                                 // pages) until it has finished. Safe after any kernel, or none. Chosen for
                                 // plans of three or more splits (docs/GPU_NOTES.md §34).
  bool l2_evict_first = false;  // 8- and 4-bit caches: every copy into the ring (codes, scales, sink tiles) carries an
                                // L2 evict_first policy, in instances of their own (the default ones stay as they
                                // are); chosen where the batch's pages outgrow L2 (docs/GPU_NOTES.md §33). The
                                // timeline's instances (cta_timeline) have plain copies.
  // Diagnostics (kvq bench decode --timeline): when set, every CTA of the decode kernel writes
  // {start ns, end ns, SM id, main pages, main pages start ns, main pages end ns} (global timer; the last
  // two by warp 0, 0 for a CTA without work), then the ring kernel's ramp in steps {work and barriers
  // known, warp 0's prime issued, query prepared, warp 0's first ring item arrived, every warp past its
  // pages} (0 where a kernel does not mark them), then the SM clock (clock64) at the CTA's start and end
  // (0 for a CTA without work), then the warps' merge in steps {their rows written, the heads' weights
  // known} (ns; 0 for a CTA without work), at index split + splits x (y + gridDim.y x seq); kTimelineWords words per
  // CTA, cta_timeline_entries(plan) entries. Null in normal use. When set, run() launches separate instances
  // of the kernels with these marks compiled in (the product's have none: a run-time test of this pointer
  // alone cost int4 up to 12% on an H200, docs/GPU_NOTES.md §28), so a timed run is a few percent off.
  unsigned long long* cta_timeline = nullptr;
};
constexpr int kTimelineWords = 15;

// Who refills the ring of the bulk-copy kernel. kAuto: a producer warp when fewer than
// sm_count / 2 CTAs make up one split of the batch (sequences x kv heads x head groups), where every
// CTA is a long chain of pages and the refill latency is on it; else the attending warps, which
// leaves room for one more CTA per SM at head_dim 128 (docs/GPU_NOTES.md §13). 8- and 4-bit caches at
// block 16 and head_dim <= 128 take the attending warps from sm_count / 16 CTAs per split (§18).
enum class RingFeed : int { kAuto, kSelf, kProducer };

struct DecodeOptions {
  int force_splits = 0;  // > 0: use exactly this many splits (tests, tuning); 0: choose
  int ring_stages = 0;   // ring-kernel caches, > 0: ring depth in stages (rounded to a multiple of 4, 4..16); 0: choose
  RingFeed ring_feed = RingFeed::kAuto;
  int spread_sink = -1;  // 1: deal the sink over all splits, 0: the first ones first (tests); -1: choose
  int ring_16bit = -1;   // bf16/fp16 at head_dim 64/128: 1 the bulk-copy ring, 0 the register kernel (tests,
                         // measurements); -1: choose (the ring unless a split of the batch is < sm_count / 8
                         // CTAs, docs/GPU_NOTES.md §16)
  int packed_heads = -1;  // 0: never pack heads (tests, measurements); -1: pack where an instance exists and the
                          // group is <= 4
  int overlap_merge = -1;  // 0: launch the split merge as a plain kernel, 1: overlap it (measurements); -1: choose
  int sink_in_ring = -1;   // 0: the sink through the register path (tests, measurements); -1: choose
  int overlap_previous = -1;  // 0: a plain launch after the kernel before it, 1: DecodePlan::overlap_previous
                             // (sm_90; measurements); -1: choose (sm_90 and newer, plans of three or more splits)
  int l2_evict_first = -1;  // 8- and 4-bit caches: 1 the ring's copies under L2 evict_first, 0 plain (tests,
                            // measurements); -1: choose (DecodePlan::l2_evict_first)
};

// Shape/format checks that need no device access (kUnsupported / kInvalidArgument with a reason).
// Per-sequence facts live on the device and are the caller's contract: 1 <= seq_len,
// 0 <= sink_len <= seq_len, table entries valid for the tokens they cover.
Status can_implement(const DecodeArgs& args);

Result<DecodePlan> plan(const DecodeArgs& args, const CudaDeviceInfo& device, const DecodeOptions& opts = {});

// CTAs of the decode kernel for this plan (the rows DecodePlan::cta_timeline must hold).
long long cta_timeline_entries(const DecodePlan& plan, int num_kv_heads);

// Bytes of device workspace run() needs for this plan (0 when there is a single split).
size_t workspace_size(const DecodeArgs& args, const DecodePlan& plan);

// Enqueues the decode (and, with several splits, the merge) on `stream`. `workspace` must hold
// workspace_size() bytes, 16-byte aligned. No host synchronisation, no allocation.
Status run(const DecodeArgs& args, const DecodePlan& plan, void* workspace, Stream stream);

}  // namespace kvq::attention::cuda
