// `kvq bench decode|write [--backend cuda|auto] [--json FILE]`: GPU timings of the decode attention and
// the cache write against the device's copy bandwidth, measured in the same run
// (kvq/attention/cuda/bench.h has the method). The CPU kernels have their own Google Benchmark
// binary (kvq_bench_cpu).
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/cache_options.h"
#include "kvq/command.h"
#include "kvq/common/file_io.h"
#include "kvq/quant/spec.h"
#ifdef KVQ_HAVE_CUDA
#include "kvq/attention/cuda/bench.h"
#include "kvq/common/cuda_device.h"
#endif

namespace kvq::tools {
namespace {

struct BenchCliOptions {
  std::string json_path;
  int iters = 50, warmup = 5;
  double warmup_ms = 30;
  bool warm_l2 = false;
  std::string l2_flush = "read";  // read | write (kc::L2Flush)
  std::string timing = "replay";  // replay | in-graph (kc::BenchTiming::in_graph)
  // decode
  CacheCliOptions decode_cache;  // add_cache_options sets each subcommand's defaults
  std::string shapes;  // "B,Hq,Hkv,D,L;..." (default: the nine shapes)
  std::string block_sizes;  // "16,32": every case at each (default: --block-size)
  int splits = 0;
  bool timeline = false;  // per case: the decode kernel's CTA start/end times in one more cold run
  int timeline_runs = 1;  // ... in that many cold runs, each summarised
  bool with_write = false;  // per case also the engine's attention step: a one-token write, then the decode
  // write
  CacheCliOptions write_cache;
  int tokens = 16384, heads = 8, head_dim = 128;
  std::string input = "bf16";  // bf16 | fp32 | both
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// --block-sizes "16,32": checked before any device work, like the other cache options.
Result<std::vector<int>> parse_block_sizes(const std::string& list) {
  std::vector<int> out;
  for (const std::string& b : split(list, ',')) {
    char* end = nullptr;
    const long v = std::strtol(b.c_str(), &end, 10);
    if (*end != '\0' || (v != 16 && v != 32))
      return invalid_argument("--block-sizes '" + list + "': each entry must be 16 or 32 (got '" + b + "')");
    out.push_back(static_cast<int>(v));
  }
  return out;
}

[[maybe_unused]] std::string now_utc() {
  char buf[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

#ifdef KVQ_HAVE_CUDA
namespace kc = kvq::attention::cuda;

int fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "kvq bench: %s: %s\n", what.c_str(), s.to_string().c_str());
  return 1;
}

bool parse_shapes(const std::string& list, std::vector<kc::DecodeShape>& out) {
  out.clear();
  for (const std::string& item : split(list, ';')) {
    const auto v = split(item, ',');
    if (v.size() != 5) {
      std::fprintf(stderr, "kvq bench: shape '%s' must be B,Hq,Hkv,D,L\n", item.c_str());
      return false;
    }
    kc::DecodeShape s;
    try {
      s = {std::stoi(v[0]), std::stoi(v[1]), std::stoi(v[2]), std::stoi(v[3]), std::stoi(v[4])};
    } catch (const std::exception&) {
      std::fprintf(stderr, "kvq bench: shape '%s' has a non-integer field\n", item.c_str());
      return false;
    }
    if (s.batch < 1 || s.num_kv_heads < 1 || s.num_q_heads % s.num_kv_heads != 0 || s.seq_len < 1) {
      std::fprintf(stderr, "kvq bench: shape '%s' is not valid (B, L >= 1; Hq a multiple of Hkv)\n", item.c_str());
      return false;
    }
    out.push_back(s);
  }
  return !out.empty();
}

nlohmann::json device_json(const CudaDeviceInfo& d) {
  return {{"name", d.name},
          {"cc", std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor)},
          {"sm_count", d.sm_count},
          {"l2_bytes", d.l2_bytes},
          {"global_mem_bytes", d.global_mem_bytes},
          {"driver_version", d.driver_version},
          {"runtime_version", d.runtime_version}};
}

int write_json(const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return 0;
  if (Status st = write_file_atomic(path, j.dump(2) + "\n", "--json output"); !st.is_ok()) {
    std::fprintf(stderr, "kvq bench: %s\n", st.message().c_str());
    return 1;
  }
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

int run_bench(const BenchCliOptions& o, const CacheGrid& grid, const std::vector<int>& block_sizes, bool decode) {
  if (!o.json_path.empty()) {
    if (Status st = check_writable(o.json_path, "--json output"); !st.is_ok()) return fail("--json", st);
  }
  auto dev = cuda_device_info();
  if (!dev.is_ok()) return fail("no GPU", dev.status());
  kc::BenchTiming timing;
  timing.iters = std::max(o.iters, 30);
  timing.warmup = std::max(o.warmup, 1);
  timing.warmup_ms = o.warmup_ms;
  timing.cold_l2 = !o.warm_l2;
  timing.flush = o.l2_flush == "write" ? kc::L2Flush::kWrite : kc::L2Flush::kRead;
  timing.in_graph = o.timing == "in-graph";
  auto copy = kc::measure_copy_bandwidth(size_t{1} << 30, 20, timing.in_graph);
  if (!copy.is_ok()) return fail("copy bandwidth", copy.status());
  std::printf("device: %s, %d SMs, L2 %zu MiB; timing: %s\n", dev->name.c_str(), dev->sm_count, dev->l2_bytes >> 20,
              timing.in_graph ? "in-graph (the case as the node after the L2 flush)" : "replay (a graph launch per replay)");
  std::printf("device-to-device copy: %.3f TB/s (read + write, %.0f MB in %.1f us)\n", copy->tb_per_s, copy->bytes / 1e6,
              copy->us_median);
  kc::CopyBandwidth read_bw;
  if (decode) {
    auto r = kc::measure_read_bandwidth(size_t{1} << 30, 20, timing.in_graph);
    if (!r.is_ok()) return fail("read bandwidth", r.status());
    read_bw = r.value();
    std::printf("read-only stream: %.3f TB/s (%.0f MB in %.1f us)\n", read_bw.tb_per_s, read_bw.bytes / 1e6, read_bw.us_median);
  }
  nlohmann::json j;
  j["date"] = now_utc();
  j["device"] = device_json(dev.value());
  j["copy"] = {{"bytes", copy->bytes}, {"us_median", copy->us_median}, {"tb_per_s", copy->tb_per_s}};
  if (decode) {
    j["read"] = {{"bytes", read_bw.bytes}, {"us_median", read_bw.us_median}, {"tb_per_s", read_bw.tb_per_s}};
    // The paged layout's own ceiling: reads in contiguous runs of one page-head tile.
    nlohmann::json gathers = nlohmann::json::array();
    for (const int chunk : {1024, 2048, 4096}) {
      auto gb = kc::measure_gather_bandwidth(chunk, true, size_t{1} << 30, 20, timing.in_graph);
      if (!gb.is_ok()) return fail("gather bandwidth", gb.status());
      std::printf("read-only gather of shuffled %d-byte chunks: %.3f TB/s (%.1f%% of the stream)\n", chunk, gb->tb_per_s,
                  100 * gb->tb_per_s / read_bw.tb_per_s);
      gathers.push_back({{"chunk_bytes", chunk}, {"shuffled", true}, {"us_median", gb->us_median}, {"tb_per_s", gb->tb_per_s}});
    }
    j["gather"] = gathers;
  }
  j["timing"] = {{"iters", timing.iters}, {"warmup", timing.warmup}, {"warmup_ms", timing.warmup_ms}, {"cold_l2", timing.cold_l2},
                 {"l2_flush", timing.cold_l2 ? o.l2_flush : "none"}, {"graph_replays", true},
                 {"mode", o.timing}};

  if (decode) {
    kc::DecodeBenchOptions d;
    if (!o.shapes.empty() && !parse_shapes(o.shapes, d.shapes)) return 2;
    d.formats = grid.formats;
    d.granularity = grid.granularities.front();
    d.block_size = grid.block_size;
    d.block_sizes = block_sizes;
    d.sink_tokens = grid.sink_tokens;
    d.force_splits = o.splits;
    // Measurement knob for the ring-depth sweep of docs/GPU_NOTES.md §9 (not a user setting).
    if (const char* env = std::getenv("KVQ_DECODE_RING_STAGES")) d.ring_stages = std::atoi(env);
    // And for the ring feed of §13: "self" or "producer" (default: the planner's choice).
    if (const char* env = std::getenv("KVQ_DECODE_RING_FEED"))
      d.ring_feed = std::string(env) == "producer" ? kc::RingFeed::kProducer
                    : std::string(env) == "self"   ? kc::RingFeed::kSelf
                                                   : kc::RingFeed::kAuto;
    // And for the 16-bit kernels of §16: "register" or "ring" (default: the planner's choice).
    if (const char* env = std::getenv("KVQ_DECODE_16BIT")) d.ring_16bit = std::string(env) == "register" ? 0 : 1;
    // And for head packing of §18: "0" turns it off (default: the planner's choice).
    if (const char* env = std::getenv("KVQ_DECODE_PACK")) d.packed_heads = std::string(env) == "0" ? 0 : -1;
    // And for the sink's placement in plans of several waves (§19): "1" deals it over all splits.
    if (const char* env = std::getenv("KVQ_DECODE_SPREAD_SINK")) d.spread_sink = std::string(env) == "1" ? 1 : std::string(env) == "0" ? 0 : -1;
    // And for the merge's programmatic launch (§21): 0 a plain kernel after the decode, 1 overlapped.
    if (const char* env = std::getenv("KVQ_DECODE_OVERLAP_MERGE")) d.overlap_merge = std::atoi(env);
    // And for the sink's path in the ring kernel (§21): 0 the register path.
    if (const char* env = std::getenv("KVQ_DECODE_SINK_RING")) d.sink_in_ring = std::atoi(env) == 0 ? 0 : -1;
    // And for the ring copies' L2 policy (§32, §33): 0 plain copies, 1 evict_first (8- and 4-bit caches).
    if (const char* env = std::getenv("KVQ_DECODE_L2_HINT")) d.l2_evict_first = std::atoi(env) == 0 ? 0 : 1;
    // And for the decode's programmatic launch after the kernel before it (§34): 0 a plain launch.
    if (const char* env = std::getenv("KVQ_DECODE_OVERLAP_PREVIOUS")) d.overlap_previous = std::atoi(env) == 0 ? 0 : -1;
    d.with_write = o.with_write;
    d.timeline = o.timeline || o.timeline_runs > 1;
    d.timeline_runs = o.timeline_runs;
    d.timing = timing;
    auto rows = kc::bench_decode(d, copy.value(), read_bw);
    if (!rows.is_ok()) return fail("decode", rows.status());
    // %same: the read-only stream of the case's bytes alone, timed like the case, as a share of its time.
    std::printf("\n%-30s %-13s %3s %5s %6s %4s %6s %10s %10s %8s %7s %7s %7s %8s\n", "shape", "format", "bs", "sink",
                "splits", "ctas", "stages", "feed", "median_us", "TB/s", "%copy", "%read", "%same", "t/bf16");
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& r : rows.value()) {
      // feed: who refills the ring ("-": the register kernel), "+pk" where heads are packed.
      // "+ef": the ring's copies carry the L2 evict_first policy.
      const std::string feed = r.ring_stages == 0 ? "-"
                               : std::string(r.producer_warp ? "prod" : "self") + (r.packed_heads ? "+pk" : "") +
                                     (r.l2_evict_first ? "+ef" : "");
      std::printf("%-30s %-13s %3d %5d %6d %4d %6d %10s %10.2f %8.3f %6.1f%% %6.1f%% %6.1f%% %8.3f\n",
                  r.shape.label().c_str(), format_name(r.format), r.block_size, r.sink_tokens, r.splits, r.ctas_per_sm,
                  r.ring_stages, feed.c_str(), r.us_median, r.tb_per_s,
                  100 * r.frac_of_copy, 100 * r.frac_of_read, 100 * r.frac_of_same_read,
                  r.speedup_vs_bf16 > 0 ? 1.0 / r.speedup_vs_bf16 : 0.0);
      arr.push_back({{"batch", r.shape.batch},
                     {"num_q_heads", r.shape.num_q_heads},
                     {"num_kv_heads", r.shape.num_kv_heads},
                     {"head_dim", r.shape.head_dim},
                     {"seq_len", r.shape.seq_len},
                     {"format", format_name(r.format)},
                     {"granularity", granularity_name(r.granularity)},
                     {"block_size", r.block_size},
                     {"sink_tokens", r.sink_tokens},
                     {"splits", r.splits},
                     {"ctas_per_sm", r.ctas_per_sm},
                     {"threads_per_cta", r.threads_per_cta},
                     {"us_median", r.us_median},
                     {"us_min", r.us_min},
                     {"us_max", r.us_max},
                     {"us_replays", r.us_replays},
                     {"kv_bytes", r.kv_bytes},
                     {"tb_per_s", r.tb_per_s},
                     {"frac_of_copy", r.frac_of_copy},
                     {"frac_of_read", r.frac_of_read},
                     {"same_bytes_read_us", r.same_read_us},
                     {"frac_of_same_bytes_read", r.frac_of_same_read},
                     {"ring_stages", r.ring_stages},
                     {"ring_feed", r.ring_stages == 0 ? "none" : r.producer_warp ? "producer" : "self"},
                     {"packed_heads", r.packed_heads},
                     {"l2_evict_first", r.l2_evict_first},
                     {"overlap_previous", r.overlap_previous},
                     {"speedup_vs_bf16", r.speedup_vs_bf16},
                     {"time_vs_bf16", r.speedup_vs_bf16 > 0 ? 1.0 / r.speedup_vs_bf16 : 0.0}});
    }
    if (d.with_write) {
      // The engine's attention step: write one token per sequence, then decode (one graph); "hidden" is the part
      // of the write's and the decode's own times that the step does not add up to.
      std::printf("\nattention step (write of one new token per sequence, then the decode; overlap: the decode launched"
                  " as a programmatic dependent of the write)\n%-30s %-13s %3s %7s %10s %10s %10s %8s\n",
                  "shape", "format", "bs", "overlap", "write_us", "decode_us", "step_us", "hidden");
      for (size_t i = 0; i < rows.value().size(); ++i) {
        const auto& r = rows.value()[i];
        if (r.step_us <= 0) continue;
        std::printf("%-30s %-13s %3d %7s %10.2f %10.2f %10.2f %8.2f\n", r.shape.label().c_str(), format_name(r.format),
                    r.block_size, r.overlap_previous ? "yes" : "no", r.write_us, r.us_median, r.step_us,
                    r.write_us + r.us_median - r.step_us);
        arr[i]["write_us"] = r.write_us;
        arr[i]["step_us"] = r.step_us;
      }
    }
    if (d.timeline) {
      std::printf("\ndecode kernel CTAs in one cold run (us after the first CTA's start; the rest of the median is launch"
                  " and merge; ramp/pages/tail: a CTA's mean time to its first main page, in them, after them;\n"
                  " work/primed/query/item0: to its work and barriers, warp 0's first ring requests (self-fed rings), its"
                  " query, warp 0's first ring item; warps: warp 0's last page to every warp's; mhz: the SMs' mean clock;\n"
                  " m_rows/m_heads/m_store: the tail after warps, in the warps' merge: rows to shared memory, heads' weights,"
                  " merge and store)\n"
                  "%-30s %-13s %3s %6s %10s %8s %10s %9s %9s %9s %7s %7s %7s %6s %6s %6s %6s %6s %6s %6s %7s %7s\n",
                  "shape", "format", "bs", "ctas", "median_us", "span", "last_start", "first_end", "med_end", "mean_cta",
                  "ramp", "pages", "tail", "work", "primed", "query", "item0", "warps", "mhz", "m_rows", "m_heads", "m_store");
      for (size_t i = 0; i < rows.value().size(); ++i) {
        const auto& r = rows.value()[i];
        const auto& tl = r.timeline;
        std::printf("%-30s %-13s %3d %6d %10.2f %8.2f %10.2f %9.2f %9.2f %9.2f %7.2f %7.2f %7.2f %6.2f %6.2f %6.2f %6.2f %6.2f %6.0f %6.2f %7.2f %7.2f\n",
                    r.shape.label().c_str(), format_name(r.format), r.block_size, tl.ctas, r.us_median, tl.span_us,
                    tl.last_start_us, tl.first_end_us, tl.median_end_us, tl.mean_cta_us, tl.mean_ramp_us,
                    tl.mean_pages_us, tl.mean_tail_us, tl.mean_work_us, tl.mean_primed_us, tl.mean_query_us,
                    tl.mean_item0_us, tl.mean_warps_us, tl.mean_sm_mhz, tl.mean_merge_rows_us,
                    tl.mean_merge_heads_us, tl.mean_merge_store_us);
        arr[i]["timeline"] = {{"ctas", tl.ctas},
                              {"span_us", tl.span_us},
                              {"last_start_us", tl.last_start_us},
                              {"first_end_us", tl.first_end_us},
                              {"median_end_us", tl.median_end_us},
                              {"mean_cta_us", tl.mean_cta_us},
                              {"mean_ramp_us", tl.mean_ramp_us},
                              {"mean_pages_us", tl.mean_pages_us},
                              {"mean_tail_us", tl.mean_tail_us},
                              {"mean_work_us", tl.mean_work_us},
                              {"mean_primed_us", tl.mean_primed_us},
                              {"mean_query_us", tl.mean_query_us},
                              {"mean_item0_us", tl.mean_item0_us},
                              {"mean_warps_us", tl.mean_warps_us},
                              {"mean_merge_rows_us", tl.mean_merge_rows_us},
                              {"mean_merge_heads_us", tl.mean_merge_heads_us},
                              {"mean_merge_store_us", tl.mean_merge_store_us},
                              {"mean_sm_mhz", tl.mean_sm_mhz},
                              {"min_sm_mhz", tl.min_sm_mhz},
                              {"cta_start_us", tl.start_us},
                              {"cta_end_us", tl.end_us},
                              {"cta_sm", tl.sm}};
        nlohmann::json runs = nlohmann::json::array();
        for (const auto& run : tl.runs)
          runs.push_back({{"event_us", run.event_us},
                          {"span_us", run.span_us},
                          {"mean_cta_us", run.mean_cta_us},
                          {"mean_pages_us", run.mean_pages_us},
                          {"mean_sm_mhz", run.mean_sm_mhz},
                          {"min_sm_mhz", run.min_sm_mhz},
                          {"max_ctas_per_sm", run.max_ctas_per_sm}});
        arr[i]["timeline"]["runs"] = runs;
      }
      if (o.timeline_runs > 1) {
        // One line per cold run: which runs were slow, and whether at a lower SM clock or with CTAs waiting.
        std::printf("\ncold runs with per-CTA timestamps (event_us: a plain launch between CUDA events, a few us above"
                    " a graph replay; mhz: the SMs' clock over their CTAs, mean and lowest; ctas/sm: the most loaded SM)\n"
                    "%-30s %-13s %3s %4s %9s %8s %9s %8s %8s %8s %7s\n",
                    "shape", "format", "bs", "run", "event_us", "span", "mean_cta", "pages", "mhz", "min_mhz", "ctas/sm");
        for (const auto& r : rows.value())
          for (size_t k = 0; k < r.timeline.runs.size(); ++k) {
            const auto& run = r.timeline.runs[k];
            std::printf("%-30s %-13s %3d %4zu %9.2f %8.2f %9.2f %8.2f %8.0f %8.0f %7d\n", r.shape.label().c_str(),
                        format_name(r.format), r.block_size, k, run.event_us, run.span_us, run.mean_cta_us,
                        run.mean_pages_us, run.mean_sm_mhz, run.min_sm_mhz, run.max_ctas_per_sm);
          }
      }
    }
    j["decode"] = arr;
  } else {
    kc::WriteBenchOptions w;
    w.num_tokens = o.tokens, w.num_kv_heads = o.heads, w.head_dim = o.head_dim, w.block_size = grid.block_size;
    w.formats = grid.formats;
    w.granularities = grid.granularities;
    w.timing = timing;
    w.inputs.clear();
    if (o.input != "fp32") w.inputs.push_back(kc::InputType::kBf16);
    if (o.input != "bf16") w.inputs.push_back(kc::InputType::kFp32);
    auto rows = kc::bench_write(w, copy.value());
    if (!rows.is_ok()) return fail("write", rows.status());
    std::printf("\nwrite %d tokens x %d kv heads x %d\n%-5s %-13s %-15s %10s %8s %7s\n", w.num_tokens, w.num_kv_heads,
                w.head_dim, "input", "format", "granularity", "median_us", "TB/s", "%copy");
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& r : rows.value()) {
      const char* gname = is_quantized(r.format) ? granularity_name(r.granularity) : "-";
      const char* in = r.input == kc::InputType::kFp32 ? "fp32" : "bf16";
      std::printf("%-5s %-13s %-15s %10.2f %8.3f %6.1f%%\n", in, format_name(r.format), gname, r.us_median, r.tb_per_s,
                  100 * r.frac_of_copy);
      arr.push_back({{"input", in},
                     {"format", format_name(r.format)},
                     {"granularity", gname},
                     {"num_tokens", r.num_tokens},
                     {"num_kv_heads", r.num_kv_heads},
                     {"head_dim", r.head_dim},
                     {"us_median", r.us_median},
                     {"us_min", r.us_min},
                     {"us_max", r.us_max},
                     {"bytes", r.bytes},
                     {"tb_per_s", r.tb_per_s},
                     {"frac_of_copy", r.frac_of_copy}});
    }
    j["write"] = arr;
  }
  return write_json(o.json_path, j);
}
#endif

int dispatch(const BenchCliOptions& o, bool decode) {
  const char* name = decode ? "kvq bench decode" : "kvq bench write";
  const CacheCliOptions& cache = decode ? o.decode_cache : o.write_cache;
  auto grid = to_cache_grid(cache, decode ? CacheCommand::kBenchDecode : CacheCommand::kBenchWrite);
  if (!grid.is_ok()) {
    std::fprintf(stderr, "%s: %s\n", name, grid.status().message().c_str());
    return 2;
  }
  auto block_sizes = parse_block_sizes(o.block_sizes);
  if (!block_sizes.is_ok()) {
    std::fprintf(stderr, "%s: %s\n", name, block_sizes.status().message().c_str());
    return 2;
  }
  if (cache.backend == "cpu") {
    std::fprintf(stderr,
                 "%s: --backend cpu is not benchmarked here; CPU kernels are timed by the kvq_bench_cpu "
                 "binary (Google Benchmark). Use --backend cuda (or auto) on a GPU build.\n",
                 name);
    return 2;
  }
#ifdef KVQ_HAVE_CUDA
  return run_bench(o, grid.value(), block_sizes.value(), decode);
#else
  (void)decode;
  (void)block_sizes;
  std::fprintf(stderr,
               "kvq bench: this kvq was built without CUDA, so --backend cuda is unavailable. Rebuild with "
               "-DKVQ_CUDA=ON on a machine with nvcc (and run it on an NVIDIA GPU).\n");
  return 2;
#endif
}

void add_common(CLI::App* c, BenchCliOptions& o) {
  c->add_option("--json", o.json_path, "Also write the results as JSON to this file");
  c->add_option("--iters", o.iters, "Timed CUDA-graph replays per case (>= 30)")->capture_default_str();
  c->add_option("--warmup", o.warmup, "Untimed replays first (at least; they also last >= --warmup-ms)")->capture_default_str();
  c->add_option("--warmup-ms", o.warmup_ms, "Untimed replays for at least this long per case")
      ->check(CLI::Range(0.0, 10000.0))
      ->capture_default_str();
  c->add_flag("--warm-l2", o.warm_l2, "Do not flush L2 between replays (default: cold L2)");
  c->add_option("--timing", o.timing,
                "replay: each timed replay launches a graph of the case alone after the L2 flush; in-graph: the "
                "flush and the case in one graph, events around the case, which starts as the next node, like a "
                "kernel inside an engine's captured step (the two agreed within 0-1.3 us on H100 and H200)")
      ->check(CLI::IsMember({"replay", "in-graph"}))
      ->capture_default_str();
  c->add_option("--l2-flush", o.l2_flush,
                "How cold-L2 replays evict L2: read (stream a 2x-L2 buffer; L2 left clean, as after a weight GEMM) "
                "or write (memset it; its dirty lines are written back inside the timed kernel)")
      ->check(CLI::IsMember({"read", "write"}))
      ->capture_default_str();
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto opt = std::make_shared<BenchCliOptions>();
  auto which = std::make_shared<int>(0);
  CLI::App* sub = app.add_subcommand("bench", "Time the GPU decode attention or cache write (vs copy bandwidth)");
  sub->require_subcommand(1);
  CLI::App* dec = sub->add_subcommand("decode", "Decode attention over a paged cache, per shape and format");
  add_common(dec, *opt);
  add_cache_options(dec, opt->decode_cache, CacheCommand::kBenchDecode);
  dec->add_option("--shapes", opt->shapes, "Semicolon-separated B,Hq,Hkv,D,L (default: the nine standard shapes)");
  dec->add_option("--block-sizes", opt->block_sizes,
                  "Comma-separated block sizes (16,32) to run every shape and format at, each against bf16 at the "
                  "same block size (default: --block-size)");
  dec->add_option("--splits", opt->splits, "Force this many KV splits (0: planned)")->capture_default_str();
  dec->add_flag("--timeline", opt->timeline,
                "Also run each case once more with per-CTA timestamps and print when its CTAs start and end "
                "(where a one-wave kernel's time goes: ramp, tail, launch and merge)");
  dec->add_option("--timeline-runs", opt->timeline_runs,
                  "With --timeline (implied when > 1): that many cold runs, one line each with its time, span and SM "
                  "clock (which of a case's runs are slow, and why)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  dec->add_flag("--with-write", opt->with_write,
                "Also time each case as the engine's attention step: the cache write of one new token per sequence, "
                "then the decode, in one graph (and the write alone); whole-byte formats (int4 has no such write kernel)");
  dec->callback([which] { *which = 1; });
  CLI::App* wr = sub->add_subcommand("write", "Quantize + scatter of new K/V rows into pages");
  add_common(wr, *opt);
  add_cache_options(wr, opt->write_cache, CacheCommand::kBenchWrite);
  wr->add_option("--tokens", opt->tokens, "New tokens per call")->capture_default_str();
  wr->add_option("--heads", opt->heads, "KV heads")->capture_default_str();
  wr->add_option("--head-dim", opt->head_dim, "Head dim (64, 128, 256)")->capture_default_str();
  wr->add_option("--input", opt->input, "Row type: bf16 (engines' usual), fp32 (kvq's CUDA backend) or both")
      ->check(CLI::IsMember({"bf16", "fp32", "both"}))
      ->capture_default_str();
  wr->callback([which] { *which = 2; });
  return [opt, which] { return dispatch(*opt, *which == 1); };
}}};

}  // namespace
}  // namespace kvq::tools
