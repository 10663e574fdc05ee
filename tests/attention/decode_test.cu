// CUDA decode vs the CPU reference backend on the same paged cache (skipped without a GPU).
//
// Each case builds a heavy-tailed cache with scrambled block tables and holes (synthetic.h),
// poisons everything no sequence owns (NaN codes/scales, so a read past a sequence's end or
// through a wrong page shows), uploads the planes byte for byte and runs the kernel with one
// split, the planned split and a forced odd split (the LSE merge, with empty splits for the short
// sequences). The GPU multiplies on tensor cores with the query and probabilities split into
// high and low halves (~22 bits) and accumulates in fp32, so it must agree with the CPU's fp32
// result to ~1e-5; a wrong token, page or scale costs >= 1e-3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "kvq/attention/bind.h"
#include "kvq/attention/cpu.h"
#include "kvq/attention/cuda/decode.h"
#include "kvq/attention/cuda/device_cache.h"
#include "kvq/attention/cuda/write.h"
#include "kvq/common/cuda_device.h"
#include "testing/attention_testing.h"
#include "testing/cases.h"

namespace kvq::attention {
namespace {

using testing::AttnCase;
namespace kc = kvq::attention::cuda;

constexpr double kGpuVsCpuRelL2 = 1e-4;
constexpr double kLseAbs = 2e-4;

#define ASSERT_OK(expr)                                   \
  do {                                                    \
    const ::kvq::Status s_ = (expr);                      \
    ASSERT_TRUE(s_.is_ok()) << #expr << ": " << s_.to_string(); \
  } while (0)

Result<kc::DeviceLayer> upload_layer(const cache::PagedKvCache& c, int layer) {
  auto dl = kc::DeviceLayer::create(c.geometry());
  if (!dl.is_ok()) return dl.status();
  const cache::PagedKvCache::Planes& p = c.planes(layer);
  kc::DeviceLayer& d = dl.value();
  KVQ_RETURN_IF_ERROR(d.upload(kc::Plane::kKCodes, p.k_codes.data(), p.k_codes.size()));
  KVQ_RETURN_IF_ERROR(d.upload(kc::Plane::kVCodes, p.v_codes.data(), p.v_codes.size()));
  KVQ_RETURN_IF_ERROR(d.upload(kc::Plane::kKScales, p.k_scales.data(), p.k_scales.size() * 4));
  KVQ_RETURN_IF_ERROR(d.upload(kc::Plane::kVScales, p.v_scales.data(), p.v_scales.size() * 4));
  KVQ_RETURN_IF_ERROR(d.upload(kc::Plane::kKSink, p.k_sink.data(), p.k_sink.size() * 2));
  KVQ_RETURN_IF_ERROR(d.upload(kc::Plane::kVSink, p.v_sink.data(), p.v_sink.size() * 2));
  return dl;
}

bool have_gpu(std::string* why) {
  auto dev = cuda_device_info();
  if (!dev.is_ok()) *why = dev.status().to_string();
  return dev.is_ok();
}

// Runs the case on the CPU and on the GPU with several split counts and compares.
void check_case(const AttnCase& c) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  const CudaDeviceInfo dev = cuda_device_info().value();
  auto built = build_synthetic_cache(c.cache_options());
  ASSERT_TRUE(built.is_ok()) << built.status().to_string();
  SyntheticCache sc = std::move(built).value();
  cache::PagedKvCache& kv = *sc.cache;
  ASSERT_OK(testing::poison_unowned(kv, sc.seqs));
  const auto tables = kv.batch_tables(sc.seqs);
  const int n_seqs = static_cast<int>(sc.seqs.size()), hq = c.num_q_heads(), d = c.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::mt19937_64 rng(c.seed + 7);
  std::vector<float> q(static_cast<size_t>(n_seqs) * hq * d);
  sample_queries(sc.profiles[0], hq, n_seqs, scale, 2.f, rng, q.data());

  std::vector<float> ref(q.size()), ref_lse(static_cast<size_t>(n_seqs) * hq);
  ASSERT_OK(cpu::decode(bind_decode(kv, 0, tables, q.data(), ref.data(), hq, scale, ref_lse.data())));

  auto layer = upload_layer(kv, 0);
  ASSERT_TRUE(layer.is_ok()) << layer.status().to_string();
  auto dtab = kc::DeviceTables::upload(tables.seq_lens, tables.sink_lens, tables.block_tables, tables.max_blocks,
                                       tables.sink_tables, tables.max_sink_blocks);
  ASSERT_TRUE(dtab.is_ok()) << dtab.status().to_string();
  auto dq = kc::DeviceBuffer::create(q.size() * 4);
  auto dout = kc::DeviceBuffer::create(q.size() * 4);
  auto dlse = kc::DeviceBuffer::create(ref_lse.size() * 4);
  ASSERT_TRUE(dq.is_ok() && dout.is_ok() && dlse.is_ok());
  ASSERT_OK(dq.value().upload(q.data(), q.size() * 4));

  DecodeArgs a;
  a.geom = kv.geometry();
  a.layer = layer.value().view();
  a.tables = dtab.value().view();
  a.q = dq.value().as<float>();
  a.out = dout.value().as<float>();
  a.lse = dlse.value().as<float>();
  a.num_q_heads = hq;
  a.softmax_scale = scale;
  ASSERT_OK(kc::can_implement(a));

  // One, planned and an odd number of splits; then the smallest ring (8-bit caches), so every
  // stage is reused many times and a stale phase or an early release would show; each ring feed
  // (the planner picks one by the batch shape) with the planned and the smallest ring; 7 splits with
  // the sink dealt over all of them (what a one-wave plan does) and with the sink first; 16-bit
  // caches also on the register kernel (DecodeOptions::ring_16bit = 0), planned and 7 splits; 8- and
  // 4-bit caches with head packing off (the planner packs groups <= 4), planned and 7 splits per feed;
  // 8- and 4-bit caches with the sink on the register path instead of the ring (the planner puts it in
  // the ring where its tiles fit a stage), planned and 7 splits with the sink first, and with the producer;
  // 8- and 4-bit caches on the instances whose ring copies carry the L2 evict_first policy (the planner takes
  // them only where the batch outgrows L2), self-fed planned and producer-fed with 7 splits.
  struct Run {
    int splits, ring_stages;
    kc::RingFeed feed;
    int spread_sink = -1;
    int ring_16bit = -1;
    int packed_heads = -1;
    int sink_in_ring = -1;
    int l2_evict_first = -1;
  };
  for (const Run run : {Run{1, 0, kc::RingFeed::kAuto}, Run{0, 0, kc::RingFeed::kAuto}, Run{7, 0, kc::RingFeed::kAuto, 1},
                        Run{0, 4, kc::RingFeed::kSelf}, Run{0, 4, kc::RingFeed::kProducer},
                        Run{0, 0, kc::RingFeed::kSelf}, Run{7, 0, kc::RingFeed::kProducer, 1},
                        Run{7, 0, kc::RingFeed::kSelf, 0}, Run{7, 0, kc::RingFeed::kProducer, 0},
                        Run{0, 0, kc::RingFeed::kAuto, -1, 0}, Run{7, 0, kc::RingFeed::kAuto, 1, 0},
                        Run{0, 0, kc::RingFeed::kSelf, -1, -1, 0}, Run{7, 0, kc::RingFeed::kProducer, 1, -1, 0},
                        Run{0, 0, kc::RingFeed::kSelf, -1, -1, -1, 0}, Run{7, 0, kc::RingFeed::kSelf, 0, -1, -1, 0},
                        Run{0, 0, kc::RingFeed::kProducer, -1, -1, -1, 0},
                        Run{0, 0, kc::RingFeed::kSelf, -1, -1, -1, -1, 1}, Run{7, 0, kc::RingFeed::kProducer, 1, -1, -1, -1, 1}}) {
    const bool is16 = format_traits(c.format).bits == 16;
    if (run.ring_16bit == 0 && !is16) continue;  // the option only changes 16-bit plans
    if (run.packed_heads == 0 && (is16 || hq / c.num_kv_heads > 4)) continue;  // nothing to unpack
    if (run.sink_in_ring == 0 && (is16 || c.sink == 0)) continue;              // no sink tiles to move
    if (run.l2_evict_first == 1 && is16) continue;                             // no such instances
    const int forced = run.splits;
    kc::DecodeOptions opts;
    opts.force_splits = forced;
    opts.ring_stages = run.ring_stages;
    opts.ring_feed = run.feed;
    opts.spread_sink = run.spread_sink;
    opts.ring_16bit = run.ring_16bit;
    opts.packed_heads = run.packed_heads;
    opts.sink_in_ring = run.sink_in_ring;
    opts.l2_evict_first = run.l2_evict_first;
    auto plan = kc::plan(a, dev, opts);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    if (run.l2_evict_first == 1) ASSERT_TRUE(plan.value().l2_evict_first) << c.name();
    auto ws = kc::DeviceBuffer::create(std::max<size_t>(kc::workspace_size(a, plan.value()), 16));
    ASSERT_TRUE(ws.is_ok());
    ASSERT_OK(dout.value().fill_byte(0xFF));  // NaN: an element the kernel forgets stays NaN
    ASSERT_OK(dlse.value().fill_byte(0xFF));
    ASSERT_OK(kc::run(a, plan.value(), ws.value().get(), nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_OK(kc::last_cuda_status("decode"));
    std::vector<float> got(q.size()), got_lse(ref_lse.size());
    ASSERT_OK(dout.value().download(got.data(), got.size() * 4));
    ASSERT_OK(dlse.value().download(got_lse.data(), got_lse.size() * 4));
    const std::string tag = c.name() + " splits=" + std::to_string(plan.value().num_splits) +
                            (plan.value().spread_sink ? " sink spread" : " sink first") +
                            " stages=" + std::to_string(plan.value().ring_stages) +
                            (plan.value().producer_warp ? " producer" : " self") +
                            (plan.value().packed_heads ? " packed" : "") +
                            (plan.value().sink_in_ring ? " sink-in-ring" : "") +
                            (plan.value().l2_evict_first ? " l2-evict-first" : "") +
                            (is16 ? (plan.value().ring_stages > 0 ? " ring" : " register") : "");
    ASSERT_TRUE(testing::all_finite(got.data(), got.size())) << tag << ": output has NaN/inf (unwritten or poisoned read)";
    // Per (sequence, head) rows, so a single bad row cannot hide in a large norm.
    double worst = 0;
    for (size_t r = 0; r < ref_lse.size(); ++r) {
      const double e = testing::relative_l2(&got[r * d], &ref[r * d], d);
      worst = std::max(worst, e);
      ASSERT_LE(e, kGpuVsCpuRelL2) << tag << " row " << r << " (seq " << r / hq << ", len "
                                   << tables.seq_lens[r / hq] << ", sink " << tables.sink_lens[r / hq] << ")";
      ASSERT_NEAR(got_lse[r], ref_lse[r], kLseAbs) << tag << " lse row " << r;
    }
    ::testing::Test::RecordProperty("worst_rel_l2_s" + std::to_string(forced) + "_ss" + std::to_string(run.spread_sink) +
                                        "_r" + std::to_string(run.ring_stages) +
                                        (plan.value().producer_warp ? "_p" : "_s") + (run.ring_16bit == 0 ? "_reg" : "") +
                                        (plan.value().packed_heads ? "_pk" : "") +
                                        (plan.value().sink_in_ring ? "_sr" : "") +
                                        (plan.value().l2_evict_first ? "_ef" : ""),
                                    std::to_string(worst));
  }
}

// The shared sweep (cases.h), restricted to the head dims the CUDA kernels take, plus shapes
// that only matter on the GPU: a group of 16 (two CTAs per kv head), a group of 3, long
// sequences (many tiles per warp, the prefetch and the planner), block 32 with a mid-page sink.
// Formats these kernels do not take (int4_outlier: the backend's generic kernels) stay on the CPU sweep.
std::vector<AttnCase> gpu_cases() {
  std::vector<AttnCase> out;
  for (const AttnCase& c : testing::sampled_sweep())
    if ((c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256) && format_traits(c.format).device_ready &&
        !c.outliers)
      out.push_back(c);
  uint64_t seed = 5000;
  auto add = [&](Format f, ScaleGranularity g, int d, int hkv, int group, int bs, int sink, std::vector<int> lens,
                 ScaleDtype sd = ScaleDtype::kFp32) {
    AttnCase c;
    c.format = f, c.granularity = g, c.head_dim = d, c.num_kv_heads = hkv, c.group = group, c.scale_dtype = sd;
    c.block_size = bs, c.sink = sink, c.lens = std::move(lens), c.seed = seed++;
    out.push_back(c);
  };
  add(Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 128, 1, 16, 16, 32, {1, 17, 300});
  add(Format::kBf16, ScaleGranularity::kPerTokenHead, 64, 3, 3, 16, 0, {2048, 1, 33});
  add(Format::kInt8, ScaleGranularity::kPerBlockHead, 64, 3, 3, 32, 20, {1500, 21, 64});
  add(Format::kFp8E4m3Fnuz, ScaleGranularity::kPerTokenHead, 128, 2, 4, 32, 20, {3000, 52, 53});
  add(Format::kFp8E4m3, ScaleGranularity::kPerTensor, 256, 1, 8, 16, 256, {2600, 256, 257, 1});
  add(Format::kFp16, ScaleGranularity::kPerTokenHead, 128, 2, 2, 16, 16, {700, 16, 15});
  // 16-bit pages through the bulk ring (one tile per softmax step at D128, two at D64), many ring laps.
  add(Format::kBf16, ScaleGranularity::kPerTokenHead, 128, 2, 4, 32, 20, {3000, 52, 53});
  add(Format::kBf16, ScaleGranularity::kPerTokenHead, 64, 1, 9, 16, 48, {4000, 49, 1});
  add(Format::kFp16, ScaleGranularity::kPerTokenHead, 64, 3, 3, 32, 0, {1500, 21, 64});
  add(Format::kInt8, ScaleGranularity::kPerTokenHead, 256, 2, 5, 32, 0, {1000, 32, 31});
  // The bulk kernel: per-block scales read out of their 16-byte chunk (3 kv heads: every offset in
  // the chunk), and SmolLM2's shape (head_dim 64, GQA 3) with pages spread over many ring laps.
  add(Format::kFp8E4m3, ScaleGranularity::kPerBlockHead, 128, 3, 3, 16, 0, {2000, 5, 16});
  add(Format::kFp8E4m3Fnuz, ScaleGranularity::kPerTokenHead, 64, 3, 3, 16, 16, {4000, 100, 17});
  add(Format::kInt8, ScaleGranularity::kPerTensor, 64, 1, 9, 32, 48, {1200, 49});
  // int4 through the same ring (half-size tiles; D64's lane share is 8 bytes, not a 16-byte piece):
  // every head dim, both scale dtypes, per-block chunk offsets, long sequences over many ring laps.
  add(Format::kInt4, ScaleGranularity::kPerTokenHead, 128, 2, 4, 16, 20, {3000, 52, 53});
  add(Format::kInt4, ScaleGranularity::kPerBlockHead, 64, 3, 3, 16, 0, {4000, 100, 17});
  add(Format::kInt4, ScaleGranularity::kPerTensor, 256, 1, 8, 32, 256, {2600, 256, 257, 1});
  add(Format::kInt4, ScaleGranularity::kPerTokenHead, 64, 1, 9, 32, 48, {1200, 49}, ScaleDtype::kFp16);
  add(Format::kInt4, ScaleGranularity::kPerBlockHead, 128, 3, 16, 32, 16, {1500, 21, 64}, ScaleDtype::kFp16);
  add(Format::kInt4, ScaleGranularity::kPerTokenHead, 256, 2, 5, 16, 0, {1000, 32, 31}, ScaleDtype::kFp16);
  return out;
}

class CudaDecode : public ::testing::TestWithParam<AttnCase> {};

TEST_P(CudaDecode, MatchesCpuReference) { check_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Sweep, CudaDecode, ::testing::ValuesIn(gpu_cases()),
                         [](const ::testing::TestParamInfo<AttnCase>& i) {
                           return i.param.name() + "_" + std::to_string(i.index);
                         });

TEST(CudaDecodeApi, RejectsWhatItCannotRun) {
  DecodeArgs a;
  a.geom.num_kv_heads = 2;
  a.geom.head_dim = 8;
  a.geom.block_size = 16;
  a.num_q_heads = 4;
  a.softmax_scale = 0.1f;
  float dummy[4] = {};
  a.q = dummy;
  a.out = dummy;
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kUnsupported);
  a.geom.head_dim = 128;
  a.geom.format = Format::kInt4;
  EXPECT_TRUE(kc::can_implement(a).is_ok());
  a.geom.outlier_capacity = 8;  // int4_outlier: its sparse plane is read by the generic kernels only
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kUnsupported);
  a.geom.outlier_capacity = 0;
  a.geom.recent_tokens = 32;  // likewise the bf16 recent window
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kUnsupported);
  a.geom.recent_tokens = 0;
  a.geom.format = Format::kFp8E4m3;
  a.num_q_heads = 3;
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kInvalidArgument);
  a.num_q_heads = 4;
  a.geom.block_size = 64;
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kUnsupported);
  a.geom.block_size = 16;
  a.softmax_scale = 0.f;
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kInvalidArgument);
}

// Arguments for plan() alone: sizes and valid (unused) pointers, `len` tokens per sequence, a 256-token sink.
DecodeArgs plan_only_args(uint8_t* mem, Format f, int batch, int hkv, int hq, int head_dim, int bs, int len) {
  DecodeArgs a;
  a.geom.num_layers = 1, a.geom.num_kv_heads = hkv, a.geom.head_dim = head_dim, a.geom.block_size = bs;
  a.geom.format = f, a.geom.granularity = ScaleGranularity::kPerTokenHead;
  a.geom.num_pages = batch * (len / bs), a.geom.num_sink_pages = batch * (256 / bs);
  a.layer.k_codes = a.layer.v_codes = mem;
  a.layer.k_scales = a.layer.v_scales = mem;
  a.layer.k_sink = a.layer.v_sink = reinterpret_cast<uint16_t*>(mem);
  a.tables.num_seqs = batch;
  a.tables.seq_lens = a.tables.sink_lens = a.tables.block_tables = a.tables.sink_tables = reinterpret_cast<int32_t*>(mem);
  a.tables.max_blocks = len / bs, a.tables.max_sink_blocks = 256 / bs;
  a.q = reinterpret_cast<float*>(mem), a.out = reinterpret_cast<float*>(mem);
  a.num_q_heads = hq, a.softmax_scale = 0.088f;
  return a;
}

// plan() depends on its arguments and the device only: a batch plans the same whatever was planned
// before in the process. A feed rule that asked the producer kernel's occupancy before reserving its
// shared memory got the query refused (ring and static memory over 48 KB) until that kernel had been
// planned once, so the first plan of a process differed from later ones (docs/GPU_NOTES.md §22). ctest
// runs each test in a process of its own, so here the first plan of each format is a fresh process's.
TEST(CudaDecodeApi, PlanDoesNotDependOnEarlierPlans) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  auto dummy = kc::DeviceBuffer::create(256);  // plan() reads sizes only; the pointers must merely be valid
  ASSERT_TRUE(dummy.is_ok());
  uint8_t* mem = dummy.value().as<uint8_t>();
  auto args = [&](Format f, int batch, int hkv, int len) { return plan_only_args(mem, f, batch, hkv, 4 * hkv, 128, 16, len); };
  const CudaDeviceInfo dev = cuda_device_info().value();
  for (Format f : {Format::kFp8E4m3, Format::kInt8, Format::kInt4}) {
    const DecodeArgs mid = args(f, 8, 8, 8192);
    auto first = kc::plan(mid, dev);
    ASSERT_TRUE(first.is_ok()) << first.status().to_string();
    kc::DecodeOptions producer, self;
    producer.ring_feed = kc::RingFeed::kProducer, self.ring_feed = kc::RingFeed::kSelf;
    for (const DecodeArgs& other : {args(f, 64, 8, 8192), args(f, 1, 8, 32768), args(f, 8, 16, 16384)})
      for (const kc::DecodeOptions& o : {producer, self, kc::DecodeOptions{}}) ASSERT_TRUE(kc::plan(other, dev, o).is_ok());
    auto again = kc::plan(mid, dev);
    ASSERT_TRUE(again.is_ok());
    const kc::DecodePlan &x = first.value(), &y = again.value();
    EXPECT_EQ(x.producer_warp, y.producer_warp) << format_name(f);
    EXPECT_EQ(x.num_splits, y.num_splits) << format_name(f);
    EXPECT_EQ(x.ring_stages, y.ring_stages) << format_name(f);
    EXPECT_EQ(x.ctas_per_sm, y.ctas_per_sm) << format_name(f);
    EXPECT_EQ(x.smem_bytes, y.smem_bytes) << format_name(f);
    EXPECT_EQ(x.threads, y.threads) << format_name(f);
  }
}

// Rows (sequences x kv heads) that fill two CTAs per SM: one split of two producer-fed CTAs per SM at head dim
// 128 for fp8, int8 pages of 32 tokens and bf16 pages of 16 (DecodePlan::split_pairs), not for int4, int8 pages
// of 16 tokens or fewer rows; and such a batch's planned decode (check_case's planned runs) matches the CPU.
TEST(CudaDecodeApi, RowsForTwoCtasPerSmPlanOneSplit) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  const CudaDeviceInfo dev = cuda_device_info().value();
  auto dummy = kc::DeviceBuffer::create(256);
  ASSERT_TRUE(dummy.is_ok());
  uint8_t* mem = dummy.value().as<uint8_t>();
  auto args = [&](Format f, int batch, int bs) { return plan_only_args(mem, f, batch, 4, 16, 128, bs, 4096); };
  const int pairs_batch = 2 * dev.sm_count / 4;  // rows = 4 x batch, within 3 of 2 x sm_count
  for (Format f : {Format::kFp8E4m3, Format::kInt8, Format::kBf16, Format::kInt4}) {
    for (int bs : {16, 32}) {
      auto p = kc::plan(args(f, pairs_batch, bs), dev);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      const bool want = f == Format::kFp8E4m3 || (f == Format::kInt8 && bs == 32) || (f == Format::kBf16 && bs == 16);
      const std::string tag = std::string(format_name(f)) + " block " + std::to_string(bs);
      EXPECT_EQ(p.value().split_pairs, want) << tag;
      if (want) {
        EXPECT_EQ(p.value().num_splits, 1) << tag;
        EXPECT_TRUE(p.value().producer_warp) << tag;
        EXPECT_GE(p.value().ctas_per_sm, 2) << tag;
        EXPECT_GE(p.value().ring_stages * (2 * bs * 128 * format_traits(f).bits / 8), 48 << 10) << tag;
      }
      auto fewer = kc::plan(args(f, 3 * dev.sm_count / 8, bs), dev);  // 1.5 x sm_count rows
      ASSERT_TRUE(fewer.is_ok());
      EXPECT_FALSE(fewer.value().split_pairs) << tag;
      kc::DecodeOptions forced;
      forced.force_splits = 2;
      auto two = kc::plan(args(f, pairs_batch, bs), dev, forced);
      ASSERT_TRUE(two.is_ok());
      EXPECT_FALSE(two.value().split_pairs) << tag;
      EXPECT_EQ(two.value().num_splits, 2) << tag;
    }
  }
  // The planned decode of such a batch (short, ragged sequences with a sink) against the CPU.
  for (Format f : {Format::kFp8E4m3Fnuz, Format::kBf16}) {
    AttnCase c;
    c.format = f, c.head_dim = 128, c.num_kv_heads = 4, c.group = 4, c.block_size = 16, c.sink = 32;
    std::mt19937 rng(41);
    for (int i = 0; i < pairs_batch; ++i) c.lens.push_back(1 + static_cast<int>(rng() % 700));
    c.seed = 4100 + static_cast<int>(f);
    check_case(c);
  }
}

// At head dim 256 (one CTA of eight attending warps per SM) fp8 rings are fed by their attending warps, int8
// rings by a producer warp (docs/GPU_NOTES.md §25); explicit feeds still win.
TEST(CudaDecodeApi, FeedAtHeadDim256FollowsTheFormat) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  const CudaDeviceInfo dev = cuda_device_info().value();
  auto dummy = kc::DeviceBuffer::create(256);
  ASSERT_TRUE(dummy.is_ok());
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8}) {
    for (int bs : {16, 32}) {
      const DecodeArgs a = plan_only_args(dummy.value().as<uint8_t>(), f, 16, 1, 8, 256, bs, 8192);
      auto p = kc::plan(a, dev);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      EXPECT_EQ(p.value().producer_warp, f == Format::kInt8) << format_name(f) << " block " << bs;
      kc::DecodeOptions producer;
      producer.ring_feed = kc::RingFeed::kProducer;
      auto forced = kc::plan(a, dev, producer);
      ASSERT_TRUE(forced.is_ok());
      EXPECT_TRUE(forced.value().producer_warp) << format_name(f) << " block " << bs;
    }
  }
}

// The ring copies' L2 policy (DecodePlan::l2_evict_first): chosen for 8- and 4-bit caches exactly where the
// batch's pages, bounded by the table widths, outgrow the device's L2; an explicit setting wins for them;
// 16-bit caches have no such instances.
TEST(CudaDecodeApi, L2PolicyFollowsTheBatchBytes) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  const CudaDeviceInfo dev = cuda_device_info().value();
  auto dummy = kc::DeviceBuffer::create(256);
  ASSERT_TRUE(dummy.is_ok());
  constexpr int kLen = 3840, kHkv = 8, kD = 128;  // with the 256-token sink, 4096 tokens per sequence
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt4, Format::kInt8, Format::kBf16, Format::kFp16}) {
    const long long per_seq = 1LL * kHkv * (kLen + 256) * kD * 2 * format_traits(f).bits / 8;
    const int fits = static_cast<int>(static_cast<long long>(dev.l2_bytes) / per_seq);  // bytes <= L2
    ASSERT_GE(fits, 1) << "device L2 of " << dev.l2_bytes << " bytes";
    const bool rule_format = format_traits(f).bits <= 8;
    for (int bs : {16, 32}) {
      const std::string tag = std::string(format_name(f)) + " block " + std::to_string(bs);
      auto below = kc::plan(plan_only_args(dummy.value().as<uint8_t>(), f, fits, kHkv, 4 * kHkv, kD, bs, kLen), dev);
      auto above = kc::plan(plan_only_args(dummy.value().as<uint8_t>(), f, fits + 1, kHkv, 4 * kHkv, kD, bs, kLen), dev);
      ASSERT_TRUE(below.is_ok() && above.is_ok()) << tag;
      EXPECT_FALSE(below.value().l2_evict_first) << tag << ", " << fits << " sequences";
      EXPECT_EQ(above.value().l2_evict_first, rule_format) << tag << ", " << fits + 1 << " sequences";
      for (int forced : {0, 1}) {
        kc::DecodeOptions o;
        o.l2_evict_first = forced;
        auto p = kc::plan(plan_only_args(dummy.value().as<uint8_t>(), f, fits + 1 - forced, kHkv, 4 * kHkv, kD, bs, kLen), dev, o);
        ASSERT_TRUE(p.is_ok()) << tag;
        EXPECT_EQ(p.value().l2_evict_first, forced == 1 && format_traits(f).bits <= 8) << tag << ", forced " << forced;
      }
    }
  }
}

// A small fp8 decode (two sequences of 900 and 40 tokens, 2 kv heads x 4 query heads, D128, a sink of
// 16) uploaded and ready to run: the API tests' common case.
struct SmallDecode {
  SyntheticCache sc;
  std::optional<kc::DeviceLayer> layer;
  std::optional<kc::DeviceTables> tables;
  std::optional<kc::DeviceBuffer> q, out;
  size_t n_out = 0;
  DecodeArgs a;
};
Status make_small_decode(SmallDecode& x, Format format = Format::kFp8E4m3, int head_dim = 128) {
  AttnCase c;
  c.format = format;
  c.head_dim = head_dim, c.num_kv_heads = 2, c.group = 4, c.block_size = 16, c.sink = 16;
  c.lens = {900, 40};
  c.seed = 99;
  auto built = build_synthetic_cache(c.cache_options());
  if (!built.is_ok()) return built.status();
  x.sc = std::move(built).value();
  const auto tables = x.sc.cache->batch_tables(x.sc.seqs);
  auto layer = upload_layer(*x.sc.cache, 0);
  if (!layer.is_ok()) return layer.status();
  auto dtab = kc::DeviceTables::upload(tables.seq_lens, tables.sink_lens, tables.block_tables, tables.max_blocks,
                                       tables.sink_tables, tables.max_sink_blocks);
  if (!dtab.is_ok()) return dtab.status();
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(2 * hq * d);
  std::mt19937_64 rng(3);
  sample_queries(x.sc.profiles[0], hq, 2, 0.088f, 2.f, rng, q.data());
  auto dq = kc::DeviceBuffer::create(q.size() * 4), dout = kc::DeviceBuffer::create(q.size() * 4);
  if (!dq.is_ok()) return dq.status();
  if (!dout.is_ok()) return dout.status();
  KVQ_RETURN_IF_ERROR(dq.value().upload(q.data(), q.size() * 4));
  x.layer.emplace(std::move(layer).value());
  x.tables.emplace(std::move(dtab).value());
  x.q.emplace(std::move(dq).value());
  x.out.emplace(std::move(dout).value());
  x.n_out = q.size();
  x.a.geom = x.sc.cache->geometry();
  x.a.layer = x.layer->view();
  x.a.tables = x.tables->view();
  x.a.q = x.q->as<float>();
  x.a.out = x.out->as<float>();
  x.a.num_q_heads = hq;
  x.a.softmax_scale = 0.088f;
  return Status::ok();
}

// run() only enqueues: it can be captured in a CUDA graph and replayed with the same result.
TEST(CudaDecodeApi, RunIsGraphCapturable) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  SmallDecode x;
  ASSERT_OK(make_small_decode(x));
  const DecodeArgs& a = x.a;
  kc::DeviceBuffer& dout = *x.out;
  const size_t n_out = x.n_out;
  kc::DecodeOptions o;
  o.force_splits = 5;
  auto plan = kc::plan(a, cuda_device_info().value(), o);
  ASSERT_TRUE(plan.is_ok());
  auto ws = kc::DeviceBuffer::create(kc::workspace_size(a, plan.value()));
  ASSERT_TRUE(ws.is_ok());
  ASSERT_OK(kc::run(a, plan.value(), ws.value().get(), nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> direct(n_out), replay(n_out);
  ASSERT_OK(dout.download(direct.data(), direct.size() * 4));
  ASSERT_OK(dout.fill_byte(0));

  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  cudaGraph_t g;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status st = kc::run(a, plan.value(), ws.value().get(), s);
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  ASSERT_OK(st);
  cudaGraphExec_t ge;
  ASSERT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_OK(dout.download(replay.data(), replay.size() * 4));
  EXPECT_EQ(std::memcmp(direct.data(), replay.data(), direct.size() * 4), 0);
  // The merge launched as a plain kernel (no programmatic overlap with the decode) gives the same bits:
  // the overlap changes when the merge's CTAs start, not what they read.
  ASSERT_TRUE(plan.value().overlap_merge || cuda_device_info().value().cc_major < 9);
  o.overlap_merge = 0;
  auto plain = kc::plan(a, cuda_device_info().value(), o);
  ASSERT_TRUE(plain.is_ok());
  ASSERT_FALSE(plain.value().overlap_merge);
  std::vector<float> serial(n_out);
  ASSERT_OK(dout.fill_byte(0xFF));
  ASSERT_OK(kc::run(a, plain.value(), ws.value().get(), s));
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_OK(dout.download(serial.data(), serial.size() * 4));
  EXPECT_EQ(std::memcmp(direct.data(), serial.data(), direct.size() * 4), 0);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

// DecodePlan::overlap_previous: the decode launched as a programmatic dependent of the cache write before it (the
// engine's order; the write lets its dependents launch at its start) reads the pages only after the write: it
// sees the new token (its output moves), and gives the bits of a plain launch after a synchronised write -- on the
// stream and as a captured graph of the two, with a ring plan of several splits and with the register kernel.
TEST(CudaDecodeApi, OverlappedDecodeSeesTheWriteBeforeIt) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  const CudaDeviceInfo dev = cuda_device_info().value();
  for (Format f : {Format::kFp8E4m3, Format::kBf16}) {
    SCOPED_TRACE(format_name(f));
    SmallDecode x;
    ASSERT_OK(make_small_decode(x, f, f == Format::kBf16 ? 256 : 128));  // bf16 D256: the register kernel
    const DecodeArgs& a = x.a;
    kc::DecodeOptions o;
    o.force_splits = 5;
    auto overlapped = kc::plan(a, dev, o);
    o.overlap_previous = 0;
    auto plain = kc::plan(a, dev, o);
    ASSERT_TRUE(overlapped.is_ok() && plain.is_ok());
    EXPECT_EQ(overlapped.value().overlap_previous, dev.cc_major >= 9);
    EXPECT_FALSE(plain.value().overlap_previous);
    // Chosen for plans of three or more splits only; 1 asks for it anyway (sm_90).
    o.force_splits = 2, o.overlap_previous = -1;
    EXPECT_FALSE(kc::plan(a, dev, o).value().overlap_previous);
    o.overlap_previous = 1;
    EXPECT_EQ(kc::plan(a, dev, o).value().overlap_previous, dev.cc_major >= 9);
    auto ws = kc::DeviceBuffer::create(std::max<size_t>(kc::workspace_size(a, overlapped.value()), 16));
    ASSERT_TRUE(ws.is_ok());
    auto decode = [&](const kc::DecodePlan& p, cudaStream_t s, std::vector<float>& out) {
      ASSERT_OK(x.out->fill_byte(0xFF));
      ASSERT_OK(kc::run(a, p, ws.value().get(), s));
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      out.resize(x.n_out);
      ASSERT_OK(x.out->download(out.data(), out.size() * 4));
    };
    // The new token of each sequence: large random rows into its last main slot (the lengths stay).
    const auto tables = x.sc.cache->batch_tables(x.sc.seqs);
    const int n = static_cast<int>(x.sc.seqs.size()), bs = a.geom.block_size;
    const size_t row = static_cast<size_t>(a.geom.num_kv_heads) * a.geom.head_dim;
    std::vector<int32_t> slots(n);
    for (int b = 0; b < n; ++b) {
      const int main = tables.seq_lens[b] - tables.sink_lens[b];
      ASSERT_GT(main, 0);
      slots[b] = cache::encode_main_slot(tables.block_tables[static_cast<size_t>(b) * tables.max_blocks + (main - 1) / bs],
                                         (main - 1) % bs, bs);
    }
    std::vector<float> rows(n * row);
    std::mt19937_64 rng(17);
    std::normal_distribution<float> nd(0.f, 6.f);
    for (float& v : rows) v = nd(rng);
    auto dslots = kc::DeviceBuffer::create(slots.size() * 4), dk = kc::DeviceBuffer::create(rows.size() * 4);
    ASSERT_TRUE(dslots.is_ok() && dk.is_ok());
    ASSERT_OK(dslots.value().upload(slots.data(), slots.size() * 4));
    ASSERT_OK(dk.value().upload(rows.data(), rows.size() * 4));
    kc::WriteArgs w;
    w.geom = a.geom, w.layer = a.layer;
    w.k_block_amax = x.layer->k_block_amax(), w.v_block_amax = x.layer->v_block_amax();
    w.k = w.v = dk.value().get();
    w.input = kc::InputType::kFp32;
    w.num_tokens = n;
    w.slot_mapping = dslots.value().as<int32_t>();
    auto wws = kc::DeviceBuffer::create(std::max<size_t>(kc::workspace_size(w), 16));
    ASSERT_TRUE(wws.is_ok());

    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    std::vector<float> before, after_overlapped, after_plain, replayed;
    decode(plain.value(), s, before);
    ASSERT_OK(kc::run(w, wws.value().get(), s));  // no synchronisation: the decode's CTAs may start during it
    decode(overlapped.value(), s, after_overlapped);
    decode(plain.value(), s, after_plain);
    EXPECT_EQ(std::memcmp(after_overlapped.data(), after_plain.data(), x.n_out * 4), 0);
    EXPECT_NE(std::memcmp(before.data(), after_plain.data(), x.n_out * 4), 0) << "the new token changed nothing";

    // The same two as one captured graph (a programmatic edge between the nodes); the write is idempotent.
    cudaGraph_t g;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    const Status ws_st = kc::run(w, wws.value().get(), s);
    const Status ds_st = kc::run(a, overlapped.value(), ws.value().get(), s);
    ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    ASSERT_OK(ws_st);
    ASSERT_OK(ds_st);
    cudaGraphExec_t ge;
    ASSERT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    ASSERT_OK(x.out->fill_byte(0xFF));
    for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    replayed.resize(x.n_out);
    ASSERT_OK(x.out->download(replayed.data(), replayed.size() * 4));
    EXPECT_EQ(std::memcmp(replayed.data(), after_plain.data(), x.n_out * 4), 0);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
  }
}

// DecodePlan::cta_timeline (kvq bench decode --timeline) only observes: every CTA of the decode kernel
// writes its row (start <= end in the global timer, its SM, its SM clock over the CTA, the merge's steps in
// order), and the output is the same bits as without it -- although the timeline runs its own kernel
// instances (the product's have no marks), for each kernel family: the self-fed and the producer-fed ring,
// packed heads, the register kernel.
struct TimelineCase {
  Format format;
  int head_dim;
  kc::RingFeed feed;
};
class CudaDecodeTimeline : public ::testing::TestWithParam<TimelineCase> {};
TEST_P(CudaDecodeTimeline, RecordsEveryCtaAndChangesNothing) {
  std::string why;
  if (!have_gpu(&why)) GTEST_SKIP() << why;
  SmallDecode x;
  ASSERT_OK(make_small_decode(x, GetParam().format, GetParam().head_dim));
  const CudaDeviceInfo dev = cuda_device_info().value();
  for (int splits : {1, 5}) {
    kc::DecodeOptions o;
    o.force_splits = splits;
    o.ring_feed = GetParam().feed;
    auto plan = kc::plan(x.a, dev, o);
    ASSERT_TRUE(plan.is_ok());
    auto ws = kc::DeviceBuffer::create(std::max<size_t>(kc::workspace_size(x.a, plan.value()), 16));
    ASSERT_TRUE(ws.is_ok());
    std::vector<float> plain(x.n_out), timed(x.n_out);
    ASSERT_OK(x.out->fill_byte(0xFF));
    ASSERT_OK(kc::run(x.a, plan.value(), ws.value().get(), nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_OK(x.out->download(plain.data(), plain.size() * 4));

    const long long n = kc::cta_timeline_entries(plan.value(), x.a.geom.num_kv_heads);
    ASSERT_GT(n, 0);
    auto buf = kc::DeviceBuffer::create(static_cast<size_t>(n) * kc::kTimelineWords * 8);
    ASSERT_TRUE(buf.is_ok());
    ASSERT_OK(buf.value().fill_byte(0xFF));  // a row no CTA writes stays all ones and fails below
    kc::DecodePlan with = plan.value();
    with.cta_timeline = buf.value().as<unsigned long long>();
    ASSERT_OK(x.out->fill_byte(0xFF));
    ASSERT_OK(kc::run(x.a, with, ws.value().get(), nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_OK(x.out->download(timed.data(), timed.size() * 4));
    EXPECT_EQ(std::memcmp(plain.data(), timed.data(), plain.size() * 4), 0) << splits << " splits";

    std::vector<unsigned long long> rows(static_cast<size_t>(n) * kc::kTimelineWords);
    ASSERT_OK(buf.value().download(rows.data(), rows.size() * 8));
    long long with_work = 0;
    for (long long i = 0; i < n; ++i) {
      const unsigned long long* r = &rows[i * kc::kTimelineWords];
      ASSERT_LE(r[0], r[1]) << "CTA " << i;
      ASSERT_LT(r[1] - r[0], 1000000000ull) << "CTA " << i << ": a second or more, or an unwritten row";
      ASSERT_LT(r[2], static_cast<unsigned long long>(dev.sm_count)) << "CTA " << i;
      if (r[3] == 0) continue;  // no main pages (a short sequence's empty split)
      ++with_work;
      if (r[4] != 0)  // warp 0's first and last main page (0: warp 0 had none)
        ASSERT_TRUE(r[4] >= r[0] && r[5] >= r[4] && r[1] >= r[5]) << "CTA " << i << ": pages outside the CTA";
      ASSERT_NE(r[11], 0u) << "CTA " << i;
      ASSERT_GT(r[12], r[11]) << "CTA " << i;
      // The warps' merge in steps: every warp past its pages, their rows written, the heads' weights, the end.
      ASSERT_TRUE(r[10] >= r[0] && r[13] >= r[10] && r[14] >= r[13] && r[1] >= r[14] && r[13] != 0)
          << "CTA " << i << ": the merge's marks out of order or unset";
      // cycles per ns: an SM clock between 0.1 and 5 GHz
      const double ghz = static_cast<double>(r[12] - r[11]) / static_cast<double>(std::max(r[1] - r[0], 1ull));
      EXPECT_GT(ghz, 0.1) << "CTA " << i;
      EXPECT_LT(ghz, 5.0) << "CTA " << i;
    }
    EXPECT_GT(with_work, 0);
  }
}
INSTANTIATE_TEST_SUITE_P(Kernels, CudaDecodeTimeline,
                         ::testing::Values(TimelineCase{Format::kFp8E4m3, 128, kc::RingFeed::kAuto},
                                           TimelineCase{Format::kInt4, 64, kc::RingFeed::kProducer},
                                           TimelineCase{Format::kInt8, 128, kc::RingFeed::kSelf},
                                           TimelineCase{Format::kBf16, 256, kc::RingFeed::kAuto}),
                         [](const auto& info) {
                           return std::string(format_name(info.param.format)) + "_D" + std::to_string(info.param.head_dim);
                         });

}  // namespace
}  // namespace kvq::attention
