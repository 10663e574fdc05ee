// GPU benchmark core (see include/kvq/attention/cuda/bench.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "device_util.cuh"
#include "kvq/attention/cuda/bench.h"
#include "kvq/attention/cuda/decode.h"
#include "kvq/attention/cuda/device_cache.h"
#include "kvq/attention/cuda/write.h"
#include "kvq/common/hardware.h"
#include "kvq/format/bf16.h"

namespace kvq::attention::cuda {
namespace {

using detail::cuda_status;

#define KVQ_CUDA_TRY(expr, what) KVQ_RETURN_IF_ERROR(cuda_status((expr), what))

struct Stats {
  double median = 0, min = 0, max = 0;
  std::vector<double> us_each;  // every timed replay, in order
};

Stats summarize(std::vector<float> ms) {
  Stats s;
  for (float m : ms) s.us_each.push_back(1e3 * m);
  std::sort(ms.begin(), ms.end());
  s.median = 1e3 * (ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]));
  s.min = 1e3 * ms.front();
  s.max = 1e3 * ms.back();
  return s;
}

// RAII for the CUDA objects a timing loop needs.
struct Timer {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Timer() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
  }
  Status init() {
    KVQ_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    KVQ_CUDA_TRY(cudaEventCreate(&start), "event");
    KVQ_CUDA_TRY(cudaEventCreate(&stop), "event");
    return Status::ok();
  }
};

struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

// Captures `enqueue` (which must only launch work on the stream) into a graph.
template <class F>
Status capture(Timer& t, Graph& g, F&& enqueue) {
  KVQ_CUDA_TRY(cudaStreamBeginCapture(t.stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  const Status s = enqueue(t.stream);
  const cudaError_t e = cudaStreamEndCapture(t.stream, &g.graph);
  KVQ_RETURN_IF_ERROR(s);
  KVQ_CUDA_TRY(e, "end capture");
  KVQ_CUDA_TRY(cudaGraphInstantiate(&g.exec, g.graph, 0), "graph instantiate");
  return Status::ok();
}

template <int U>
__global__ void read_kernel(const uint4* __restrict__ src, size_t n, uint32_t never, uint32_t* sink);

// Evicts L2 before a timed replay (BenchTiming::flush). The buffer holds 0x3c bytes (16-byte loads of it
// XOR to 0, never the read kernel's 1) and its last 16 bytes are the read kernel's sink.
Status flush_l2(const BenchTiming& timing, DeviceBuffer& flush, cudaStream_t s) {
  if (timing.flush == L2Flush::kWrite) {
    KVQ_CUDA_TRY(cudaMemsetAsync(flush.get(), 0x3c, flush.size() - 16, s), "L2 flush");
    return Status::ok();
  }
  static const Result<CudaDeviceInfo> dev = cuda_device_info();
  if (!dev.is_ok()) return dev.status();
  const size_t n = (flush.size() - 16) / 16;
  read_kernel<4><<<dev->sm_count * 8, 256, 0, s>>>(flush.as<uint4>(), n, 1u, reinterpret_cast<uint32_t*>(flush.as<uint4>() + n));
  return detail::launch_status("L2 flush (read)");
}

// Times `enqueue` (which must only launch work on the stream) as CUDA graph replays. The case's setup (codes and
// scales filled by kernels, memsets) runs on the legacy default stream, which the timer's non-blocking stream
// does not wait for, hence the device-wide wait first. The warm-up lasts at least BenchTiming::warmup_ms: after
// the previous case freed its buffers, a case's first ~10 ms of replays ran slow (fp8 B16 Hq32 Hkv16 L32768
// after bf16: the first 18-20 replays at ~600 us, then ~528; docs/GPU_NOTES.md §23).
//   replay    the work alone in the graph; each timed replay is the L2 flush (untimed), the start event, the
//             graph's launch and the stop event: the work's time plus a lone graph launch's latency
//   in_graph  the flush, the start event, the work and the stop event in one graph: the work starts as the
//             node after the flush, as a kernel of an engine's captured decode step starts after the one before
//             it, without a launch of its own (docs/GPU_NOTES.md §27)
template <class F>
Result<Stats> time_work(const BenchTiming& timing, DeviceBuffer* flush, F&& enqueue) {
  Timer t;
  KVQ_RETURN_IF_ERROR(t.init());
  const bool flushing = flush != nullptr && timing.cold_l2;
  Graph g;
  KVQ_RETURN_IF_ERROR(capture(t, g, [&](cudaStream_t s) {
    if (!timing.in_graph) return enqueue(s);
    if (flushing) KVQ_RETURN_IF_ERROR(flush_l2(timing, *flush, s));
    KVQ_CUDA_TRY(cudaEventRecordWithFlags(t.start, s, cudaEventRecordExternal), "event record");
    KVQ_RETURN_IF_ERROR(enqueue(s));
    KVQ_CUDA_TRY(cudaEventRecordWithFlags(t.stop, s, cudaEventRecordExternal), "event record");
    return Status::ok();
  }));
  KVQ_CUDA_TRY(cudaDeviceSynchronize(), "waiting for the case's setup");
  auto replay = [&](bool timed) -> Status {
    if (timing.in_graph) {
      KVQ_CUDA_TRY(cudaGraphLaunch(g.exec, t.stream), "graph launch");
      return cuda_status(cudaStreamSynchronize(t.stream), "graph replay");
    }
    if (flushing) KVQ_RETURN_IF_ERROR(flush_l2(timing, *flush, t.stream));
    if (timed) KVQ_CUDA_TRY(cudaEventRecord(t.start, t.stream), "event record");
    KVQ_CUDA_TRY(cudaGraphLaunch(g.exec, t.stream), "graph launch");
    if (timed) KVQ_CUDA_TRY(cudaEventRecord(t.stop, t.stream), "event record");
    return cuda_status(cudaStreamSynchronize(t.stream), "graph replay");
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (int warm = 0; warm < timing.warmup ||
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < timing.warmup_ms;
       ++warm)
    KVQ_RETURN_IF_ERROR(replay(false));
  std::vector<float> ms;
  for (int i = 0; i < std::max(timing.iters, 30); ++i) {
    KVQ_RETURN_IF_ERROR(replay(true));
    float m = 0;
    KVQ_CUDA_TRY(cudaEventElapsedTime(&m, t.start, t.stop), "elapsed");
    ms.push_back(m);
  }
  return summarize(std::move(ms));
}

Result<DeviceBuffer> l2_flush_buffer() {
  auto dev = cuda_device_info();
  if (!dev.is_ok()) return dev.status();
  auto buf = DeviceBuffer::create(std::max<size_t>(2 * dev->l2_bytes, size_t{64} << 20) + 16);
  if (!buf.is_ok()) return buf.status();
  KVQ_RETURN_IF_ERROR(buf.value().fill_byte(0x3c));
  return buf;
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// A streaming copy kernel: 16-byte accesses, four loads in flight per thread. cudaMemcpy's
// device-to-device path reaches noticeably less on H200, so the better of the two is the ceiling.
__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
                d = __ldcs(src + i + 3 * stride);
    __stcs(dst + i, a);
    __stcs(dst + i + stride, b);
    __stcs(dst + i + 2 * stride, c);
    __stcs(dst + i + 3 * stride, d);
  }
  for (; i < n; i += stride) __stcs(dst + i, __ldcs(src + i));
}

// A read-only stream: U independent 16-byte loads in flight per thread, XOR-reduced; the result is
// stored only under a condition the data never meets, so the loads stay live but nothing is written.
template <int U>
__global__ void read_kernel(const uint4* __restrict__ src, size_t n, uint32_t never, uint32_t* sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == never) sink[0] = acc;
}

// Read-only gather of kChunk-byte chunks in the order of `perm`: the access pattern of a paged
// cache, whose contiguous runs are one page-head tile (block_size x head_dim codes). U chunks per
// warp are in flight (U x kChunk = 4 KB).
template <int kChunk, int U>
__global__ void gather_kernel(const uint4* __restrict__ src, const int32_t* __restrict__ perm, int n_chunks,
                              uint32_t never, uint32_t* sink) {
  constexpr int kPer = kChunk / 16 / 32;  // 16-byte loads per lane per chunk
  const int warps = static_cast<int>(gridDim.x * blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  uint32_t acc = 0;
  for (int i = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32); i < n_chunks; i += U * warps) {
    uint4 v[U][kPer];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = i + u * warps;
      const uint4* c = src + static_cast<size_t>(j < n_chunks ? __ldg(perm + j) : 0) * (kChunk / 16);
#pragma unroll
      for (int k = 0; k < kPer; ++k) v[u][k] = j < n_chunks ? __ldcs(c + k * 32 + lane) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc ^= v[u][k].x ^ v[u][k].y ^ v[u][k].z ^ v[u][k].w;
  }
  if (acc == never) sink[0] = acc;
}

// The ceilings stream GiB-sized buffers (L2 irrelevant) after a warmup that lets the clocks come up.
BenchTiming ceiling_timing(int iters, bool in_graph) {
  BenchTiming t;
  t.in_graph = in_graph;
  t.iters = std::max(iters, 30);
  t.warmup = 20;
  t.cold_l2 = false;
  return t;
}

// A source of `bytes` filled with 0x3c: each 16-byte load of it XORs to 0 (the read kernels' `never` is 1).
Result<DeviceBuffer> filled_source(size_t bytes) {
  auto src = DeviceBuffer::create(bytes);
  if (!src.is_ok()) return src.status();
  KVQ_RETURN_IF_ERROR(src.value().fill_byte(0x3c));
  return src;
}

double elem_bytes(Format f) { return format_bits(f) / 8.0; }  // int4: 0.5

}  // namespace

std::string DecodeShape::label() const {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "B%d Hq%d Hkv%d D%d L%d", batch, num_q_heads, num_kv_heads, head_dim, seq_len);
  return buf;
}

std::vector<DecodeShape> default_decode_shapes() {
  return {{1, 32, 8, 128, 32768}, {8, 32, 8, 128, 8192},  {8, 32, 16, 128, 16384},
          {32, 32, 8, 128, 4096}, {64, 32, 8, 128, 8192}, {16, 32, 16, 128, 32768},
          {8, 9, 3, 64, 2048},    {64, 9, 3, 64, 8192},   {16, 8, 1, 256, 8192}};
}

Result<CopyBandwidth> measure_copy_bandwidth(size_t bytes, int iters, bool in_graph) {
  auto src = filled_source(bytes);
  if (!src.is_ok()) return src.status();
  auto dst = DeviceBuffer::create(bytes);
  if (!dst.is_ok()) return dst.status();
  auto dev = cuda_device_info();
  if (!dev.is_ok()) return dev.status();
  const BenchTiming timing = ceiling_timing(iters, in_graph);
  double best_us = 0;
  for (int variant = 0; variant < 2; ++variant) {
    auto st = time_work(timing, nullptr, [&](cudaStream_t s) {
      if (variant == 0)
        return cuda_status(cudaMemcpyAsync(dst.value().get(), src.value().get(), bytes, cudaMemcpyDeviceToDevice, s), "copy");
      copy_kernel<<<dev->sm_count * 8, 256, 0, s>>>(src.value().as<uint4>(), dst.value().as<uint4>(), bytes / 16);
      return detail::launch_status("copy kernel");
    });
    if (!st.is_ok()) return st.status();
    if (best_us == 0 || st->median < best_us) best_us = st->median;
  }
  CopyBandwidth c;
  c.bytes = 2.0 * static_cast<double>(bytes);
  c.us_median = best_us;
  c.tb_per_s = c.bytes / (c.us_median * 1e-6) / 1e12;
  return c;
}

namespace {

// The read-only stream kernel over n 16-byte words of src, as graph replays under `timing` (flushing L2
// with `flush` where the timing asks for a cold L2); the best median over the variants (loads in flight
// per thread, CTAs per SM).
struct ReadVariant {
  int unroll, ctas_per_sm;
};
constexpr ReadVariant kReadVariants[] = {{4, 8}, {8, 8}, {4, 16}};
template <size_t K>
Result<double> time_read_stream(DeviceBuffer& src, size_t n, DeviceBuffer& sink, const ReadVariant (&variants)[K],
                                const BenchTiming& timing, DeviceBuffer* flush, const CudaDeviceInfo& dev) {
  double best_us = 0;
  for (const ReadVariant v : variants) {
    auto st = time_work(timing, flush, [&](cudaStream_t s) {
      const int grid = dev.sm_count * v.ctas_per_sm, block = 2048 / v.ctas_per_sm;
      const uint4* p = src.as<uint4>();
      uint32_t* out = sink.as<uint32_t>();
      if (v.unroll == 4) {
        read_kernel<4><<<grid, block, 0, s>>>(p, n, 1u, out);
      } else {
        read_kernel<8><<<grid, block, 0, s>>>(p, n, 1u, out);
      }
      return detail::launch_status("read kernel");
    });
    if (!st.is_ok()) return st.status();
    if (best_us == 0 || st->median < best_us) best_us = st->median;
  }
  return best_us;
}

}  // namespace

Result<CopyBandwidth> measure_read_bandwidth(size_t bytes, int iters, bool in_graph) {
  auto src = filled_source(bytes);
  if (!src.is_ok()) return src.status();
  auto sink = DeviceBuffer::create(16);
  if (!sink.is_ok()) return sink.status();
  auto dev = cuda_device_info();
  if (!dev.is_ok()) return dev.status();
  auto best_us = time_read_stream(src.value(), bytes / 16, sink.value(), kReadVariants, ceiling_timing(iters, in_graph),
                                  nullptr, dev.value());
  if (!best_us.is_ok()) return best_us.status();
  CopyBandwidth c;
  c.bytes = static_cast<double>(bytes);
  c.us_median = best_us.value();
  c.tb_per_s = c.bytes / (c.us_median * 1e-6) / 1e12;
  return c;
}

Result<CopyBandwidth> measure_gather_bandwidth(int chunk_bytes, bool shuffled, size_t bytes, int iters, bool in_graph) {
  if (chunk_bytes != 1024 && chunk_bytes != 2048 && chunk_bytes != 4096)
    return invalid_argument("bench: gather chunks of 1024, 2048 or 4096 bytes");
  auto src = filled_source(bytes);
  if (!src.is_ok()) return src.status();
  auto sink = DeviceBuffer::create(16);
  if (!sink.is_ok()) return sink.status();
  const int n = static_cast<int>(bytes / chunk_bytes);
  std::vector<int32_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  if (shuffled) {
    std::mt19937_64 rng(3);
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  auto dperm = DeviceBuffer::create(perm.size() * 4);
  if (!dperm.is_ok()) return dperm.status();
  KVQ_RETURN_IF_ERROR(dperm.value().upload(perm.data(), perm.size() * 4));
  auto dev = cuda_device_info();
  if (!dev.is_ok()) return dev.status();
  auto st = time_work(ceiling_timing(iters, in_graph), nullptr, [&](cudaStream_t s) {
    const uint4* p = src.value().as<uint4>();
    const int32_t* pm = dperm.value().as<int32_t>();
    uint32_t* out = sink.value().as<uint32_t>();
    const int grid = dev->sm_count * 8;
    if (chunk_bytes == 1024) gather_kernel<1024, 4><<<grid, 256, 0, s>>>(p, pm, n, 1u, out);
    if (chunk_bytes == 2048) gather_kernel<2048, 2><<<grid, 256, 0, s>>>(p, pm, n, 1u, out);
    if (chunk_bytes == 4096) gather_kernel<4096, 1><<<grid, 256, 0, s>>>(p, pm, n, 1u, out);
    return detail::launch_status("gather kernel");
  });
  if (!st.is_ok()) return st.status();
  CopyBandwidth c;
  c.bytes = static_cast<double>(n) * chunk_bytes;
  c.us_median = st->median;
  c.tb_per_s = c.bytes / (c.us_median * 1e-6) / 1e12;
  return c;
}

// ---- decode -------------------------------------------------------------------------------------------

namespace {

// Sizes from the command line (--shapes, --tokens/--heads/--head-dim), checked before anything is
// allocated: every count positive, page counts that fit the int arithmetic, and the buffers within
// the device's memory and their host copies within the host's. `what` names the shape.
Status check_bench_size(const std::string& what, double tokens, int num_kv_heads, int head_dim, int block_size,
                        const CudaDeviceInfo& dev) {
  const double pages = tokens / block_size + 1;
  // K and V at 2 bytes (bf16 inputs, the bf16 cache or sink: the widest stored), scales, tables.
  const double device_bytes = tokens * num_kv_heads * head_dim * 2.0 * 2 * 2 + tokens * num_kv_heads * 8.0 + pages * 8;
  const double host_bytes = tokens * num_kv_heads * head_dim * 2.0 + pages * 8;
  const uint64_t host_mem = physical_memory_bytes();
  auto gib = [](double b) { return std::to_string(static_cast<long long>(b / double(1 << 30) + 0.5)) + " GiB"; };
  if (pages > double(1 << 30))
    return invalid_argument(what + " needs more than 2^30 cache pages; use fewer tokens");
  if (dev.global_mem_bytes > 0 && device_bytes > double(dev.global_mem_bytes))
    return out_of_memory(what + " needs about " + gib(device_bytes) + " of device memory, more than the " +
                         gib(double(dev.global_mem_bytes)) + " of " + dev.name + "; use fewer tokens or heads");
  if (host_mem > 0 && host_bytes > double(host_mem))
    return out_of_memory(what + " needs about " + gib(host_bytes) + " of host memory, more than this machine's " +
                         gib(double(host_mem)));
  return Status::ok();
}

// One cold run's rows (kTimelineWords per CTA) reduced to DecodeBenchRow::Timeline (its per-CTA vectors
// filled when `full`).
DecodeBenchRow::Timeline reduce_timeline(const std::vector<unsigned long long>& rows, long long n, bool full) {
  DecodeBenchRow::Timeline tl;
  tl.ctas = static_cast<int>(n);
  unsigned long long t0 = ~0ull;
  for (long long i = 0; i < n; ++i) t0 = std::min(t0, rows[i * kTimelineWords]);
  std::vector<double> ends(n);
  double dur = 0, ramp = 0, pages = 0, tail = 0, work = 0, query = 0, item0 = 0, warps = 0, primed = 0, mhz = 0;
  double rows_w = 0, heads = 0, store = 0;
  long long with_pages = 0, with_marks = 0, with_primed = 0, with_clock = 0, with_merge = 0;
  std::vector<int> per_sm;  // CTAs per SM
  for (long long i = 0; i < n; ++i) {
    const unsigned long long* r = &rows[i * kTimelineWords];
    const double st = 1e-3 * static_cast<double>(r[0] - t0);
    ends[i] = 1e-3 * static_cast<double>(r[1] - t0);
    if (r[4] != 0 && r[5] >= r[4] && r[4] >= r[0] && r[1] >= r[5]) {  // 0: a CTA without work
      ramp += 1e-3 * static_cast<double>(r[4] - r[0]);
      pages += 1e-3 * static_cast<double>(r[5] - r[4]);
      tail += 1e-3 * static_cast<double>(r[1] - r[5]);
      ++with_pages;
      if (r[6] >= r[0] && r[8] >= r[0] && r[9] >= r[0] && r[10] >= r[5] && r[6] != 0 && r[8] != 0 && r[9] != 0) {
        work += 1e-3 * static_cast<double>(r[6] - r[0]);
        query += 1e-3 * static_cast<double>(r[8] - r[0]);
        item0 += 1e-3 * static_cast<double>(r[9] - r[0]);
        warps += 1e-3 * static_cast<double>(r[10] - r[5]);
        ++with_marks;
        if (r[7] >= r[0] && r[7] != 0) primed += 1e-3 * static_cast<double>(r[7] - r[0]), ++with_primed;
        if (r[13] >= r[10] && r[14] >= r[13] && r[1] >= r[14] && r[13] != 0) {
          rows_w += 1e-3 * static_cast<double>(r[13] - r[10]);
          heads += 1e-3 * static_cast<double>(r[14] - r[13]);
          store += 1e-3 * static_cast<double>(r[1] - r[14]);
          ++with_merge;
        }
      }
    }
    if (r[11] != 0 && r[12] > r[11] && r[1] > r[0]) {  // cycles per ns x 1000 = MHz
      const double f = 1e3 * static_cast<double>(r[12] - r[11]) / static_cast<double>(r[1] - r[0]);
      mhz += f, ++with_clock;
      tl.min_sm_mhz = tl.min_sm_mhz == 0 ? f : std::min(tl.min_sm_mhz, f);
    }
    const auto sm = static_cast<size_t>(r[2]);
    if (sm >= per_sm.size()) per_sm.resize(sm + 1, 0);
    ++per_sm[sm];
    tl.last_start_us = std::max(tl.last_start_us, st);
    dur += ends[i] - st;
    if (full) {
      tl.start_us.push_back(st);
      tl.end_us.push_back(ends[i]);
      tl.sm.push_back(static_cast<int>(r[2]));
    }
  }
  std::sort(ends.begin(), ends.end());
  tl.first_end_us = ends.front();
  tl.median_end_us = ends[ends.size() / 2];
  tl.span_us = ends.back();
  tl.mean_cta_us = dur / static_cast<double>(n);
  if (with_pages > 0) {
    tl.mean_ramp_us = ramp / static_cast<double>(with_pages);
    tl.mean_pages_us = pages / static_cast<double>(with_pages);
    tl.mean_tail_us = tail / static_cast<double>(with_pages);
  }
  if (with_marks > 0) {
    const double m = static_cast<double>(with_marks);
    tl.mean_work_us = work / m, tl.mean_query_us = query / m, tl.mean_item0_us = item0 / m, tl.mean_warps_us = warps / m;
  }
  if (with_primed > 0) tl.mean_primed_us = primed / static_cast<double>(with_primed);
  if (with_merge > 0) {
    const double m = static_cast<double>(with_merge);
    tl.mean_merge_rows_us = rows_w / m, tl.mean_merge_heads_us = heads / m, tl.mean_merge_store_us = store / m;
  }
  if (with_clock > 0) tl.mean_sm_mhz = mhz / static_cast<double>(with_clock);
  if (!per_sm.empty()) tl.max_ctas_per_sm = *std::max_element(per_sm.begin(), per_sm.end());
  return tl;
}

// `runs` more cold runs of the case with DecodePlan::cta_timeline set: the first reduced in full, each
// summarised in Timeline::runs.
Result<DecodeBenchRow::Timeline> decode_timeline(const DecodeArgs& a, DecodePlan plan, DeviceBuffer& ws,
                                                 DeviceBuffer& flush, const BenchTiming& timing, Timer& t, int runs) {
  const long long n = cta_timeline_entries(plan, a.geom.num_kv_heads);
  auto buf = DeviceBuffer::create(static_cast<size_t>(n) * kTimelineWords * 8);
  if (!buf.is_ok()) return buf.status();
  plan.cta_timeline = buf.value().as<unsigned long long>();
  DecodeBenchRow::Timeline first;
  std::vector<unsigned long long> rows(static_cast<size_t>(n) * kTimelineWords);
  KVQ_CUDA_TRY(cudaDeviceSynchronize(), "waiting for the case's setup");  // as in time_work
  for (int run_i = 0; run_i < std::max(runs, 1); ++run_i) {
    if (timing.cold_l2) KVQ_RETURN_IF_ERROR(flush_l2(timing, flush, t.stream));
    KVQ_CUDA_TRY(cudaEventRecord(t.start, t.stream), "event record");
    KVQ_RETURN_IF_ERROR(run(a, plan, ws.get(), t.stream));
    KVQ_CUDA_TRY(cudaEventRecord(t.stop, t.stream), "event record");
    KVQ_CUDA_TRY(cudaStreamSynchronize(t.stream), "timeline run");
    float ms = 0;
    KVQ_CUDA_TRY(cudaEventElapsedTime(&ms, t.start, t.stop), "event time");
    KVQ_RETURN_IF_ERROR(buf.value().download(rows.data(), rows.size() * 8));
    const DecodeBenchRow::Timeline tl = reduce_timeline(rows, n, run_i == 0);
    DecodeBenchRow::Timeline::Run r;
    r.event_us = 1e3 * ms, r.span_us = tl.span_us, r.mean_cta_us = tl.mean_cta_us, r.mean_pages_us = tl.mean_pages_us;
    r.mean_sm_mhz = tl.mean_sm_mhz, r.min_sm_mhz = tl.min_sm_mhz, r.max_ctas_per_sm = tl.max_ctas_per_sm;
    if (run_i == 0) first = tl;
    first.runs.push_back(r);
  }
  return first;
}

// The read-only stream over `bytes` (a fresh buffer, contiguous) under the case's own timing: the same
// cold L2 and the same size, so its launch, ramp and tail are the ones a decode of those bytes cannot
// avoid either (the 1 GiB ceiling amortises them). Best of the ceiling's 4-loads variants (8 and 16 CTAs per SM).
Result<double> time_same_bytes_read(size_t bytes, const BenchTiming& timing, DeviceBuffer& flush,
                                    const CudaDeviceInfo& dev) {
  auto src = filled_source((bytes + 15) / 16 * 16);
  if (!src.is_ok()) return src.status();
  auto sink = DeviceBuffer::create(16);
  if (!sink.is_ok()) return sink.status();
  constexpr ReadVariant kSameBytesVariants[] = {{4, 8}, {4, 16}};
  return time_read_stream(src.value(), src.value().size() / 16, sink.value(), kSameBytesVariants, timing, &flush, dev);
}

// The engine's attention step on the case's cache: the write of one new token per sequence (fp32 rows into the
// sequence's last main slot, so the decode's lengths stay the case's) alone, and followed by the decode in one
// graph; the medians of both (us; 0 and 0 where the write kernels do not take the format). With
// DecodePlan::overlap_previous the decode's launch overlaps the write.
Result<std::pair<double, double>> time_write_and_decode(const DecodeArgs& a, const DecodePlan& plan, DeviceBuffer& dws,
                                                        const std::vector<int32_t>& bt, int max_blocks, int main_tokens,
                                                        float* k_amax, float* v_amax, const DecodeBenchOptions& o,
                                                        DeviceBuffer& flush, std::mt19937_64& rng) {
  const cache::CacheGeometry& g = a.geom;
  const int n = a.tables.num_seqs, bs = g.block_size;
  std::vector<int32_t> slots(static_cast<size_t>(n));
  for (int b = 0; b < n; ++b)
    slots[b] = cache::encode_main_slot(bt[static_cast<size_t>(b) * max_blocks + (main_tokens - 1) / bs], (main_tokens - 1) % bs, bs);
  const size_t elems = static_cast<size_t>(n) * g.num_kv_heads * g.head_dim;
  std::vector<float> rows(elems);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : rows) x = nd(rng);
  auto dslots = DeviceBuffer::create(slots.size() * 4);
  auto dk = DeviceBuffer::create(elems * 4), dv = DeviceBuffer::create(elems * 4);
  if (!dslots.is_ok() || !dk.is_ok() || !dv.is_ok()) return out_of_memory("bench: the step's write rows");
  KVQ_RETURN_IF_ERROR(dslots.value().upload(slots.data(), slots.size() * 4));
  KVQ_RETURN_IF_ERROR(dk.value().upload(rows.data(), elems * 4));
  KVQ_RETURN_IF_ERROR(dv.value().upload(rows.data(), elems * 4));
  WriteArgs w;
  w.geom = g;
  w.layer = a.layer;
  w.k_block_amax = k_amax, w.v_block_amax = v_amax;
  w.k = dk.value().get(), w.v = dv.value().get();
  w.input = InputType::kFp32;
  w.num_tokens = n;
  w.slot_mapping = dslots.value().as<int32_t>();
  // Formats the write kernels do not take (int4: the backend writes it through its generic kernels) get no step.
  const Status writable = can_implement(w);
  if (writable.code() == StatusCode::kUnsupported) return std::make_pair(0.0, 0.0);
  KVQ_RETURN_IF_ERROR(writable);
  auto wws = DeviceBuffer::create(std::max<size_t>(workspace_size(w), 16));
  if (!wws.is_ok()) return wws.status();
  auto write_only = time_work(o.timing, &flush, [&](cudaStream_t s) { return run(w, wws.value().get(), s); });
  if (!write_only.is_ok()) return write_only.status();
  auto step = time_work(o.timing, &flush, [&](cudaStream_t s) {
    KVQ_RETURN_IF_ERROR(run(w, wws.value().get(), s));
    return run(a, plan, dws.get(), s);
  });
  if (!step.is_ok()) return step.status();
  return std::make_pair(write_only->median, step->median);
}

Result<DecodeBenchRow> bench_decode_one(const DecodeShape& sh, Format f, int bs, const DecodeBenchOptions& o,
                                        DeviceBuffer& flush, const CudaDeviceInfo& dev) {
  if (sh.batch < 1 || sh.num_q_heads < 1 || sh.num_kv_heads < 1 || sh.head_dim < 1 || sh.seq_len < 1 ||
      sh.num_q_heads % sh.num_kv_heads != 0)
    return invalid_argument("B, Hq, Hkv, D and L must be positive and Hq a multiple of Hkv");
  KVQ_RETURN_IF_ERROR(check_bench_size("the KV cache", double(sh.batch) * sh.seq_len, sh.num_kv_heads, sh.head_dim,
                                       bs, dev));
  if (double(sh.batch) * sh.num_q_heads * sh.head_dim * 4 > double(dev.global_mem_bytes))
    return out_of_memory("the queries of the shape do not fit in device memory; use a smaller batch");
  DecodeBenchRow row;
  row.shape = sh;
  row.format = f;
  row.granularity = o.granularity;
  row.block_size = bs;
  const int sink = is_quantized(f) ? std::min(o.sink_tokens, sh.seq_len) : 0;
  row.sink_tokens = sink;
  const int main_tokens = sh.seq_len - sink;
  const int main_pages = ceil_div(main_tokens, bs), sink_pages = ceil_div(sink, bs);

  cache::CacheGeometry g;
  g.num_layers = 1;
  g.num_kv_heads = sh.num_kv_heads;
  g.head_dim = sh.head_dim;
  g.block_size = bs;
  g.num_pages = std::max(1, sh.batch * main_pages);
  g.num_sink_pages = sh.batch * sink_pages;
  g.format = f;
  g.granularity = o.granularity;
  auto layer = DeviceLayer::create(g);
  if (!layer.is_ok()) return layer.status();
  KVQ_RETURN_IF_ERROR(fill_random(layer.value(), o.seed, nullptr));

  // Pages dealt in a random order, as a long-running server's pool would hand them out.
  std::mt19937_64 rng(o.seed);
  std::vector<int32_t> pages(g.num_pages), spages(g.num_sink_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::iota(spages.begin(), spages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  std::shuffle(spages.begin(), spages.end(), rng);
  const int max_blocks = std::max(main_pages, 1), max_sink = sink_pages;
  std::vector<int32_t> lens(sh.batch, sh.seq_len), sinks(sh.batch, sink);
  std::vector<int32_t> bt(static_cast<size_t>(sh.batch) * max_blocks, -1), st(static_cast<size_t>(sh.batch) * max_sink, -1);
  for (int b = 0; b < sh.batch; ++b) {
    for (int j = 0; j < main_pages; ++j) bt[static_cast<size_t>(b) * max_blocks + j] = pages[b * main_pages + j];
    for (int j = 0; j < sink_pages; ++j) st[static_cast<size_t>(b) * max_sink + j] = spages[b * sink_pages + j];
  }
  auto tables = DeviceTables::upload(lens, sinks, bt, max_blocks, st, max_sink);
  if (!tables.is_ok()) return tables.status();

  const size_t qn = static_cast<size_t>(sh.batch) * sh.num_q_heads * sh.head_dim;
  std::vector<float> q(qn);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : q) x = nd(rng);
  auto dq = DeviceBuffer::create(qn * 4);
  auto dout = DeviceBuffer::create(qn * 4);
  auto dlse = DeviceBuffer::create(static_cast<size_t>(sh.batch) * sh.num_q_heads * 4);
  if (!dq.is_ok() || !dout.is_ok() || !dlse.is_ok()) return out_of_memory("bench: query/output buffers");
  KVQ_RETURN_IF_ERROR(dq.value().upload(q.data(), qn * 4));

  DecodeArgs a;
  a.geom = g;
  a.layer = layer.value().view();
  a.tables = tables.value().view();
  a.q = dq.value().as<float>();
  a.out = dout.value().as<float>();
  a.lse = dlse.value().as<float>();
  a.num_q_heads = sh.num_q_heads;
  a.softmax_scale = 1.f / std::sqrt(static_cast<float>(sh.head_dim));
  DecodeOptions dopts;
  dopts.force_splits = o.force_splits;
  dopts.ring_stages = o.ring_stages;
  dopts.ring_feed = o.ring_feed;
  dopts.ring_16bit = o.ring_16bit;
  dopts.packed_heads = o.packed_heads;
  dopts.spread_sink = o.spread_sink;
  dopts.overlap_merge = o.overlap_merge;
  dopts.sink_in_ring = o.sink_in_ring;
  dopts.l2_evict_first = o.l2_evict_first;
  dopts.overlap_previous = o.overlap_previous;
  auto plan = cuda::plan(a, dev, dopts);
  if (!plan.is_ok()) return plan.status();
  row.splits = plan->num_splits;
  row.ctas_per_sm = plan->ctas_per_sm;
  row.threads_per_cta = plan->threads;
  row.ring_stages = plan->ring_stages;
  row.producer_warp = plan->producer_warp;
  row.packed_heads = plan->packed_heads;
  row.l2_evict_first = plan->l2_evict_first;
  row.overlap_previous = plan->overlap_previous;
  auto ws = DeviceBuffer::create(std::max<size_t>(workspace_size(a, plan.value()), 16));
  if (!ws.is_ok()) return ws.status();

  auto stats = time_work(o.timing, &flush, [&](cudaStream_t s) { return run(a, plan.value(), ws.value().get(), s); });
  if (!stats.is_ok()) return stats.status();
  row.us_median = stats->median, row.us_min = stats->min, row.us_max = stats->max, row.us_replays = stats->us_each;
  if (o.with_write && main_tokens > 0) {
    auto step = time_write_and_decode(a, plan.value(), ws.value(), bt, max_blocks, main_tokens,
                                      layer.value().k_block_amax(), layer.value().v_block_amax(), o, flush, rng);
    if (!step.is_ok()) return step.status();
    row.write_us = step->first, row.step_us = step->second;
  }

  const double b = sh.batch, hkv = sh.num_kv_heads, d = sh.head_dim;
  double bytes = b * main_tokens * hkv * d * elem_bytes(f) * 2 + b * sink * hkv * d * 2 * 2;
  if (is_quantized(f)) {
    if (o.granularity == ScaleGranularity::kPerTokenHead) bytes += b * main_tokens * hkv * 4 * 2;
    if (o.granularity == ScaleGranularity::kPerBlockHead) bytes += b * main_pages * hkv * 4 * 2;
    if (o.granularity == ScaleGranularity::kPerTensor) bytes += 8;
  }
  row.kv_bytes = bytes;
  row.tb_per_s = bytes / (row.us_median * 1e-6) / 1e12;
  if (o.timeline) {
    Timer t;
    KVQ_RETURN_IF_ERROR(t.init());
    auto tl = decode_timeline(a, plan.value(), ws.value(), flush, o.timing, t, o.timeline_runs);
    if (!tl.is_ok()) return tl.status();
    row.timeline = tl.value();
  }
  auto same = time_same_bytes_read(static_cast<size_t>(bytes), o.timing, flush, dev);
  if (!same.is_ok()) return same.status();
  row.same_read_us = same.value();
  return row;
}

}  // namespace

Result<std::vector<DecodeBenchRow>> bench_decode(const DecodeBenchOptions& o, const CopyBandwidth& copy,
                                                 const CopyBandwidth& read) {
  auto dev = cuda_device_info();
  if (!dev.is_ok()) return dev.status();
  auto flush = l2_flush_buffer();
  if (!flush.is_ok()) return flush.status();
  const std::vector<int> block_sizes = o.block_sizes.empty() ? std::vector<int>{o.block_size} : o.block_sizes;
  std::vector<DecodeBenchRow> rows;
  for (const DecodeShape& sh : o.shapes) {
    for (const int bs : block_sizes) {
      double bf16_us = 0;
      const size_t first = rows.size();
      for (Format f : o.formats) {
        auto r = bench_decode_one(sh, f, bs, o, flush.value(), dev.value());
        if (!r.is_ok())
          return Status(r.status().code(), sh.label() + " " + format_name(f) + " block " + std::to_string(bs) + ": " +
                                               r.status().message());
        DecodeBenchRow row = r.value();
        row.frac_of_copy = copy.tb_per_s > 0 ? row.tb_per_s / copy.tb_per_s : 0;
        row.frac_of_read = read.tb_per_s > 0 ? row.tb_per_s / read.tb_per_s : 0;
        row.frac_of_same_read = row.us_median > 0 ? row.same_read_us / row.us_median : 0;
        if (f == Format::kBf16) bf16_us = row.us_median;
        rows.push_back(row);
      }
      for (size_t i = first; i < rows.size() && bf16_us > 0; ++i) rows[i].speedup_vs_bf16 = bf16_us / rows[i].us_median;
    }
  }
  return rows;
}

// ---- write --------------------------------------------------------------------------------------------

Result<std::vector<WriteBenchRow>> bench_write(const WriteBenchOptions& o, const CopyBandwidth& copy) {
  auto flush = l2_flush_buffer();
  if (!flush.is_ok()) return flush.status();
  const int n = o.num_tokens, h = o.num_kv_heads, d = o.head_dim, bs = o.block_size;
  if (n < 1 || h < 1 || d < 1 || bs < 1)
    return invalid_argument("--tokens, --heads, --head-dim and the block size must be positive (got " +
                            std::to_string(n) + ", " + std::to_string(h) + ", " + std::to_string(d) + ", " +
                            std::to_string(bs) + ")");
  auto dev = cuda_device_info();
  if (!dev.is_ok()) return dev.status();
  KVQ_RETURN_IF_ERROR(check_bench_size("--tokens " + std::to_string(n) + " x --heads " + std::to_string(h) +
                                           " x --head-dim " + std::to_string(d),
                                       double(n), h, d, bs, dev.value()));
  const size_t elems = static_cast<size_t>(n) * h * d;
  // Rows N(0,1)-like with a few larger values, generated once on the host; K and V get the same rows
  // in both types (the bf16 ones are the fp32 ones rounded).
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> host32(elems);
  std::vector<uint16_t> host16(elems);
  for (size_t i = 0; i < elems; ++i) {
    host32[i] = nd(rng) * (i % 97 == 0 ? 20.f : 1.f);
    host16[i] = format::float_to_bf16(host32[i]);
  }
  const int pages = ceil_div(n, bs);
  std::vector<int32_t> order(pages), slots(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int t = 0; t < n; ++t) slots[t] = cache::encode_main_slot(order[t / bs], t % bs, bs);
  auto dslots = DeviceBuffer::create(static_cast<size_t>(n) * 4);
  if (!dslots.is_ok()) return dslots.status();
  KVQ_RETURN_IF_ERROR(dslots.value().upload(slots.data(), slots.size() * 4));

  std::vector<WriteBenchRow> rows;
  for (InputType in : o.inputs) {
    const size_t in_bytes = in == InputType::kFp32 ? 4 : 2;
    auto dk = DeviceBuffer::create(elems * in_bytes), dv = DeviceBuffer::create(elems * in_bytes);
    if (!dk.is_ok() || !dv.is_ok()) return out_of_memory("bench write: input rows");
    const void* src = in == InputType::kFp32 ? static_cast<const void*>(host32.data()) : host16.data();
    KVQ_RETURN_IF_ERROR(dk.value().upload(src, elems * in_bytes));
    KVQ_RETURN_IF_ERROR(dv.value().upload(src, elems * in_bytes));
    for (Format f : o.formats) {
      for (ScaleGranularity gr : o.granularities) {
        if (!is_quantized(f) && gr != o.granularities.front()) continue;
        cache::CacheGeometry g;
        g.num_layers = 1, g.num_kv_heads = h, g.head_dim = d, g.block_size = bs, g.num_pages = pages;
        g.format = f, g.granularity = gr;
        auto layer = DeviceLayer::create(g);
        if (!layer.is_ok()) return layer.status();
        WriteArgs a;
        a.geom = g;
        a.layer = layer.value().view();
        a.k_block_amax = layer.value().k_block_amax();
        a.v_block_amax = layer.value().v_block_amax();
        a.k = dk.value().get();
        a.v = dv.value().get();
        a.input = in;
        a.num_tokens = n;
        a.slot_mapping = dslots.value().as<int32_t>();
        auto ws = DeviceBuffer::create(std::max<size_t>(workspace_size(a), 16));
        if (!ws.is_ok()) return ws.status();
        auto st = time_work(o.timing, &flush.value(), [&](cudaStream_t s) { return run(a, ws.value().get(), s); });
        if (!st.is_ok()) return st.status();
        WriteBenchRow r;
        r.input = in, r.format = f, r.granularity = gr, r.num_tokens = n, r.num_kv_heads = h, r.head_dim = d;
        r.us_median = st->median, r.us_min = st->min, r.us_max = st->max;
        double bytes = 2.0 * elems * in_bytes + 2.0 * elems * elem_bytes(f);
        if (is_quantized(f) && gr == ScaleGranularity::kPerTokenHead) bytes += 2.0 * n * h * 4;
        if (is_quantized(f) && gr == ScaleGranularity::kPerBlockHead) bytes += 2.0 * pages * h * 4;
        r.bytes = bytes;
        r.tb_per_s = bytes / (r.us_median * 1e-6) / 1e12;
        r.frac_of_copy = copy.tb_per_s > 0 ? r.tb_per_s / copy.tb_per_s : 0;
        rows.push_back(r);
      }
    }
  }
  return rows;
}

}  // namespace kvq::attention::cuda
