#pragma once
// GPU benchmark core behind `kvq bench decode|write --backend cuda` (the CLI formats; this times).
//
// Method: every case is captured in a CUDA graph and replayed (warm-up, then >= 30 timed replays,
// median reported); before each timed replay a buffer of 2x the L2 size is read (or written:
// L2Flush) untimed, so every replay starts with a cold L2, as a decode step over a large cache does.
// Caches are filled with random valid codes directly on the device. Effective bandwidth counts the
// bytes the operation must move at least (decode: K/V codes + scales + sink read; write: rows read +
// codes and scales written) and is compared with a device-to-device copy and (decode) a read-only
// stream of 1 GiB measured in the same run, and per decode case with a read-only stream of the
// case's own bytes timed like the case.
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/attention/cuda/decode.h"
#include "kvq/attention/cuda/write.h"
#include "kvq/common/cuda_device.h"
#include "kvq/common/status.h"
#include "kvq/format/format.h"
#include "kvq/quant/spec.h"

namespace kvq::attention::cuda {

struct DecodeShape {
  int batch = 1, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, seq_len = 4096;
  std::string label() const;  // "B8 Hq32 Hkv8 D128 L8192"
};

// The shapes (Llama-3-8B-like, GQA 2-8, head_dim 64/128/256).
std::vector<DecodeShape> default_decode_shapes();

// How the cold-L2 replays evict the previous replay's data (docs/GPU_NOTES.md §17). kRead streams a
// buffer of twice the L2 through it, which leaves the L2 holding clean lines, as a serving step finds
// it after the GEMMs that read weights; kWrite (cudaMemset of that buffer) leaves ~one L2 of dirty
// lines whose write-back to DRAM then lands inside the timed kernel.
enum class L2Flush { kRead, kWrite };

struct BenchTiming {
  int warmup = 5;
  // ... and untimed replays until this much time has passed: right after the previous case freed its
  // buffers (GBs at the large shapes), a case's first replays of ~10 ms ran 13% slow (docs/GPU_NOTES.md §23).
  double warmup_ms = 30;
  int iters = 50;         // timed graph replays (>= 30)
  bool cold_l2 = true;
  L2Flush flush = L2Flush::kRead;
  // false: each timed replay is a graph of the case alone, launched after the flush between the events. true:
  // the flush, the events and the case in one graph, the case starting as the node after the flush, as a kernel
  // of an engine's captured decode step does. Ceilings, same-bytes reads and cases alike. On H100 and H200 the
  // two differ by 0-1.3 us per case, so the graph launch is not what a replay holds outside the CTAs
  // (docs/GPU_NOTES.md §27).
  bool in_graph = false;
};

struct CopyBandwidth {
  double bytes = 0;       // moved per pass: read + written (copy), read (read-only stream)
  double us_median = 0;
  double tb_per_s = 0;
};

struct DecodeBenchOptions {
  std::vector<DecodeShape> shapes = default_decode_shapes();
  std::vector<Format> formats = {Format::kBf16, Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4};
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  int block_size = 16;
  // Several block sizes in one run (each shape and format at each; bf16 ratios within the same
  // block size); empty: block_size only.
  std::vector<int> block_sizes;
  int sink_tokens = 256;  // quantized formats only; the bf16 baseline has no sink
  int force_splits = 0;
  int ring_stages = 0;    // 8- and 4-bit caches: DecodeOptions::ring_stages (0: the planner's choice)
  RingFeed ring_feed = RingFeed::kAuto;  // 8- and 4-bit caches: DecodeOptions::ring_feed
  int ring_16bit = -1;    // bf16/fp16: DecodeOptions::ring_16bit (-1: the planner's choice)
  int packed_heads = -1;  // 8- and 4-bit caches: DecodeOptions::packed_heads (-1: the planner's choice)
  int spread_sink = -1;   // DecodeOptions::spread_sink (-1: the planner's choice)
  int overlap_merge = -1;  // DecodeOptions::overlap_merge (-1: the planner's choice)
  int sink_in_ring = -1;   // DecodeOptions::sink_in_ring (-1: the planner's choice)
  int l2_evict_first = -1;  // DecodeOptions::l2_evict_first (-1: the planner's choice)
  int overlap_previous = -1;  // DecodeOptions::overlap_previous (-1: the planner's choice)
  // Also time each case as the engine's attention step: the cache write of one new token per sequence (fp32
  // rows, into the sequence's last slot) and then the decode, in one graph (DecodeBenchRow::step_us), and the
  // write alone (write_us).
  bool with_write = false;
  bool timeline = false;  // one more cold run per case with DecodePlan::cta_timeline (DecodeBenchRow::timeline)
  int timeline_runs = 1;  // with timeline: that many cold runs, each summarised (Timeline::runs), the first in full
  uint64_t seed = 1;
  BenchTiming timing;
};

struct DecodeBenchRow {
  DecodeShape shape;
  Format format = Format::kBf16;
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  int block_size = 16;
  int sink_tokens = 0, splits = 1, ctas_per_sm = 0;
  int threads_per_cta = 0;  // attending warps (and a producer warp) x 32: DecodePlan::threads
  double us_median = 0, us_min = 0, us_max = 0;
  std::vector<double> us_replays;  // every timed replay in order (a case whose median moves between runs)
  double kv_bytes = 0;        // codes + scales + sink read
  double tb_per_s = 0;        // kv_bytes / median
  double frac_of_copy = 0;    // tb_per_s / copy bandwidth
  double frac_of_read = 0;    // tb_per_s / read-only streaming bandwidth (decode only reads K/V)
  // The read-only stream of kv_bytes alone, timed like the case (same flush, one launch): what its size
  // and cold start cost any kernel, and the decode's time as a fraction of it (same_read_us / us_median).
  double same_read_us = 0;
  double frac_of_same_read = 0;
  int ring_stages = 0;        // bulk-copy kernel: pages in flight per CTA (0: the register kernel)
  bool producer_warp = false;  // 8- and 4-bit caches: the plan's ring feed
  bool packed_heads = false;   // 8- and 4-bit caches: the plan packs heads (DecodePlan::packed_heads)
  bool l2_evict_first = false;  // 8- and 4-bit caches: the ring's copies under L2 evict_first (DecodePlan::l2_evict_first)
  bool overlap_previous = false;  // the decode launched as a programmatic dependent (DecodePlan::overlap_previous)
  double write_us = 0, step_us = 0;  // DecodeBenchOptions::with_write: the write alone, the write and the decode (0: not run)
  double speedup_vs_bf16 = 0; // bf16 median / this median at the same block size (0 when bf16 was not run)
  // DecodeBenchOptions::timeline: the decode kernel's CTAs in one cold run (global timer, us after the
  // first CTA's start); the rest of us_median is launch latency and the split merge.
  struct Timeline {
    int ctas = 0;  // 0: not measured
    double span_us = 0;        // last CTA end
    double last_start_us = 0;  // when the last CTA started (> 0: more CTAs than one wave holds, or a slow launch)
    double first_end_us = 0, median_end_us = 0;
    double mean_cta_us = 0;    // mean CTA duration
    // Means over the CTAs with pages: from the CTA's start to warp 0's first main page (query, sink, ring
    // prime), warp 0's main pages, and from its last page to the CTA's end (the other warps, the merge of
    // the warps, the store).
    double mean_ramp_us = 0, mean_pages_us = 0, mean_tail_us = 0;
    // The ring kernel's ramp in steps, means from the CTA's start (0: not marked): work and barriers
    // known, query prepared, warp 0's first ring item arrived; and from warp 0's last page until every
    // warp is past its pages. primed: warp 0's first ring requests issued (self-fed rings only; 0 else).
    double mean_work_us = 0, mean_query_us = 0, mean_item0_us = 0, mean_warps_us = 0, mean_primed_us = 0;
    // The tail after `warps`, in the warps' merge (0: not marked): writing their rows to shared memory, the
    // heads' maxima, sums and weights, and the rows' merge and store to the CTA's end.
    double mean_merge_rows_us = 0, mean_merge_heads_us = 0, mean_merge_store_us = 0;
    std::vector<double> start_us, end_us;  // per CTA (timeline index order)
    std::vector<int> sm;                   // the SM it ran on
    // The SM clock over the CTAs with work (their clock64 cycles per global-timer ns), mean and lowest.
    double mean_sm_mhz = 0, min_sm_mhz = 0;
    int max_ctas_per_sm = 0;  // CTAs on the most loaded SM
    // Every cold run (the first is the one above): its time between CUDA events around a plain launch (no
    // graph: a few us of launch more than the median's replays), span, mean CTA, mean time in the main
    // pages, the SMs' clock, and the CTAs per SM of the most loaded SM. Replays that differ in time are
    // then told apart: slower at a lower clock, or CTAs that waited.
    struct Run {
      double event_us = 0, span_us = 0, mean_cta_us = 0, mean_pages_us = 0, mean_sm_mhz = 0, min_sm_mhz = 0;
      int max_ctas_per_sm = 0;
    };
    std::vector<Run> runs;
  } timeline;
};

struct WriteBenchOptions {
  int num_tokens = 16384, num_kv_heads = 8, head_dim = 128, block_size = 16;
  std::vector<Format> formats = {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kBf16};
  std::vector<ScaleGranularity> granularities = {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead};
  // Row types timed: bf16 (what engines hand a cache) and/or fp32 (what kvq's CUDA backend passes).
  std::vector<InputType> inputs = {InputType::kBf16};
  uint64_t seed = 1;
  BenchTiming timing;
};

struct WriteBenchRow {
  InputType input = InputType::kBf16;
  Format format = Format::kBf16;
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  int num_tokens = 0, num_kv_heads = 0, head_dim = 0;
  double us_median = 0, us_min = 0, us_max = 0;
  double bytes = 0;           // rows read (bf16 or fp32) + codes + scales written
  double tb_per_s = 0, frac_of_copy = 0;
};

// Device-to-device copy of `bytes` (default 1 GiB), median of `iters`.
// in_graph: BenchTiming::in_graph.
Result<CopyBandwidth> measure_copy_bandwidth(size_t bytes = size_t{1} << 30, int iters = 20, bool in_graph = false);
// Read-only streaming of `bytes` (default 1 GiB): 16-byte loads reduced to one word per thread, the
// best of a few loads-in-flight variants, median of `iters`. Decode only reads, so this is its ceiling.
Result<CopyBandwidth> measure_read_bandwidth(size_t bytes = size_t{1} << 30, int iters = 20, bool in_graph = false);
// Read-only gather of `chunk_bytes` (1, 2 or 4 KB) chunks, shuffled or in order: the ceiling of a
// paged cache whose contiguous runs are page-head tiles of that size (docs/GPU_NOTES.md §9).
Result<CopyBandwidth> measure_gather_bandwidth(int chunk_bytes, bool shuffled, size_t bytes = size_t{1} << 30,
                                               int iters = 20, bool in_graph = false);

Result<std::vector<DecodeBenchRow>> bench_decode(const DecodeBenchOptions& opts, const CopyBandwidth& copy,
                                                 const CopyBandwidth& read);
Result<std::vector<WriteBenchRow>> bench_write(const WriteBenchOptions& opts, const CopyBandwidth& copy);

}  // namespace kvq::attention::cuda
